"""W4A16 GEMV on tensor cores for 1-8 rows of bf16 x, the K range split across a program's warps.

Why: at one row the packed-bf16 FMA kernel (gemv_int4) spends ~25 instructions per weight word
(Nsight Compute on the H200, gate_up: issue slots 48% busy, DRAM 53%), too many to keep up with
the H200's memory. Here a word costs one shift and one LOP3 per nibble pair and half an mma
(gemv_int4_mma's fragments: the A value 128 + q exact, s (D - (128 + z) sum x) per group).

Each program owns 16 TILES weight rows (GATE_OUT: 16 gate rows and the matching 16 up rows) and
K / split of K. Its NW warps share those rows and split that range, GPW groups of 128 each: a
warp requests all of its words, scales and zeros before the PDL wait (every byte in flight at
once, no loop), then runs the mma steps. Lane (g, t) reads words 4t .. 4t + 3 of each group of
rows g and g + 8: 16 contiguous bytes, one load (gemv_int4_mma reads t, t + 4, t + 8, t + 12;
the K order inside an mma is free as long as the x pairs follow it). The warps' D values are
summed over the warp axis at the end (shared memory), then stored as gemv_int4_mma stores them:
split-K partials, bias, gate-out. RMS_EPS: the product of x / rms(x), the statistic from all of
x read by every program (an RMSNorm folded into this weight, models/norm_fold.py).

ASM (CUDA): the mma and x pairs in PTX; in the interpreter their twins (kernels/mma_fragments.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv_int4_mma import GROUP_SIZE, _scaled, _word_steps, _x_sums
from slipstream.kernels.int4_common import x_pairs, x_pairs_prmt
from slipstream.kernels.mma_fragments import lane_rows, store_gate_out, store_lanes
from slipstream.kernels.pdl import pdl_release, pdl_wait

MAX_ROWS = 8  # one n8 mma step per A fragment
GROUPS_PER_WARP = (1, 2, 4, 8)  # GPW: a power of two (the in-thread join tree of the groups)
_GROUP = tl.constexpr(GROUP_SIZE)


@triton.jit
def _leaf(w_ptr, s_ptr, z_ptr, r, stride_wn, stride_sn, stride_zn, grp, t, KIND: tl.constexpr):
    """KIND 0: the lane's four words 4t .. 4t + 3 of group grp of row r ([32 NW, 4], one 16-byte
    load); 1: that group's scale of row r; 2: its zero."""
    if KIND == 0:
        offs = r * stride_wn + grp * (_GROUP // 8) + 4 * t
        return tl.load(w_ptr + offs[:, None] + tl.arange(0, 4)[None, :])
    elif KIND == 1:
        return tl.load(s_ptr + r * stride_sn + grp)
    else:
        return tl.load(z_ptr + r * stride_zn + grp)


@triton.jit
def _requested(w_ptr, s_ptr, z_ptr, r, stride_wn, stride_sn, stride_zn, grp, t,
               KIND: tl.constexpr, GPW: tl.constexpr):
    """_leaf of groups grp .. grp + GPW - 1 joined in one thread: a tree whose last axis splits
    the first half of the groups from the second (_at undoes it)."""
    if GPW == 1:
        return _leaf(w_ptr, s_ptr, z_ptr, r, stride_wn, stride_sn, stride_zn, grp, t, KIND)
    else:
        return tl.join(
            _requested(w_ptr, s_ptr, z_ptr, r, stride_wn, stride_sn, stride_zn, grp, t, KIND,
                       GPW // 2),
            _requested(w_ptr, s_ptr, z_ptr, r, stride_wn, stride_sn, stride_zn, grp + GPW // 2,
                       t, KIND, GPW // 2))


@triton.jit
def _at(tree, Q: tl.constexpr, GPW: tl.constexpr):
    """Group Q (0 <= Q < GPW) of a _requested tree."""
    if GPW == 1:
        return tree
    else:
        first, second = tl.split(tree)
        if Q < GPW // 2:
            return _at(first, Q, GPW // 2)
        else:
            return _at(second, Q - GPW // 2, GPW // 2)


@triton.jit
def _lane_pairs(x_row, k, t, ASM: tl.constexpr):
    """The x pairs of the lane's words 4t + c (c = 0..3) of the group at k."""
    if ASM:
        return (x_pairs_prmt(x_row, k, 4 * t), x_pairs_prmt(x_row, k, 4 * t + 1),
                x_pairs_prmt(x_row, k, 4 * t + 2), x_pairs_prmt(x_row, k, 4 * t + 3))
    else:
        return (x_pairs(x_row, k, 4 * t), x_pairs(x_row, k, 4 * t + 1),
                x_pairs(x_row, k, 4 * t + 2), x_pairs(x_row, k, 4 * t + 3))


@triton.jit
def _four(v):
    """[32 NW, 4] -> its four columns as [32 NW] tensors (in one thread: nothing moves)."""
    a, b = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))  # columns 0, 2 and 1, 3
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _tile_group(lo, hi, s_lo, s_hi, z_lo, z_hi, xq, sx, a0, a1, a2, a3, mask,
                NW: tl.constexpr, ASM: tl.constexpr):
    """One group of one 16-row tile: lo / hi the lane's four words of rows g / g + 8 ([32 NW,
    4]), s / z their scales and zeros; eight mma steps, then acc + s (D - (128 + z) sum x)."""
    lw = _four(lo)
    hw = _four(hi)
    z = tl.zeros([32 * NW], tl.float32)
    d = _word_steps(lw[0], hw[0], xq[0], xq[0], z, z, z, z, z, z, z, z, mask, NW, False, ASM)
    for c in tl.static_range(1, 4):
        d = _word_steps(lw[c], hw[c], xq[c], xq[c], d[0], d[1], d[2], d[3], d[4], d[5], d[6],
                        d[7], mask, NW, False, ASM)
    return _scaled(a0, a1, a2, a3, d[0], d[1], d[2], d[3], s_lo.to(tl.float32),
                   s_hi.to(tl.float32), 128.0 + z_lo.to(tl.float32), 128.0 + z_hi.to(tl.float32),
                   sx[0], sx[1])


@triton.jit
def _groups(w0, w1, w2, w3, s0, s1, s2, s3, z0, z1, z2, z3, grp, x_row, t, one, mask,
            a00, a01, a02, a03, a10, a11, a12, a13, NW: tl.constexpr, TILES: tl.constexpr,
            GPW: tl.constexpr, ASM: tl.constexpr):
    """Every group of the warp's range (the _requested trees of rows r0 .. r3, from group grp):
    the x pairs and sums once per group, then each tile's mma steps; the eight accumulators."""
    for q in tl.static_range(GPW):
        k = (grp + q) * _GROUP
        xq = _lane_pairs(x_row, k, t, ASM)
        sx = _x_sums(xq[0], xq[1], xq[2], xq[3], one, NW, ASM)
        a00, a01, a02, a03 = _tile_group(_at(w0, q, GPW), _at(w1, q, GPW), _at(s0, q, GPW),
                                         _at(s1, q, GPW), _at(z0, q, GPW), _at(z1, q, GPW), xq,
                                         sx, a00, a01, a02, a03, mask, NW, ASM)
        if TILES == 2:
            a10, a11, a12, a13 = _tile_group(_at(w2, q, GPW), _at(w3, q, GPW), _at(s2, q, GPW),
                                             _at(s3, q, GPW), _at(z2, q, GPW), _at(z3, q, GPW),
                                             xq, sx, a10, a11, a12, a13, mask, NW, ASM)
    return a00, a01, a02, a03, a10, a11, a12, a13


@triton.jit
def _warp_sum(v, NW: tl.constexpr):
    """Per-lane values [32 NW] summed over the warps: [32], lane l of every warp added."""
    return tl.sum(tl.reshape(v, [NW, 32]), 0)


@triton.jit
def _inv_rms_of_x(x_ptr, K, KP: tl.constexpr, EPS: tl.constexpr):
    """1 / rms(x) over all of x's K values (float32, as the RMSNorm kernel computes it)."""
    offs = tl.arange(0, KP)
    xs = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    return tl.math.rsqrt(tl.sum(xs * xs) / K + EPS)


# M and the split count are runtime values (no recompile per batch size).
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_warpk_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                     stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split, split_k,
                     NW: tl.constexpr, TILES: tl.constexpr, GPW: tl.constexpr,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
                     USE_PDL: tl.constexpr = False, GATE_OUT: tl.constexpr = False,
                     RMS_EPS: tl.constexpr = 0.0, RMS_KP: tl.constexpr = 0):
    """out[n, row] for the program's 16 TILES rows (GATE_OUT: SiLU(gate)·up for 16 columns)
    and x rows n < M <= 8, over K range pid_k: warp w takes groups GPW w .. GPW w + GPW - 1 of
    it (k_per_split = 128 GPW NW)."""
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    lane = tl.arange(0, 32 * NW)
    g = (lane % 32) // 4
    t = lane % 4
    # every warp takes the same rows: lane_rows of one warp's lane numbers
    row, r0, r1, r2, r3 = lane_rows(pid_n, lane % 32, N, 1, TILES, GATE_OUT)
    grp = pid_k * (k_per_split // _GROUP) + (lane // 32) * GPW  # the warp's first group
    # Weights, scales and zeros are never written by a kernel: all requested before the wait.
    w0 = _requested(w_ptr, s_ptr, z_ptr, r0, stride_wn, stride_sn, stride_zn, grp, t, 0, GPW)
    w1 = _requested(w_ptr, s_ptr, z_ptr, r1, stride_wn, stride_sn, stride_zn, grp, t, 0, GPW)
    s0 = _requested(w_ptr, s_ptr, z_ptr, r0, stride_wn, stride_sn, stride_zn, grp, t, 1, GPW)
    s1 = _requested(w_ptr, s_ptr, z_ptr, r1, stride_wn, stride_sn, stride_zn, grp, t, 1, GPW)
    z0 = _requested(w_ptr, s_ptr, z_ptr, r0, stride_wn, stride_sn, stride_zn, grp, t, 2, GPW)
    z1 = _requested(w_ptr, s_ptr, z_ptr, r1, stride_wn, stride_sn, stride_zn, grp, t, 2, GPW)
    w2, w3, s2, s3, z2, z3 = w0, w1, s0, s1, z0, z1
    if TILES == 2:
        w2 = _requested(w_ptr, s_ptr, z_ptr, r2, stride_wn, stride_sn, stride_zn, grp, t, 0, GPW)
        w3 = _requested(w_ptr, s_ptr, z_ptr, r3, stride_wn, stride_sn, stride_zn, grp, t, 0, GPW)
        s2 = _requested(w_ptr, s_ptr, z_ptr, r2, stride_wn, stride_sn, stride_zn, grp, t, 1, GPW)
        s3 = _requested(w_ptr, s_ptr, z_ptr, r3, stride_wn, stride_sn, stride_zn, grp, t, 1, GPW)
        z2 = _requested(w_ptr, s_ptr, z_ptr, r2, stride_wn, stride_sn, stride_zn, grp, t, 2, GPW)
        z3 = _requested(w_ptr, s_ptr, z_ptr, r3, stride_wn, stride_sn, stride_zn, grp, t, 2, GPW)
    pdl_wait(USE_PDL)
    x_row = x_ptr + tl.minimum(g, M - 1) * stride_xm
    unit = tl.full([32 * NW], 1, tl.uint32) * (K > 0).to(tl.uint32)  # 1, unknown to the compiler
    mask, one = unit * 0x000F000F, unit * 0x3F803F80
    acc = tl.zeros([32 * NW], tl.float32)
    a = _groups(w0, w1, w2, w3, s0, s1, s2, s3, z0, z1, z2, z3, grp, x_row, t, one, mask,
                acc, acc, acc, acc, acc, acc, acc, acc, NW, TILES, GPW, ASM)
    scale = 1.0
    if RMS_EPS > 0:
        scale = _inv_rms_of_x(x_ptr, K, RMS_KP, RMS_EPS)
    p00, p01 = _warp_sum(a[0], NW) * scale, _warp_sum(a[1], NW) * scale
    p02, p03 = _warp_sum(a[2], NW) * scale, _warp_sum(a[3], NW) * scale
    p10, p11, p12, p13 = p00, p01, p02, p03
    if TILES == 2:
        p10, p11 = _warp_sum(a[4], NW) * scale, _warp_sum(a[5], NW) * scale
        p12, p13 = _warp_sum(a[6], NW) * scale, _warp_sum(a[7], NW) * scale
    lane1 = tl.arange(0, 32)
    row1 = lane_rows(pid_n, lane1, N, 1, TILES, GATE_OUT)[0]
    if GATE_OUT:
        store_gate_out(p00, p01, p02, p03, p10, p11, p12, p13, row1, lane1 % 4, M, N, ws_ptr,
                       cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, split_k, stride_om, 1, SPLIT,
                       HAS_BIAS)
    else:
        store_lanes(p00, p01, p02, p03, p10, p11, p12, p13, p00, p01, p02, p03, p10, p11, p12,
                    p13, row1, lane1 % 4, M, N, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k,
                    split_k, stride_om, TILES, False, SPLIT, HAS_BIAS)


def groups_per_warp(k: int, split: int, num_warps: int) -> int:
    """GPW of a launch over K, or 0 where K / 128 does not split into split x num_warps ranges
    of 1, 2, 4 or 8 groups."""
    groups = k // GROUP_SIZE
    if k % GROUP_SIZE or groups % (split * num_warps):
        return 0
    gpw = groups // (split * num_warps)
    return gpw if gpw in GROUPS_PER_WARP else 0


def warpk_ok(x2: torch.Tensor, group_size: int, k: int, split: int, num_warps: int) -> bool:
    """Whether _w4_warpk_kernel takes these rows of x: 1-8 rows of bf16, 8-byte aligned, groups
    of 128, K splitting into whole ranges of GROUPS_PER_WARP groups per warp."""
    return (x2.dtype == torch.bfloat16 and 1 <= x2.shape[0] <= MAX_ROWS
            and group_size == GROUP_SIZE and x2.data_ptr() % 8 == 0
            and (x2.shape[0] == 1 or x2.stride(0) % 4 == 0)
            and groups_per_warp(k, split, num_warps) > 0)


def launch(args: tuple, rows: int, k: int, n_tiles: int, split: int, num_warps: int,
           tiles: int, has_bias: bool, asm: bool, pdl_kwargs: dict, gate_out: bool = False,
           rms_eps: float = 0.0) -> None:
    """Launch over w4_gemv's argument tuple (x2, words, scales, zeros, bias, out, ws, cnt, M, N,
    K, strides, k_per_split, split_k): k_per_split must be K / split (w4_gemv's for these
    configs). The caller checks warpk_ok."""
    _w4_warpk_kernel[(n_tiles, split)](
        *args, NW=num_warps, TILES=tiles, GPW=groups_per_warp(k, split, num_warps),
        SPLIT=split > 1, HAS_BIAS=has_bias, ASM=asm, GATE_OUT=gate_out,
        RMS_EPS=float(rms_eps), RMS_KP=triton.next_power_of_2(k) if rms_eps else 0,
        num_warps=num_warps, **pdl_kwargs)
