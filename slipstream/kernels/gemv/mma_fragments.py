"""mma.sync.m16n8k16 on per-lane tensors, for GEMV kernels that build the fragments in
registers themselves (kernels/gemv/int4_mma.py).

A per-lane tensor has 32 * NW elements, element i in lane i % 32 of warp i // 32 (Triton's
layout for a 1-D tensor of that size: one element a thread). Lane (g, t) = (lane // 4,
lane % 4) holds, per the PTX ISA for 16-bit inputs: A reg0 = (row g, k 2t, 2t+1), reg1 = (row
g + 8, same k), reg2 / reg3 the same at k + 8; B reg0 = (k 2t, 2t+1; column g), reg1 at k + 8;
C / D = (row g, columns 2t, 2t+1), then row g + 8; the lower-indexed element in the lower half
of a register. `mma` runs the PTX instruction (ASM) or its twin in tensor arithmetic (the
interpreter), which the tests check against that layout.
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.kernels.gemv.dense import reduce_splits

_OPERANDS = "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
_MMA_BF16 = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " + _OPERANDS)


@triton.jit
def _halves(r, NW: tl.constexpr):
    """Per-lane bf16 pairs [32 NW] -> float32 [NW, 8 (g), 4 (t), 2]."""
    u = tl.reshape(r.to(tl.uint32, bitcast=True), [NW, 8, 4])
    return tl.join((u << 16).to(tl.float32, bitcast=True), (u & 0xFFFF0000).to(tl.float32, bitcast=True))


@triton.jit
def _frag_dot(a, b):
    """[w, m, n] = sum over a lane's k slots (t, half) of a[w, m, t, h] b[w, n, t, h]."""
    return tl.sum(tl.sum(a[:, :, None, :, :] * b[:, None, :, :, :], 4), 3)


@triton.jit
def _lane_columns(d, NW: tl.constexpr):
    """[NW, 8 (g), 8 (n)] -> each lane's columns n = 2t and 2t + 1 as two [32 NW] tensors."""
    even, odd = tl.split(tl.reshape(d, [NW, 8, 4, 2]))
    return tl.reshape(even, [32 * NW]), tl.reshape(odd, [32 * NW])


@triton.jit
def mma_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW: tl.constexpr):
    """D = A B + C of one m16n8k16 step (float32 accumulate) in tensor arithmetic."""
    b0h, b1h = _halves(b0, NW), _halves(b1, NW)
    top = _frag_dot(_halves(a0, NW), b0h) + _frag_dot(_halves(a2, NW), b1h)
    bottom = _frag_dot(_halves(a1, NW), b0h) + _frag_dot(_halves(a3, NW), b1h)
    d0, d1 = _lane_columns(top, NW)
    d2, d3 = _lane_columns(bottom, NW)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@triton.jit
