"""Batched LoRA in Triton: shrink (x A^T) and expand (y += h B^T) over rows grouped by adapter.

Same semantics as kernels/lora/reference.py. Each program takes one tile of the batch layout
(kernels/lora/meta.py): up to BLOCK_M rows of one slot, gathered by row id, so one tile reads
its adapter's matrices once for all its rows and multiplies with tensor cores. Prefill chunks
give full tiles (segmented), decode batches short ones (gathered). Tiles with slot -1 return at
once, so a captured graph replays any mix of adapters.

Shrink splits K across programs until the batch's tiles fill the GPU (a tile would otherwise
walk all of K alone) and adds the partial sums atomically into a zeroed float32 h.

`lora_add` is what a layer calls. At up to FUSED_MAX_ROWS rows (small decode batches, batch-1
above all) it launches one kernel instead of three (memset, shrink, expand), since a few-row
step pays for kernel latency, not bytes. Its programs are (tile, chunk of output columns, split
of K): each stores its partial shrink for the chunk's shard in a preallocated workspace and
bumps the chunk's arrival counter; the last split to arrive sums the partials in split order
(deterministic), expands the chunk and resets the counter for the next launch. Each chunk
re-reads its shard's A slice (fused_plan bounds that to a few MB of L2 reads per tile).

`lora_act` does the same for a [gate | up] projection and writes SiLU(gate)·up, the down
projection's input: at one row in one kernel, above FUSED_MAX_ROWS rows as shrink + an expand
that reads the product once and writes the activation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels.lora.meta import LoRAMeta, block_m_for, max_tiles


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
def _expand_rows(h, b_base, y_ptr, rows, m_mask, offs_r, r_mask, n_lo, n_hi, stride_bn, stride_ym,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """y[rows, n_lo:n_hi] += h B[n_lo:n_hi]^T (h: [BLOCK_M, BLOCK_R], adapter dtype)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(h, b, input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, part_ptr, count_ptr, sorted_ptr, tile_slot_ptr,
                  tile_start_ptr, tile_len_ptr, K, N, R, shard1, shard2, num_shards, cols,
                  k_per_split, stride_xm, stride_as, stride_ar, stride_bs, stride_bn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """y[rows, chunk] += (x[rows] A[slot, shard]^T) B[slot, chunk]^T for one (tile, chunk,
    K split); see the module docstring."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    slot, rows, m_mask = _tile_rows(sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                                    tile, BLOCK_M)
    chunk = tl.program_id(1)
    # A program's columns never straddle two shards (cols divides the shard starts).
    n_lo = chunk * cols
    n_hi = tl.minimum(n_lo + cols, N)
    shard = (n_lo >= shard1).to(tl.int32) + (n_lo >= shard2).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as + (shard * R).to(tl.int64) * stride_ar
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    k_lo = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    if SPLIT == 1:
        _expand_rows(acc.to(b_ptr.dtype.element_ty), b_base, y_ptr, rows, m_mask, offs_r, r_mask,
                     n_lo, n_hi, stride_bn, stride_ym, BLOCK_N, PRECISION)
    else:
        # Each K split leaves its partial shrink for (tile, shard); the last of a chunk's splits
        # to arrive sums them (in split order: deterministic) and expands the chunk's columns.
        # Every chunk of a shard writes the same partials, so any chunk's copies will do.
        tile_part = (tile * num_shards + shard).to(tl.int64) * (SPLIT * BLOCK_M * BLOCK_R)
        offs_part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + offs_r[None, :]
        part_mask = m_mask[:, None] & r_mask[None, :]  # the tile's rows only: no bytes for the rest
        tl.store(part_ptr + tile_part + tl.program_id(2) * (BLOCK_M * BLOCK_R) + offs_part, acc,
                 mask=part_mask)
        counter = count_ptr + tile * tl.num_programs(1) + chunk
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if arrived == SPLIT - 1:
            tl.store(counter, 0)  # ready for the next launch: no memset
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for i in range(SPLIT):
                acc += tl.load(part_ptr + tile_part + i * (BLOCK_M * BLOCK_R) + offs_part,
                               mask=part_mask, other=0.0, cache_modifier=".cg")
            _expand_rows(acc.to(b_ptr.dtype.element_ty), b_base, y_ptr, rows, m_mask, offs_r,
                         r_mask, n_lo, n_hi, stride_bn, stride_ym, BLOCK_N, PRECISION)


@triton.jit
def _shrink_row(x_ptr, a_base, k_lo, k_per_split, K, stride_ar, BLOCK_M: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, R, PRECISION: tl.constexpr):
    """Row 0 of x times A[:R, k_lo:k_lo + k_per_split]^T, as a [BLOCK_M, BLOCK_R] tile."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * 0 + offs_k[None, :],
                    mask=(offs_m[:, None] == 0) & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=(offs_r[None, :] < R) & k_mask[:, None], other=0.0)
        acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
    return acc


