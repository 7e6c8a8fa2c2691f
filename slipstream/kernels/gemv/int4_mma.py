"""W4A16 GEMV on tensor cores for 1-16 rows of bf16 x: mma.sync m16n8k16 with the weight
nibbles unpacked straight into the A fragments (no shared memory, no layout conversion).

Each warp owns 16 weight rows (TILES = 2: 32) over the program's K range, one group (128) per
step. Lane (g, t) = (lane // 4, lane % 4) holds, for weight rows g and g + 8, nibble pairs
(a, a + 4) of word t + 4c of the group's row: the K order inside an mma is free as long as the
B fragment (row n = g of x; rows past M re-read row M - 1; above 8 rows a second mma per A
fragment takes rows g + 8) follows the same permutation, so
each lane loads only the words it uses and one shift and one LOP3 make two A values. A value
is 128 + q (the nibble ORed under bf16's exponent of 128, exact); the mma sums (128 + q) x in
float32, one more mma with A = 1 gives sum x, and s (D - (128 + z) sum x) is added per group
(float zeros, the zero point times the scale: s (D - 128 sum x) - zs sum x).
Each lane ends with rows g, g + 8 of its tiles for x rows n = 2t, 2t + 1.

ASM (CUDA): the mma in PTX. In the interpreter its twin (kernels/gemv/mma_fragments.py) emulates
the instruction on the per-lane tensors, so the CPU tests check every address and index;
only the PTX needs the GPU. A tuner candidate for MIN_ROWS-16 rows (the fastest int4 GEMV at
4 and 16 rows; at one row the chained FMA kernel of kernels/gemv/int4.py is faster).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv.int4_common import x_pairs, x_pairs_prmt
from slipstream.kernels.gemv.mma_fragments import (
    lane_rows,
    mma,
    store_gate_out,
    store_lanes,
    tiles_per_warp,
)
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

MIN_ROWS = 2  # at one row the chained FMA kernel is faster
NARROW_ROWS = 8  # one n8 mma step per A fragment
MAX_ROWS = 16  # two above NARROW_ROWS (WIDE)
GROUP_SIZE = 128  # the group the kernel steps by (each lane reads four words of a row per group)
_GROUP = tl.constexpr(GROUP_SIZE)

@triton.jit
def _pair(w, mask, A: tl.constexpr):
    """Nibbles A and A + 4 of each word as the bf16 pair (128 + q_A, 128 + q_A+4). mask is
    0x000F000F held in a register (a LOP3 takes one immediate: as a constant ptxas would
    rematerialise it before every use)."""
    return ((w.to(tl.uint32, bitcast=True) >> (4 * A)) & mask) | 0x43004300


@triton.jit
def _word_steps(lw, hw, xq, yq, d0, d1, d2, d3, e0, e1, e2, e3, mask, NW: tl.constexpr,
                WIDE: tl.constexpr, ASM: tl.constexpr):
    """The two mma steps of one word column: pairs 0, 1 then 2, 3 of the lane's word of rows g
    (lw) and g + 8 (hw), against the same pairs of x (xq: x_pairs' four) into d; WIDE: the
    same A fragments also against x rows 8-15 (yq) into e."""
    a0, a1 = _pair(lw, mask, 0), _pair(hw, mask, 0)
    a2, a3 = _pair(lw, mask, 1), _pair(hw, mask, 1)
    d0, d1, d2, d3 = mma(a0, a1, a2, a3, xq[0], xq[1], d0, d1, d2, d3, NW, ASM)
    if WIDE:
        e0, e1, e2, e3 = mma(a0, a1, a2, a3, yq[0], yq[1], e0, e1, e2, e3, NW, ASM)
    a0, a1 = _pair(lw, mask, 2), _pair(hw, mask, 2)
    a2, a3 = _pair(lw, mask, 3), _pair(hw, mask, 3)
    d0, d1, d2, d3 = mma(a0, a1, a2, a3, xq[2], xq[3], d0, d1, d2, d3, NW, ASM)
    if WIDE:
        e0, e1, e2, e3 = mma(a0, a1, a2, a3, yq[2], yq[3], e0, e1, e2, e3, NW, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3


@triton.jit
def _x_sums(xq0, xq1, xq2, xq3, one, NW: tl.constexpr, ASM: tl.constexpr):
    """sum of the group's x for the lane's columns n = 2t, 2t + 1: mma steps with A = one, the
    bf16 pair (1, 1) (a runtime value, kept in registers like _pair's mask)."""
    z = tl.zeros([32 * NW], tl.float32)
    s = _ones_steps(xq0, one, z, z, z, z, NW, ASM)
    s = _ones_steps(xq1, one, s[0], s[1], s[2], s[3], NW, ASM)
    s = _ones_steps(xq2, one, s[0], s[1], s[2], s[3], NW, ASM)
    return _ones_steps(xq3, one, s[0], s[1], s[2], s[3], NW, ASM)


@triton.jit
def _ones_steps(xq, one, s0, s1, s2, s3, NW: tl.constexpr, ASM: tl.constexpr):
    """Two mma steps with A = one against one word column's x pairs, added to s."""
    s0, s1, s2, s3 = mma(one, one, one, one, xq[0], xq[1], s0, s1, s2, s3, NW, ASM)
    return mma(one, one, one, one, xq[2], xq[3], s0, s1, s2, s3, NW, ASM)


@triton.jit
def _scaled(acc0, acc1, acc2, acc3, d0, d1, d2, d3, s_lo, s_hi, z_lo, z_hi, sx0, sx1, f_lo,
            f_hi, FLOAT_ZERO: tl.constexpr):
    """acc + s (D - (128 + z) sum x): rows lo (acc0, acc1), hi (acc2, acc3); z is 128 + zero.
    FLOAT_ZERO: z is 128 and f the float zero (times the scale), subtracted as f sum x."""
    acc0, acc1 = acc0 + s_lo * (d0 - z_lo * sx0), acc1 + s_lo * (d1 - z_lo * sx1)
    acc2, acc3 = acc2 + s_hi * (d2 - z_hi * sx0), acc3 + s_hi * (d3 - z_hi * sx1)
    if FLOAT_ZERO:
        acc0, acc1 = acc0 - f_lo * sx0, acc1 - f_lo * sx1
        acc2, acc3 = acc2 - f_hi * sx0, acc3 - f_hi * sx1
    return acc0, acc1, acc2, acc3


@triton.jit
def _tile_words(w_ptr, r_lo, r_hi, stride_wn, k, t):
    """The lane's words of one 16-row tile for the group at k: words t + 4c (c = 0..3) of rows
    r_lo, then of r_hi."""
    wl = w_ptr + r_lo * stride_wn + k // 8 + t
    wh = w_ptr + r_hi * stride_wn + k // 8 + t
    return (tl.load(wl), tl.load(wl + 4), tl.load(wl + 8), tl.load(wl + 12),
            tl.load(wh), tl.load(wh + 4), tl.load(wh + 8), tl.load(wh + 12))


@triton.jit
def _tile_group(w, s_ptr, z_ptr, r_lo, r_hi, stride_sn, stride_zn, k, xq, yq, sx, sy,
                a0, a1, a2, a3, b0, b1, b2, b3, mask, NW: tl.constexpr, WIDE: tl.constexpr,
                ASM: tl.constexpr, FLOAT_ZERO: tl.constexpr):
    """One group of one 16-row tile (w: _tile_words): eight mma steps, then the scaled,
    zero-corrected sums added to a (x rows 0-7) and, WIDE, b (x rows 8-15). xq / yq: the four
    word columns' x pairs; sx / sy: the group's sums of x (_x_sums)."""
    z = tl.zeros([32 * NW], tl.float32)
    d = _word_steps(w[0], w[4], xq[0], yq[0], z, z, z, z, z, z, z, z, mask, NW, WIDE, ASM)
    for c in tl.static_range(1, 4):
        d = _word_steps(w[c], w[4 + c], xq[c], yq[c], d[0], d[1], d[2], d[3], d[4], d[5],
                        d[6], d[7], mask, NW, WIDE, ASM)
    gi = k // _GROUP
    s_lo = tl.load(s_ptr + r_lo * stride_sn + gi).to(tl.float32)
    s_hi = tl.load(s_ptr + r_hi * stride_sn + gi).to(tl.float32)
    f_lo = tl.load(z_ptr + r_lo * stride_zn + gi).to(tl.float32)
    f_hi = tl.load(z_ptr + r_hi * stride_zn + gi).to(tl.float32)
    if FLOAT_ZERO:
        z_lo, z_hi = 128.0, 128.0
    else:
        z_lo, z_hi = 128.0 + f_lo, 128.0 + f_hi
    a0, a1, a2, a3 = _scaled(a0, a1, a2, a3, d[0], d[1], d[2], d[3], s_lo, s_hi, z_lo, z_hi,
                             sx[0], sx[1], f_lo, f_hi, FLOAT_ZERO)
    if WIDE:
        b0, b1, b2, b3 = _scaled(b0, b1, b2, b3, d[4], d[5], d[6], d[7], s_lo, s_hi, z_lo, z_hi,
                                 sy[0], sy[1], f_lo, f_hi, FLOAT_ZERO)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _group_pairs(x_row, k, t, ASM: tl.constexpr):
    """The lane's x pairs for the group at k: word columns t, t + 4, t + 8, t + 12."""
    if ASM:
        return (x_pairs_prmt(x_row, k, t), x_pairs_prmt(x_row, k, t + 4),
                x_pairs_prmt(x_row, k, t + 8), x_pairs_prmt(x_row, k, t + 12))
    else:
        return (x_pairs(x_row, k, t), x_pairs(x_row, k, t + 4), x_pairs(x_row, k, t + 8),
                x_pairs(x_row, k, t + 12))


@triton.jit
def _group(wa, wb, k, x_row, y_row, t, s_ptr, z_ptr, r0, r1, r2, r3, stride_sn, stride_zn, one,
           mask, a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13,
           NW: tl.constexpr, TILES: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr,
           FLOAT_ZERO: tl.constexpr):
    """The group at k of every tile (wa: tile 0's words, wb: tile 1's): the x pairs and sums,
    then _tile_group per tile; returns the sixteen accumulators."""
    xq = _group_pairs(x_row, k, t, ASM)
    sx = _x_sums(xq[0], xq[1], xq[2], xq[3], one, NW, ASM)
    yq, sy = xq, sx
    if WIDE:
        yq = _group_pairs(y_row, k, t, ASM)
        sy = _x_sums(yq[0], yq[1], yq[2], yq[3], one, NW, ASM)
    a00, a01, a02, a03, b00, b01, b02, b03 = _tile_group(
        wa, s_ptr, z_ptr, r0, r1, stride_sn, stride_zn, k, xq, yq, sx, sy,
        a00, a01, a02, a03, b00, b01, b02, b03, mask, NW, WIDE, ASM, FLOAT_ZERO)
    if TILES == 2:
        a10, a11, a12, a13, b10, b11, b12, b13 = _tile_group(
            wb, s_ptr, z_ptr, r2, r3, stride_sn, stride_zn, k, xq, yq, sx, sy,
            a10, a11, a12, a13, b10, b11, b12, b13, mask, NW, WIDE, ASM, FLOAT_ZERO)
    return a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13


# M and the split count are runtime values (no recompile per batch size or shape).
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                   stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split, split_k,
                   NW: tl.constexpr, TILES: tl.constexpr, WIDE: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
                   USE_PDL: tl.constexpr = False, GATE_OUT: tl.constexpr = False,
                   PREFETCH: tl.constexpr = False, GROUPS: tl.constexpr = 1,
                   FLOAT_ZERO: tl.constexpr = False):
    """out[n, row] for the rows of this program's BLOCK_N = 16 TILES NW and x rows n < M <= 8
    (WIDE: M <= 16, a second n8 mma per A fragment for x rows 8-15). GATE_OUT (TILES 2, one
    row, a [gate | up] weight of N = 2I rows): tile 0 holds gate rows j, tile 1 the up rows
    I + j, and the lane writes SiLU(gate)·up for its columns j (mma_fragments.store_gate_out).
    PREFETCH: the next group's words are requested before this group's products. GROUPS (2 or
    4, without PREFETCH): the words of that many consecutive groups requested at once, 64
    GROUPS contiguous bytes of each weight row. FLOAT_ZERO: float zeros (_scaled)."""
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    lane = tl.arange(0, 32 * NW)
    g = (lane % 32) // 4
    t = lane % 4
    row, r0, r1, r2, r3 = lane_rows(pid_n, lane, N, NW, TILES, GATE_OUT)
    x_row = x_ptr + tl.minimum(g, M - 1) * stride_xm
    y_row = x_ptr + tl.minimum(g + 8, M - 1) * stride_xm
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # K is a multiple of _GROUP
    # Loop-carried accumulators as plain tensors: <a: x rows 0-7, b: 8-15><tile><value>.
    a00 = tl.zeros([32 * NW], tl.float32)
    a01, a02, a03, a10, a11, a12, a13 = a00, a00, a00, a00, a00, a00, a00
    b00, b01, b02, b03, b10, b11, b12, b13 = a00, a00, a00, a00, a00, a00, a00, a00
    unit = tl.full([32 * NW], 1, tl.uint32) * (K > 0).to(tl.uint32)  # 1, unknown to the compiler
    mask, one = unit * 0x000F000F, unit * 0x3F803F80
    if PREFETCH:  # a plain range loop is not pipelined: keep two groups in flight
        p0, p1, p2, p3, p4, p5, p6, p7 = _tile_words(w_ptr, r0, r1, stride_wn, k_lo, t)
        if TILES == 2:
            q0, q1, q2, q3, q4, q5, q6, q7 = _tile_words(w_ptr, r2, r3, stride_wn, k_lo, t)
    pdl_wait(USE_PDL)  # (the first weights are already requested: they do not depend on it)
    for k in range(k_lo, k_hi, _GROUP * GROUPS):
        if PREFETCH:
            w0 = (p0, p1, p2, p3, p4, p5, p6, p7)
            k_next = tl.minimum(k + _GROUP, k_hi - _GROUP)  # past the end: the last group again
            p0, p1, p2, p3, p4, p5, p6, p7 = _tile_words(w_ptr, r0, r1, stride_wn, k_next, t)
            w1 = w0
            if TILES == 2:
                w1 = (q0, q1, q2, q3, q4, q5, q6, q7)
                q0, q1, q2, q3, q4, q5, q6, q7 = _tile_words(w_ptr, r2, r3, stride_wn, k_next, t)
        else:
            w0 = _tile_words(w_ptr, r0, r1, stride_wn, k, t)
            w1 = w0
            if TILES == 2:
                w1 = _tile_words(w_ptr, r2, r3, stride_wn, k, t)
            if GROUPS >= 2:
                v0 = _tile_words(w_ptr, r0, r1, stride_wn, k + _GROUP, t)
                v1 = v0
                if TILES == 2:
                    v1 = _tile_words(w_ptr, r2, r3, stride_wn, k + _GROUP, t)
            if GROUPS == 4:
                u0 = _tile_words(w_ptr, r0, r1, stride_wn, k + 2 * _GROUP, t)
                o0 = _tile_words(w_ptr, r0, r1, stride_wn, k + 3 * _GROUP, t)
                u1, o1 = u0, o0
                if TILES == 2:
                    u1 = _tile_words(w_ptr, r2, r3, stride_wn, k + 2 * _GROUP, t)
                    o1 = _tile_words(w_ptr, r2, r3, stride_wn, k + 3 * _GROUP, t)
        a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13 = _group(
            w0, w1, k, x_row, y_row, t, s_ptr, z_ptr, r0, r1, r2, r3, stride_sn, stride_zn, one,
            mask, a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13,
            NW, TILES, WIDE, ASM, FLOAT_ZERO)
        if GROUPS >= 2:
            a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13 = (
                _group(v0, v1, k + _GROUP, x_row, y_row, t, s_ptr, z_ptr, r0, r1, r2, r3,
                       stride_sn, stride_zn, one, mask, a00, a01, a02, a03, a10, a11, a12, a13,
                       b00, b01, b02, b03, b10, b11, b12, b13, NW, TILES, WIDE, ASM,
                       FLOAT_ZERO))
        if GROUPS == 4:
            a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13 = (
                _group(u0, u1, k + 2 * _GROUP, x_row, y_row, t, s_ptr, z_ptr, r0, r1, r2, r3,
                       stride_sn, stride_zn, one, mask, a00, a01, a02, a03, a10, a11, a12, a13,
                       b00, b01, b02, b03, b10, b11, b12, b13, NW, TILES, WIDE, ASM,
                       FLOAT_ZERO))
            a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13 = (
                _group(o0, o1, k + 3 * _GROUP, x_row, y_row, t, s_ptr, z_ptr, r0, r1, r2, r3,
                       stride_sn, stride_zn, one, mask, a00, a01, a02, a03, a10, a11, a12, a13,
                       b00, b01, b02, b03, b10, b11, b12, b13, NW, TILES, WIDE, ASM,
                       FLOAT_ZERO))
    if GATE_OUT:
        store_gate_out(a00, a01, a02, a03, a10, a11, a12, a13, row, t, M, N, ws_ptr, cnt_ptr,
                       bias_ptr, out_ptr, pid_n, pid_k, split_k, stride_om, NW, SPLIT,
                       HAS_BIAS)
    else:
        store_lanes(a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12,
                    b13, row, t, M, N, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k,
                    split_k, stride_om, TILES, WIDE, SPLIT, HAS_BIAS)


def mma_ok(x2: torch.Tensor, group_size: int, block_k: int = GROUP_SIZE) -> bool:
    """Whether _w4_mma_kernel takes these rows of x: 1-16 rows of bf16, 8-byte aligned, groups
    of 128 (the kernel reads four words of a row per lane and group), K a multiple of block_k
    (the groups of one loop step)."""
    return (x2.dtype == torch.bfloat16 and 1 <= x2.shape[0] <= MAX_ROWS
            and group_size == GROUP_SIZE and x2.shape[-1] % block_k == 0
            and block_k in (GROUP_SIZE, 2 * GROUP_SIZE, 4 * GROUP_SIZE)
            and x2.data_ptr() % 8 == 0
            and (x2.shape[0] == 1 or x2.stride(0) % 4 == 0))


def launch(args: tuple, rows: int, n_tiles: int, split: int, num_warps: int, block_n: int,
           has_bias: bool, asm: bool, pdl_kwargs: dict, gate_out: bool = False,
           prefetch: bool = False, block_k: int = GROUP_SIZE, float_zero: bool = False) -> None:
    """Launch over w4_gemv's argument tuple (x2, words, scales, zeros, bias, out, ws, cnt, M, N,
    K, strides, k_per_split, split_k) for `rows` rows of x. gate_out: one row, a [gate | up]
    weight, 32 rows per warp (gemv.gate_out_launch's tiles and workspace). float_zero: the
    zeros are floats (the zero point times the scale)."""
    tiles = tiles_per_warp(block_n, num_warps)
    groups = block_k // GROUP_SIZE
    if prefetch and groups > 1:
        raise ValueError("w4 mma: PREFETCH steps one group at a time (block_k 128)")
    if prefetch > 1:
        raise ValueError(f"w4 mma: prefetch is one group ahead, not {int(prefetch)}")
    if not tiles or (gate_out and (tiles != 2 or rows != 1)):
        raise ValueError(f"w4 mma: block_n {block_n} is not 16 or 32 rows per warp of "
                         f"{num_warps}{' (gate-out: 32, one row)' if gate_out else ''}")
    _w4_mma_kernel[(n_tiles, split)](*args, NW=num_warps, TILES=tiles, WIDE=rows > NARROW_ROWS,
                                     SPLIT=split > 1, HAS_BIAS=has_bias, ASM=asm,
                                     GATE_OUT=gate_out, PREFETCH=prefetch, GROUPS=groups,
                                     FLOAT_ZERO=float_zero,
                                     num_warps=num_warps, **pdl_kwargs)