def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW: tl.constexpr, ASM: tl.constexpr):
    """D = A B + C for one m16n8k16 step, bf16 inputs: the PTX instruction (ASM) or its
    twin."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_MMA_BF16, constraints="=r,=r,=r,=r" + ",r" * 10,
            args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return mma_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW)


@triton.jit
def quad(v0, v1, v2, v3):
    """Four per-lane tensors as one [32 NW, 2, 2] (v_2i+j at [., i, j]): one epilogue for all."""
    return tl.join(tl.join(v0, v2), tl.join(v1, v3))


@triton.jit
def lane_values(acc0, acc1, acc2, acc3, row, col):
    """(values, A rows, B columns) of a lane's D registers: (row, col), (row, col + 1), (row + 8,
    col), (row + 8, col + 1), as [32 NW, 2, 2] tensors."""
    return (quad(acc0, acc1, acc2, acc3), quad(row, row, row + 8, row + 8),
            quad(col, col + 1, col, col + 1))


def tiles_per_warp(block_n: int, num_warps: int) -> int:
    """16-row tiles per warp of a GEMV config (1 or 2), or 0 when block_n is neither."""
    tiles = block_n // (16 * num_warps)
    return tiles if tiles in (1, 2) and block_n == 16 * tiles * num_warps else 0


@triton.jit
def lane_rows(pid_n, lane, N, NW: tl.constexpr, TILES: tl.constexpr, GATE_OUT: tl.constexpr):
    """(row, r0, r1, r2, r3): the lane's tile-0 row g (GATE_OUT: its output column j) and the
    weight rows it reads, clamped to the weight (no masks): r0 = row, r1 = row + 8, r2 / r3
    the same in tile 1 (16 rows on; GATE_OUT, TILES 2: the up rows I + j of a [gate | up]
    weight of N = 2I rows)."""
    g = (lane % 32) // 4
    if GATE_OUT:
        row = pid_n * (16 * NW) + (lane // 32) * 16 + g
        half = N // 2
        r0 = tl.minimum(row, half - 1).to(tl.int64)
        r1 = tl.minimum(row + 8, half - 1).to(tl.int64)
        r2, r3 = r0 + half, r1 + half
    else:
        row = pid_n * (16 * TILES * NW) + (lane // 32) * (16 * TILES) + g
        r0, r1 = tl.minimum(row, N - 1).to(tl.int64), tl.minimum(row + 8, N - 1).to(tl.int64)
        r2 = tl.minimum(row + 16, N - 1).to(tl.int64)
        r3 = tl.minimum(row + 24, N - 1).to(tl.int64)
    return row, r0, r1, r2, r3


@triton.jit
def store_gate_out(g0, g1, g2, g3, u0, u1, u2, u3, j, t, M, N, ws_ptr, cnt_ptr, bias_ptr,
                   out_ptr, pid_n, pid_k, split_k, stride_om, NW: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """GATE_OUT: gate sums g (rows j, j + 8), up sums u (rows I + j, ..) -> SiLU(gate)·up at
    columns j, j + 8, each operand biased and rounded to the output dtype
    first (the values silu_and_mul computes from the stored product). Split-K partials reduced
    as gemv's gate-out does (workspace: 32 NW floats per program and split, by weight row)."""
    half = N // 2
    gate, col, xrow = lane_values(g0, g1, g2, g3, j, 2 * t)  # col: the output column (gate row)
    mask = (xrow < M) & (col < half)
    part = tl.join(gate, quad(u0, u1, u2, u3))
    rows = tl.join(col, col + half)  # weight rows: gate, up
    both = tl.join(mask, mask)
    part, done = reduce_splits(part, ws_ptr + rows, both, tl.num_programs(0) * (32 * NW),
                                cnt_ptr + pid_n, pid_k, split_k, SPLIT)
    if done:
        if HAS_BIAS:
            part += tl.load(bias_ptr + rows, mask=both, other=0.0).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        gv, uv = tl.split(part)
        gv = gv.to(out_ty).to(tl.float32)
        uv = uv.to(out_ty).to(tl.float32)
        tl.store(out_ptr + xrow * stride_om + col, (gv * tl.sigmoid(gv) * uv).to(out_ty),
                 mask=mask)


@triton.jit
def store_lanes(a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12, b13,
                row, t, M, N, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, split_k,
                stride_om, TILES: tl.constexpr, WIDE: tl.constexpr, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Every lane's D values to out[n, row] (n < M, row < N): a<tile><reg> for x rows 0-7 and,
    WIDE, b<tile><reg> for rows 8-15 (tile 1 is 16 rows past tile 0); split-K partials
    reduced first (gemv's workspace and counters), then the bias."""
    part, rows, cols = lane_values(a00, a01, a02, a03, row, 2 * t)
    if TILES == 2:
        p1, r1, c1 = lane_values(a10, a11, a12, a13, row + 16, 2 * t)
        part, rows, cols = tl.join(part, p1), tl.join(rows, r1), tl.join(cols, c1)
    if WIDE:
        pw, rw, cw = lane_values(b00, b01, b02, b03, row, 2 * t + 8)
        if TILES == 2:
            p1, r1, c1 = lane_values(b10, b11, b12, b13, row + 16, 2 * t + 8)
            pw, rw, cw = tl.join(pw, p1), tl.join(rw, r1), tl.join(cw, c1)
        part, rows, cols = tl.join(part, pw), tl.join(rows, rw), tl.join(cols, cw)
    mask = (cols < M) & (rows < N)
    part, done = reduce_splits(part, ws_ptr + cols * N + rows, mask, M * N, cnt_ptr + pid_n,
                                pid_k, split_k, SPLIT)
    if done:
        if HAS_BIAS:
            part += tl.load(bias_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols * stride_om + rows, part.to(out_ptr.dtype.element_ty), mask=mask)