@triton.jit
def _gate_out_kernel(x_ptr, a_ptr, b_ptr, y_ptr, out_ptr, part_ptr, count_ptr, token_slots_ptr,
                     K, INTER, R, cols, k_per_split, stride_as, stride_ar, stride_bs, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """One row of a [gate | up] projection: out = silu(gate + dgate) * (up + dup), the deltas
    as in _fused_kernel (partials, the last split of a chunk expands)."""
    slot = tl.load(token_slots_ptr)
    chunk = tl.program_id(0)
    split = tl.program_id(1)
    n_lo = chunk * cols
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    tile = BLOCK_M * BLOCK_R
    offs_part = offs_m[:, None] * BLOCK_R + offs_r[None, :]
    last = split == 0
    if slot >= 0:
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        k_lo = split * k_per_split
        acc_g = _shrink_row(x_ptr, a_base, k_lo, k_per_split, K, stride_ar, BLOCK_M, BLOCK_R,
                            BLOCK_K, R, PRECISION)
        acc_u = _shrink_row(x_ptr, a_base + R * stride_ar, k_lo, k_per_split, K, stride_ar,
                            BLOCK_M, BLOCK_R, BLOCK_K, R, PRECISION)
        if SPLIT > 1:
            row0 = (offs_m[:, None] == 0) & r_mask[None, :]
            tl.store(part_ptr + split * tile + offs_part, acc_g, mask=row0)
            tl.store(part_ptr + (SPLIT + split) * tile + offs_part, acc_u, mask=row0)
            counter = count_ptr + chunk
            tl.debug_barrier()  # every thread's partial stored before the release below
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            last = arrived == SPLIT - 1
            if last:
                tl.store(counter, 0)  # ready for the next launch: no memset
                acc_g = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for i in range(SPLIT):
                    acc_g += tl.load(part_ptr + i * tile + offs_part, mask=row0, other=0.0,
                                     cache_modifier=".cg")
                    acc_u += tl.load(part_ptr + (SPLIT + i) * tile + offs_part, mask=row0,
                                     other=0.0, cache_modifier=".cg")
    else:  # no adapter: the activation alone
        acc_g = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if last:
        b_base = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
        h_g = acc_g.to(b_ptr.dtype.element_ty)
        h_u = acc_u.to(b_ptr.dtype.element_ty)
        for n0 in range(n_lo, n_lo + cols, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < INTER
            mask_b = r_mask[:, None] & n_mask[None, :]
            b_g = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=mask_b,
                          other=0.0)
            b_u = tl.load(b_base + (INTER + offs_n[None, :]) * stride_bn + offs_r[:, None],
                          mask=mask_b, other=0.0)
            d_g = tl.dot(h_g, b_g, input_precision=PRECISION)
            d_u = tl.dot(h_u, b_u, input_precision=PRECISION)
            row = (offs_m[:, None] == 0) & n_mask[None, :]
            y_g = tl.load(y_ptr + offs_m[:, None] * 0 + offs_n[None, :], mask=row, other=0.0)
            y_u = tl.load(y_ptr + offs_m[:, None] * 0 + INTER + offs_n[None, :], mask=row,
                          other=0.0)
            act = _silu_mul(y_g, y_u, d_g, d_u)
            tl.store(out_ptr + offs_m[:, None] * 0 + offs_n[None, :], act, mask=row)


@triton.jit
def _silu_mul(y_g, y_u, d_g, d_u):
    """silu(gate) * up with the deltas added, each sum rounded to y's dtype first (as the
    unfused path stores the gate/up product), the activation in float32, in y's dtype."""
    g = (y_g.to(tl.float32) + d_g).to(y_g.dtype).to(tl.float32)
    u = (y_u.to(tl.float32) + d_u).to(y_u.dtype).to(tl.float32)
    return (g * tl.sigmoid(g) * u).to(y_g.dtype)


@triton.jit
def _expand_act_kernel(h_ptr, b_ptr, y_ptr, out_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr,
                       tile_len_ptr, INTER, R, stride_hm, stride_bs, stride_bn, stride_ym,
                       stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """out[rows] = silu(gate + h_g B_g^T) * (up + h_u B_u^T) for one tile's rows: the expand
    of a [gate | up] projection writing the down projection's input, not the product."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    slot, rows, m_mask = _tile_rows(sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
                                    tile, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    h_mask = m_mask[:, None] & r_mask[None, :]
    h_g = tl.load(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], mask=h_mask, other=0.0)
    h_u = tl.load(h_ptr + rows[:, None] * stride_hm + R + offs_r[None, :], mask=h_mask,
                  other=0.0)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    b_mask = r_mask[:, None] & n_mask[None, :]
    b_g = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=b_mask, other=0.0)
    b_u = tl.load(b_base + (INTER + offs_n[None, :]) * stride_bn + offs_r[:, None], mask=b_mask,
                  other=0.0)
    d_g = tl.dot(h_g.to(b_g.dtype), b_g, input_precision=PRECISION)
    d_u = tl.dot(h_u.to(b_u.dtype), b_u, input_precision=PRECISION)
    mask = m_mask[:, None] & n_mask[None, :]
    y_row = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    y_g = tl.load(y_row, mask=mask, other=0.0)
    y_u = tl.load(y_row + INTER, mask=mask, other=0.0)
    act = _silu_mul(y_g, y_u, d_g, d_u)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], act, mask=mask)


@triton.jit
def _act_rest_kernel(y_ptr, out_ptr, token_slots_ptr, T, INTER, stride_ym, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = silu(gate) * up for the rows without an adapter (the tiles cover the others)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(token_slots_ptr + rows, mask=rows < T, other=0)
    m_mask = (rows < T) & (slots < 0)
    if tl.max(m_mask.to(tl.int32), axis=0) == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (offs_n < INTER)[None, :]
    y_row = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    y_g = tl.load(y_row, mask=mask, other=0.0)
    y_u = tl.load(y_row + INTER, mask=mask, other=0.0)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    act = _silu_mul(y_g, y_u, zero, zero)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :], act, mask=mask)


def _precision(weights: torch.Tensor) -> str:
    """float32 adapters multiply in full precision (TF32 would move greedy tokens off the
    reference); 16-bit ones ignore the setting."""
    return "ieee" if weights.dtype == torch.float32 else "tf32"


_BLOCK_K = 64
# Shrink programs a batch should fill (about two per SM of a large GPU): fewer full tiles split
# K further. A decode batch of 512 rows in 64-row tiles has 8 to 16 tiles of work; unsplit,
# each would walk K (4096 to 14336) alone while the rest of the GPU waits.
_TARGET_PROGRAMS = 256
_MAX_SPLIT = 32
# Batches of at most this many rows (one decode tile) take the fused one-kernel path (0: none
# do; every batch runs shrink + expand).
FUSED_MAX_ROWS = 16
_FUSED_BLOCK_K = 128


def shrink_split(num_tokens: int, k: int, block_m: int, r_blocks: int) -> int:
    """Programs to split K over: enough that the batch's full tiles fill _TARGET_PROGRAMS,
    each walking at least 256 of K."""
    tiles = triton.cdiv(num_tokens, block_m) * r_blocks
    return max(1, min(_MAX_SPLIT, k // 256, triton.cdiv(_TARGET_PROGRAMS, tiles)))


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
        split = shrink_split(t, k, meta.block_m, triton.cdiv(r_total, block_r))
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


@dataclass(frozen=True)
class FusedPlan:
    """How one projection's fused launch is cut: `cols` output columns per program (a power of
    two dividing every shard start), K over `split` programs (block `block_k`)."""

    cols: int
    split: int
    block_k: int
    block_r: int

    def scratch_sizes(self, num_shards: int, n: int, num_slots: int) -> tuple[int, int]:
        """(float32 partials, int32 arrival counters) a batch of up to FUSED_MAX_ROWS needs."""
        tiles = max_tiles(FUSED_MAX_ROWS, num_slots)
        parts = tiles * num_shards * self.split * block_m_for(FUSED_MAX_ROWS) * self.block_r
        return (parts if self.split > 1 else 0), tiles * triton.cdiv(n, self.cols)


# Each chunk of columns re-reads its shard's A (R x K): at most this many bytes of A per tile
# and projection, a few microseconds of L2 reads at worst.
_FUSED_A_BYTES = 4 << 20


def fused_plan(k: int, shard_starts: tuple[int, ...], n: int, rank: int) -> FusedPlan:
    """Chunks of columns as small as the A budget allows (their expand is the tail each chunk's
    last split adds to the critical path), K split into runs of about 256."""
    g = 0
    for s in shard_starts[1:]:
        g = math.gcd(g, s)
    block_r = max(16, triton.next_power_of_2(rank))
    chunks = max(1, _FUSED_A_BYTES // (block_r * k * 2))
    cols = max(expand_block_n(shard_starts, n), triton.next_power_of_2(triton.cdiv(n, chunks)))
    while cols > 16 and g % cols:
        cols //= 2
    cols = max(cols, expand_block_n(shard_starts, n))
    split = max(1, min(_MAX_SPLIT, k // 256))
    k_per_split = triton.cdiv(triton.cdiv(k, split), _FUSED_BLOCK_K) * _FUSED_BLOCK_K
    return FusedPlan(cols=cols, split=triton.cdiv(k, k_per_split), block_k=_FUSED_BLOCK_K,
                     block_r=block_r)


def fused_scratch(shapes: list[tuple[int, tuple[int, ...], int]], rank: int, num_slots: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (partials, counters) for lora_shrink_expand on projections of these (K, shard
    starts, N) shapes. The kernel leaves the counters at zero again and launches on one stream
    run one after another, so one pair serves every projection."""
    parts, counters = 1, 1
    for k, shard_starts, n in shapes:
        plan = fused_plan(k, shard_starts, n, rank)
        p, c = plan.scratch_sizes(len(shard_starts), n, num_slots)
        parts, counters = max(parts, p), max(counters, c)
    return (torch.empty(parts, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device))


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       meta: LoRAMeta, shard_starts: tuple[int, ...],
                       scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """lora_expand(y, lora_shrink(x, a), b) in one kernel (see the module docstring); y is
    updated in place and returned. scratch: fused_scratch's buffers, at least this shape's."""
    if y.stride(1) != 1:
        raise ValueError("lora_shrink_expand writes y in place: its rows must be contiguous")
    if meta.num_tokens > FUSED_MAX_ROWS:
        raise ValueError(f"the fused LoRA kernel takes up to {FUSED_MAX_ROWS} rows, "
                         f"not {meta.num_tokens}")
    if x.stride(1) != 1:
        x = x.contiguous()
    k, n, rank = x.shape[1], b.shape[1], b.shape[2]
    plan = fused_plan(k, shard_starts, n, rank)
    if scratch is None:
        scratch = fused_scratch([(k, shard_starts, n)], rank, a.shape[0], x.device)
    parts, counters = scratch
    k_per_split = triton.cdiv(k, plan.split)
    k_per_split = triton.cdiv(k_per_split, plan.block_k) * plan.block_k
    starts = (*shard_starts[1:], n, n)
    grid = (meta.num_tiles, triton.cdiv(n, plan.cols), plan.split)
    _fused_kernel[grid](
        x, a, b, y, parts, counters, meta.sorted_ids, meta.tile_slot, meta.tile_start,
        meta.tile_len, k, n, rank, starts[0], starts[1], len(shard_starts), plan.cols,
        k_per_split, x.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=meta.block_m, BLOCK_N=expand_block_n(shard_starts, n),
        BLOCK_R=plan.block_r, BLOCK_K=plan.block_k, SPLIT=plan.split,
        PRECISION=_precision(b), num_warps=4)
    return y


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta: LoRAMeta, shard_starts: tuple[int, ...],
             scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
             h: torch.Tensor | None = None) -> torch.Tensor:
    """y += each row's adapter delta x A[slot]^T B[slot]^T, in place; returns y. One fused
    kernel for small batches (scratch: fused_scratch's buffers), shrink then expand for larger
    ones (h: a zeroed buffer for the shrink, see lora_shrink)."""
    if meta.num_tokens <= FUSED_MAX_ROWS:
        return lora_shrink_expand(x, y, a, b, meta, shard_starts, scratch)
    return lora_expand(y, lora_shrink(x, a, meta, out=h), b, meta, shard_starts)


