"""Batched LoRA in Triton: shrink (x A^T) and expand (y += h B^T) over rows grouped by adapter.

Same semantics as kernels/lora/reference.py. Each program takes one tile of the batch layout
(kernels/lora/meta.py): up to BLOCK_M rows of one slot, gathered by row id, so one tile reads
its adapter's matrices once for all its rows and multiplies with tensor cores. Prefill chunks
give full tiles (segmented), decode batches short ones (gathered). Tiles with slot -1 return at
once, so a captured graph replays any mix of adapters.

Shrink splits K across programs until the batch's tiles fill the GPU (a tile would otherwise
walk all of K alone) and adds the partial sums atomically into a zeroed float32 h.

`lora_add` is what a layer calls. At up to FUSED_MAX_ROWS rows (small decode batches, batch-1
above all) it launches one kernel instead of three (memset, shrink, expand): each program
recomputes its tile's shrink for one output shard, then expands a run of that shard's columns.
The shrink is R x K multiply-adds per row, so the recomputation costs the programs of a tile
extra L2 reads of A (R x K x 2 bytes each, a few MB per layer in all), while it saves two
launches and the memset, which is what a few-row step pays for: kernel latency, not bytes.
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


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr,
                  tile_len_ptr, K, N, R, shard1, shard2, cols, stride_xm, stride_as, stride_ar,
                  stride_bs, stride_bn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    slot, rows, m_mask = _tile_rows(sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                                    tile, BLOCK_M)
    # A program's columns never straddle two shards (cols divides the shard starts).
    n_lo = tl.program_id(1) * cols
    shard = (n_lo >= shard1).to(tl.int32) + (n_lo >= shard2).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as + (shard * R).to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    h = acc.to(b_ptr.dtype.element_ty)  # as lora_expand reads h: rounded to the adapter dtype
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for n0 in range(n_lo, n_lo + cols, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(h, b, input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(weights: torch.Tensor) -> str:
    """float32 adapters multiply in full precision (TF32 would move greedy tokens off the
    reference); 16-bit ones ignore the setting."""
    return "ieee" if weights.dtype == torch.float32 else "tf32"


_BLOCK_K = 64
# Shrink programs a batch should fill (about one per SM of a large GPU): fewer full tiles split
# K further. A decode batch of 512 rows in 64-row tiles has 8 to 16 tiles of work; unsplit,
# each would walk K (4096 to 14336) alone while the rest of the GPU waits.
_TARGET_PROGRAMS = 128
_MAX_SPLIT = 32
# Batches of at most this many rows (one decode tile) take the fused one-kernel path.
FUSED_MAX_ROWS = 16
_FUSED_BLOCK_K = 128


def shrink_split(num_tokens: int, k: int, block_m: int, r_blocks: int) -> int:
    """Programs to split K over: enough that the batch's full tiles fill _TARGET_PROGRAMS,
    each walking at least 256 of K."""
    tiles = triton.cdiv(num_tokens, block_m) * r_blocks
    return max(1, min(_MAX_SPLIT, k // 256, triton.cdiv(_TARGET_PROGRAMS, tiles)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMeta,
                split: int | None = None) -> torch.Tensor:
    """h [T, n_sub * R] float32 = x A[slot]^T for rows with an adapter (others undefined).
    split: programs over K (default shrink_split)."""
    t, k = x.shape
    r_total = a.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    block_r = max(16, min(64, triton.next_power_of_2(r_total)))
    if split is None:
        split = shrink_split(t, k, meta.block_m, triton.cdiv(r_total, block_r))
    k_per_split = triton.cdiv(triton.cdiv(k, split), _BLOCK_K) * _BLOCK_K
    split = triton.cdiv(k, k_per_split)
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


def fused_cols(shard_starts: tuple[int, ...], n: int) -> int:
    """Output columns per fused program: about a quarter of a large layer's K (then the
    expand's reads of B stay below the shrink's of A), a power of two that divides every shard
    start."""
    g = 0
    for s in shard_starts[1:]:
        g = math.gcd(g, s)
    cols = 2048 if n > 8192 else 1024
    while cols > 16 and g % cols:
        cols //= 2
    return cols


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       meta: LoRAMeta, shard_starts: tuple[int, ...]) -> torch.Tensor:
    """lora_expand(y, lora_shrink(x, a), b) in one kernel (see the module docstring); y is
    updated in place and returned."""
    if y.stride(1) != 1:
        raise ValueError("lora_shrink_expand writes y in place: its rows must be contiguous")
    if x.stride(1) != 1:
        x = x.contiguous()
    k, n, rank = x.shape[1], b.shape[1], b.shape[2]
    block_n = expand_block_n(shard_starts, n)
    cols = max(block_n, fused_cols(shard_starts, n))
    starts = (*shard_starts[1:], n, n)
    grid = (meta.num_tiles, triton.cdiv(n, cols))
    _fused_kernel[grid](
        x, a, b, y, meta.sorted_ids, meta.tile_slot, meta.tile_start, meta.tile_len,
        k, n, rank, starts[0], starts[1], cols, x.stride(0), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_K=_FUSED_BLOCK_K, PRECISION=_precision(b), num_warps=4)
    return y


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta: LoRAMeta, shard_starts: tuple[int, ...]) -> torch.Tensor:
    """y += each row's adapter delta x A[slot]^T B[slot]^T, in place; returns y. One fused
    kernel for small batches, shrink then expand for larger ones."""
    if meta.num_tokens <= FUSED_MAX_ROWS:
        return lora_shrink_expand(x, y, a, b, meta, shard_starts)
    return lora_expand(y, lora_shrink(x, a, meta), b, meta, shard_starts)
