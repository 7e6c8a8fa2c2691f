"""Batched LoRA in Triton: shrink (x A^T) and expand (y += h B^T) over rows grouped by adapter.

Same semantics as kernels/lora/reference.py. Each program takes one tile of the batch layout
(kernels/lora/meta.py): up to BLOCK_M rows of one slot, gathered by row id, so one tile reads
its adapter's matrices once for all its rows and multiplies with tensor cores. Prefill chunks
give full tiles (segmented), decode batches short ones (gathered). Tiles with slot -1 return at
once, so a captured graph replays any mix of adapters.

Decode-sized batches (up to _SPLIT_K_ROWS rows) split the shrink's K across programs (a tile
would otherwise walk all of K alone) and add the partial sums atomically into a zeroed float32
h; larger batches have tiles enough to fill the GPU unsplit.

`lora_add` is what a layer calls: shrink, then expand.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from slipstream.kernels.lora.meta import LoRAMeta


@triton.jit
def _tile_rows(sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr, tile,
               BLOCK_M: tl.constexpr):
    slot = tl.load(tile_slot_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    n = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n
    rows = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, rows, m_mask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                   K, R, stride_xm, stride_as, stride_ar, stride_hm, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   ATOMIC: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    slot, rows, m_mask = _tile_rows(sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                                    tile, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    k_lo = tl.program_id(2) * k_per_split
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_r[None, :]
    mask = m_mask[:, None] & r_mask[None, :]
    if ATOMIC:
        tl.atomic_add(h_ptrs, acc, mask=mask)
    else:
        tl.store(h_ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                   N, R, shard1, shard2, stride_hm, stride_bs, stride_bn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    slot, rows, m_mask = _tile_rows(sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                                    tile, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # A tile never straddles two shards (BLOCK_N divides the shard starts): one h column range.
    shard = (n0 >= shard1).to(tl.int32) + (n0 >= shard2).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    h = tl.load(h_ptr + rows[:, None] * stride_hm + shard * R + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
                + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    acc = tl.dot(h.to(b.dtype), b, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(weights: torch.Tensor) -> str:
    """float32 adapters multiply in full precision (TF32 would move greedy tokens off the
    reference); 16-bit ones ignore the setting."""
    return "ieee" if weights.dtype == torch.float32 else "tf32"


_BLOCK_K = 64
_SPLIT_K_ROWS = 64  # batches of at most this many rows split K across programs


def shrink_split(num_tokens: int, k: int) -> int:
    """Programs to split K over: up to 16, each walking at least 256 of K, for batches of at
    most _SPLIT_K_ROWS rows; 1 above."""
    return max(1, min(16, k // 256)) if num_tokens <= _SPLIT_K_ROWS else 1


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMeta, split: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, n_sub * R] float32 = x A[slot]^T for rows with an adapter (others undefined).
    split: programs over K (default shrink_split). out: h's buffer, zeroed by the caller (then
    no memset here), with contiguous rows."""
    t, k = x.shape
    r_total = a.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    block_r = max(16, min(64, triton.next_power_of_2(r_total)))
    if split is None:
        split = shrink_split(t, k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), _BLOCK_K) * _BLOCK_K
    split = triton.cdiv(k, k_per_split)
    if out is not None:
        h = out
    else:
        alloc = torch.zeros if split > 1 else torch.empty
        h = alloc((t, r_total), dtype=torch.float32, device=x.device)
    grid = (meta.num_tiles, triton.cdiv(r_total, block_r), split)
    _shrink_kernel[grid](
        x, a, h, meta.sorted_ids, meta.tile_slot, meta.tile_start, meta.tile_len,
        k, r_total, x.stride(0), a.stride(0), a.stride(1), h.stride(0), k_per_split,
        BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, ATOMIC=split > 1,
        PRECISION=_precision(a), num_warps=4)
    return h


def expand_block_n(shard_starts: tuple[int, ...], n: int) -> int:
    """Largest power of two up to 128 that divides every shard start (so no tile straddles)."""
    g = 0
    for s in shard_starts[1:]:
        g = math.gcd(g, s)
    block = 128
    while block > 16 and g % block:
        block //= 2
    if g % block:
        raise ValueError(f"LoRA shards start at {shard_starts}: not multiples of 16")
    return block


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, meta: LoRAMeta,
                shard_starts: tuple[int, ...]) -> torch.Tensor:
    """y[:, shard j] += h[:, j R:(j + 1) R] B[slot][shard j]^T in place; returns y."""
    if y.stride(1) != 1:
        raise ValueError("lora_expand writes y in place: its rows must be contiguous")
    n, rank = b.shape[1], b.shape[2]
    block_n = expand_block_n(shard_starts, n)
    starts = (*shard_starts[1:], n, n)
    grid = (meta.num_tiles, triton.cdiv(n, block_n))
    _expand_kernel[grid](
        h, b, y, meta.sorted_ids, meta.tile_slot, meta.tile_start, meta.tile_len,
        n, rank, starts[0], starts[1], h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        PRECISION=_precision(b), num_warps=4)
    return y


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta: LoRAMeta, shard_starts: tuple[int, ...],
             h: torch.Tensor | None = None) -> torch.Tensor:
    """y += each row's adapter delta x A[slot]^T B[slot]^T, in place; returns y. h: a zeroed
    buffer for the shrink (see lora_shrink), else it allocates its own."""
    return lora_expand(y, lora_shrink(x, a, meta, out=h), b, meta, shard_starts)