def lora_gate_out(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  meta: LoRAMeta, shard_starts: tuple[int, ...],
                  scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """silu(gate) * up of one row's [gate | up] product y [1, 2I] with its adapter's delta
    added, in one kernel (what the separate activation kernel would read, computed where the
    delta is): [1, I]. A row without an adapter (slot -1) gets the activation alone."""
    if x.shape[0] != 1 or len(shard_starts) != 2 or 2 * shard_starts[1] != b.shape[1]:
        raise ValueError("lora_gate_out takes one row of a [gate | up] projection")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = y.contiguous()
    k, n, rank = x.shape[1], b.shape[1], b.shape[2]
    inter = n // 2
    plan = fused_plan(k, shard_starts, n, rank)
    if scratch is None:
        scratch = fused_scratch([(k, shard_starts, n)], rank, a.shape[0], x.device)
    parts, counters = scratch
    k_per_split = triton.cdiv(triton.cdiv(k, plan.split), plan.block_k) * plan.block_k
    out = torch.empty((1, inter), dtype=y.dtype, device=y.device)
    grid = (triton.cdiv(inter, plan.cols), plan.split)
    _gate_out_kernel[grid](
        x, a, b, y, out, parts, counters, meta.token_slots, k, inter, rank, plan.cols,
        k_per_split, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        BLOCK_M=block_m_for(1), BLOCK_N=expand_block_n(shard_starts, n), BLOCK_R=plan.block_r,
        BLOCK_K=plan.block_k, SPLIT=plan.split, PRECISION=_precision(b), num_warps=4)
    return out


def lora_expand_act(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, meta: LoRAMeta,
                    shard_starts: tuple[int, ...]) -> torch.Tensor:
    """silu(gate) * up [T, I] of a [gate | up] product y [T, 2I] with each row's delta
    h[:, shard j] B[slot][shard j]^T added: lora_expand and the activation in one pass over y
    (it reads y once and writes half of it, where expand-then-activation reads it twice and
    writes it once more). Rows without an adapter get the activation alone."""
    t, n = y.shape
    if len(shard_starts) != 2 or 2 * shard_starts[1] != n or y.stride(1) != 1:
        raise ValueError("lora_expand_act takes a [gate | up] product with contiguous rows")
    inter, rank = n // 2, b.shape[2]
    block_n = expand_block_n(shard_starts, n)
    out = torch.empty((t, inter), dtype=y.dtype, device=y.device)
    _expand_act_kernel[(meta.num_tiles, triton.cdiv(inter, block_n))](
        h, b, y, out, meta.sorted_ids, meta.tile_slot, meta.tile_start, meta.tile_len, inter,
        rank, h.stride(0), b.stride(0), b.stride(1), y.stride(0), out.stride(0),
        BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        PRECISION=_precision(b), num_warps=4)
    rest_m = 64
    _act_rest_kernel[(triton.cdiv(t, rest_m), triton.cdiv(inter, block_n))](
        y, out, meta.token_slots, t, inter, y.stride(0), out.stride(0), BLOCK_M=rest_m,
        BLOCK_N=block_n, num_warps=4)
    return out


def lora_act(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta: LoRAMeta, shard_starts: tuple[int, ...],
             scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
             h: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of a [gate | up] product y of x with each row's adapter delta added,
    the activation inside the LoRA kernels where it can: one row in one kernel
    (lora_gate_out), more than FUSED_MAX_ROWS rows as shrink + lora_expand_act; in between,
    the fused lora_add, then the activation kernel."""
    t = x.shape[0]
    if t == 1 <= FUSED_MAX_ROWS:
        return lora_gate_out(x, y, a, b, meta, shard_starts, scratch)
    if t > FUSED_MAX_ROWS:
        return lora_expand_act(y, lora_shrink(x, a, meta, out=h), b, meta, shard_starts)
    from slipstream.kernels.norm_act.activation import silu_and_mul

    return silu_and_mul(lora_shrink_expand(x, y, a, b, meta, shard_starts, scratch))
