"""INT8 / FP8 (e4m3) weight GEMV on tensor cores for 1-16 rows of bf16 x: mma.sync m16n8k16 in
float16 with the weight bytes converted straight into the A fragments (no shared memory, no
layout conversion): ~2 instructions a weight where the dequant GEMV needs ~4.75.

Each warp owns 16 weight rows (TILES = 2: 32) and steps over K 64 at a time. Lane (g, t) =
(lane // 4, lane % 4) reads words 4t .. 4t + 3 of the 64-byte chunk of rows g and g + 8; in
step c (0..3) word 4t + c's bytes (0, 1) fill the A k slots (2t, 2t + 1) and bytes (2, 3) the
slots (2t + 8, 2t + 9). The K order inside a step is free when B follows it: B is x row g's
elements 16t + 4c .. + 3 of the chunk (rows past M re-read row M - 1; above 8 rows a second
mma per A fragment takes rows g + 8). FP8 bytes become float16 by cvt.rn.f16x2.e4m3x2
(exact); INT8 bytes q by one PRMT under float16's exponent of 1024 as 1152 + q (exact, the
sign bit flipped first), and mma steps with A = -1152 against the same x, accumulated once
per program, remove the offset. x is converted to float16 scaled by 2^-4 (no overflow below
~1e6 in magnitude, exact above ~1e-3, below that an absolute error under 1e-6), the products
accumulate in float32, and the output is 16 * scale[row] * acc.

ASM (CUDA): the conversions and the mma in PTX; the interpreter runs their twins, so the CPU
tests check every address and index. Opt-in (SLIPSTREAM_W8_MMA=1) until measured on a GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slipstream.kernels.mma_fragments import (
    lane_rows,
    mma,
    store_gate_out,
    store_lanes,
    tiles_per_warp,
)
from slipstream.kernels.pdl import pdl_release, pdl_wait

ENABLED = os.environ.get("SLIPSTREAM_W8_MMA", "0") == "1"
WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
MAX_ROWS = 16
NARROW_ROWS = 8  # one n8 mma per A fragment up to here
CHUNK = 64  # K per step of the loop (four mma steps); the config's block_k
_CHUNK = tl.constexpr(CHUNK)


@triton.jit
def _f16_bits(f):
    """float32 -> its float16 bits in a uint32 (round to nearest)."""
    return f.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _int8_halves(w, ASM: tl.constexpr):
    """Each word's four int8 bytes q as float16 pairs 1152 + q (bytes 0, 1) and (2, 3), the
    lower byte in the lower half: q + 128 (the sign bit flipped) under the exponent of 1024."""
    u = w.to(tl.uint32, bitcast=True) ^ 0x80808080
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            prmt.b32 $0, $2, 0x64646464, 0x4140;
            prmt.b32 $1, $2, 0x64646464, 0x4342;
            }""",
            constraints="=r,=r,r", args=[u], dtype=(tl.uint32, tl.uint32), is_pure=True,
            pack=1)
    else:
        return ((u & 0xFF) | 0x6400 | (((u >> 8) & 0xFF) | 0x6400) << 16,
                ((u >> 16) & 0xFF) | 0x6400 | ((u >> 24) | 0x6400) << 16)


@triton.jit
def _w8_halves(w, INT8: tl.constexpr, ASM: tl.constexpr):
    """A word of four weight bytes as two float16 pairs (see _int8_halves / _fp8_halves)."""
    if INT8:
        return _int8_halves(w, ASM)
    else:
        return _fp8_halves(w, ASM)


@triton.jit
def _fp8_halves(w, ASM: tl.constexpr):
    """Each word's four e4m3 bytes as float16 pairs (bytes 0, 1) and (bytes 2, 3), the lower
    byte in the lower half (exact)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r", args=[w], dtype=(tl.uint32, tl.uint32), is_pure=True,
            pack=1)
    else:
        u = w.to(tl.uint32, bitcast=True)
        return (_e4m3_f16(u & 0xFF) | (_e4m3_f16((u >> 8) & 0xFF) << 16),
                _e4m3_f16((u >> 16) & 0xFF) | (_e4m3_f16(u >> 24) << 16))


@triton.jit
def _e4m3_f16(b):
    """An e4m3 byte (in a uint32) -> its float16 bits (exact)."""
    return _f16_bits(b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32))


@triton.jit
def _x_f16(u, ASM: tl.constexpr):
    """A bf16 pair (one 32-bit word of x) as the float16 pair of x / 16."""
    lo = (u << 16).to(tl.float32, bitcast=True) * 0.0625
    hi = (u & 0xFFFF0000).to(tl.float32, bitcast=True) * 0.0625
    if ASM:
        return tl.inline_asm_elementwise(
            asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,r,r", args=[lo, hi],
            dtype=tl.uint32, is_pure=True, pack=1)
    else:
        return _f16_bits(lo) | (_f16_bits(hi) << 16)


@triton.jit
def _x_chunk(x_row, k, t, ASM: tl.constexpr):
    """The lane's x for the chunk at k: elements 16t .. 16t + 15 as eight float16 pairs (pair
    2c, 2c + 1: mma step c's B registers)."""
    xi = x_row.to(tl.pointer_type(tl.uint64)) + k // 4 + 4 * t
    v0, v1, v2, v3 = tl.load(xi), tl.load(xi + 1), tl.load(xi + 2), tl.load(xi + 3)
    return (_x_f16((v0 & 0xFFFFFFFF).to(tl.uint32), ASM), _x_f16((v0 >> 32).to(tl.uint32), ASM),
            _x_f16((v1 & 0xFFFFFFFF).to(tl.uint32), ASM), _x_f16((v1 >> 32).to(tl.uint32), ASM),
            _x_f16((v2 & 0xFFFFFFFF).to(tl.uint32), ASM), _x_f16((v2 >> 32).to(tl.uint32), ASM),
            _x_f16((v3 & 0xFFFFFFFF).to(tl.uint32), ASM), _x_f16((v3 >> 32).to(tl.uint32), ASM))


@triton.jit
def _tile_words(w_ptr, r_lo, r_hi, stride_wn, k, t):
    """The lane's words 4t .. 4t + 3 of the chunk at k, rows r_lo then r_hi."""
    wl = (w_ptr + r_lo * stride_wn + k).to(tl.pointer_type(tl.uint32)) + 4 * t
    wh = (w_ptr + r_hi * stride_wn + k).to(tl.pointer_type(tl.uint32)) + 4 * t
    return (tl.load(wl), tl.load(wl + 1), tl.load(wl + 2), tl.load(wl + 3),
            tl.load(wh), tl.load(wh + 1), tl.load(wh + 2), tl.load(wh + 3))


@triton.jit
def _step(lw, hw, xb0, xb1, yb0, yb1, d0, d1, d2, d3, e0, e1, e2, e3, NW: tl.constexpr,
          WIDE: tl.constexpr, INT8: tl.constexpr, ASM: tl.constexpr):
    """One mma step: words lw (row g), hw (row g + 8) as the A fragment, against x (xb) and,
    WIDE, x rows 8-15 (yb)."""
    l01, l23 = _w8_halves(lw, INT8, ASM)
    h01, h23 = _w8_halves(hw, INT8, ASM)
    d0, d1, d2, d3 = mma(l01, h01, l23, h23, xb0, xb1, d0, d1, d2, d3, NW, True, ASM)
    if WIDE:
        e0, e1, e2, e3 = mma(l01, h01, l23, h23, yb0, yb1, e0, e1, e2, e3, NW, True, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3


@triton.jit
def _tile_chunk(w, xs, ys, a0, a1, a2, a3, b0, b1, b2, b3, NW: tl.constexpr,
                WIDE: tl.constexpr, INT8: tl.constexpr, ASM: tl.constexpr):
    """One 64-wide chunk of one 16-row tile (w: _tile_words; INT8: the offset words of
    _offset_chunk): four mma steps into a (x rows 0-7) and, WIDE, b (rows 8-15)."""
    d = _step(w[0], w[4], xs[0], xs[1], ys[0], ys[1], a0, a1, a2, a3, b0, b1, b2, b3, NW, WIDE,
              INT8, ASM)
    d = _step(w[1], w[5], xs[2], xs[3], ys[2], ys[3], d[0], d[1], d[2], d[3], d[4], d[5], d[6],
              d[7], NW, WIDE, INT8, ASM)
    d = _step(w[2], w[6], xs[4], xs[5], ys[4], ys[5], d[0], d[1], d[2], d[3], d[4], d[5], d[6],
              d[7], NW, WIDE, INT8, ASM)
    return _step(w[3], w[7], xs[6], xs[7], ys[6], ys[7], d[0], d[1], d[2], d[3], d[4], d[5],
                 d[6], d[7], NW, WIDE, INT8, ASM)


@triton.jit
def _offset_steps(minus, xs, ys, o0, o1, o2, o3, p0, p1, p2, p3, NW: tl.constexpr,
                  WIDE: tl.constexpr, ASM: tl.constexpr):
    """INT8: -1152 sum x over one chunk added to o (x rows 0-7) and, WIDE, p (rows 8-15): the
    four mma steps with every A value -1152 (minus: the float16 pair, in a register)."""
    o0, o1, o2, o3 = mma(minus, minus, minus, minus, xs[0], xs[1], o0, o1, o2, o3, NW, True, ASM)
    o0, o1, o2, o3 = mma(minus, minus, minus, minus, xs[2], xs[3], o0, o1, o2, o3, NW, True, ASM)
    o0, o1, o2, o3 = mma(minus, minus, minus, minus, xs[4], xs[5], o0, o1, o2, o3, NW, True, ASM)
    o0, o1, o2, o3 = mma(minus, minus, minus, minus, xs[6], xs[7], o0, o1, o2, o3, NW, True, ASM)
    if WIDE:
        p0, p1, p2, p3 = mma(minus, minus, minus, minus, ys[0], ys[1], p0, p1, p2, p3, NW, True,
                             ASM)
        p0, p1, p2, p3 = mma(minus, minus, minus, minus, ys[2], ys[3], p0, p1, p2, p3, NW, True,
                             ASM)
        p0, p1, p2, p3 = mma(minus, minus, minus, minus, ys[4], ys[5], p0, p1, p2, p3, NW, True,
                             ASM)
        p0, p1, p2, p3 = mma(minus, minus, minus, minus, ys[6], ys[7], p0, p1, p2, p3, NW, True,
                             ASM)
    return o0, o1, o2, o3, p0, p1, p2, p3


# M and the split count are runtime values (no recompile per batch size or shape).
@triton.jit(do_not_specialize=["M", "split_k"])
def _w8_mma_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                   stride_wn, stride_om, k_per_split, split_k, NW: tl.constexpr,
                   TILES: tl.constexpr, WIDE: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                   INT8: tl.constexpr, USE_PDL: tl.constexpr = False,
                   GATE_OUT: tl.constexpr = False):
    """out[n, row] = 16 s[row] (x[n] / 16) . w[row] (+ bias) for this program's rows and n < M.
    PREFETCH: the next chunk's words are requested before this chunk's products. GATE_OUT
    (TILES 2, one row, a [gate | up] weight): tile 0 holds gate rows j, tile 1 the up rows
    I + j, and the lane writes SiLU(gate)·up (mma_fragments.store_gate_out)."""
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
    k_hi = tl.minimum(k_lo + k_per_split, K)  # K is a multiple of _CHUNK
    # Loop-carried accumulators as plain tensors: <a: x rows 0-7, b: 8-15><tile><register>.
    a00 = tl.zeros([32 * NW], tl.float32)
    a01, a02, a03, a10, a11, a12, a13 = a00, a00, a00, a00, a00, a00, a00
    b00, b01, b02, b03, b10, b11, b12, b13 = a00, a00, a00, a00, a00, a00, a00, a00
    o0, o1, o2, o3, o4, o5, o6, o7 = a00, a00, a00, a00, a00, a00, a00, a00  # INT8's offsets
    # -1152 as a float16 pair, a runtime value (kept in registers, not rematerialised).
    minus = tl.full([32 * NW], 0xE480E480, tl.uint32) * (K > 0).to(tl.uint32)
    if PREFETCH:  # Triton does not pipeline loads that feed no tl.dot: keep two chunks in flight
        p0, p1, p2, p3, p4, p5, p6, p7 = _tile_words(w_ptr, r0, r1, stride_wn, k_lo, t)
        if TILES == 2:
            q0, q1, q2, q3, q4, q5, q6, q7 = _tile_words(w_ptr, r2, r3, stride_wn, k_lo, t)
    pdl_wait(USE_PDL)  # (the first weights are already requested: they do not depend on it)
    for k in range(k_lo, k_hi, _CHUNK):
        if PREFETCH:
            w0 = (p0, p1, p2, p3, p4, p5, p6, p7)
            k_next = tl.minimum(k + _CHUNK, k_hi - _CHUNK)  # past the end: the last chunk again
            p0, p1, p2, p3, p4, p5, p6, p7 = _tile_words(w_ptr, r0, r1, stride_wn, k_next, t)
            if TILES == 2:
                w1 = (q0, q1, q2, q3, q4, q5, q6, q7)
                q0, q1, q2, q3, q4, q5, q6, q7 = _tile_words(w_ptr, r2, r3, stride_wn, k_next, t)
        else:
            w0 = _tile_words(w_ptr, r0, r1, stride_wn, k, t)
            if TILES == 2:
                w1 = _tile_words(w_ptr, r2, r3, stride_wn, k, t)
        xs = _x_chunk(x_row, k, t, ASM)
        ys = xs
        if WIDE:
            ys = _x_chunk(y_row, k, t, ASM)
        a00, a01, a02, a03, b00, b01, b02, b03 = _tile_chunk(
            w0, xs, ys, a00, a01, a02, a03, b00, b01, b02, b03, NW, WIDE, INT8, ASM)
        if TILES == 2:
            a10, a11, a12, a13, b10, b11, b12, b13 = _tile_chunk(
                w1, xs, ys, a10, a11, a12, a13, b10, b11, b12, b13, NW, WIDE, INT8, ASM)
        if INT8:
            o0, o1, o2, o3, o4, o5, o6, o7 = _offset_steps(minus, xs, ys, o0, o1, o2, o3, o4,
                                                           o5, o6, o7, NW, WIDE, ASM)
    if INT8:  # the same offsets for every weight row
        a00, a01, a02, a03 = a00 + o0, a01 + o1, a02 + o2, a03 + o3
        a10, a11, a12, a13 = a10 + o0, a11 + o1, a12 + o2, a13 + o3
        b00, b01, b02, b03 = b00 + o4, b01 + o5, b02 + o6, b03 + o7
        b10, b11, b12, b13 = b10 + o4, b11 + o5, b12 + o6, b13 + o7
    if GATE_OUT:
        store_gate_out(a00, a01, a02, a03, a10, a11, a12, a13, row, t, M, N, ws_ptr, cnt_ptr,
                       bias_ptr, out_ptr, s_ptr, 16.0, pid_n, pid_k, split_k, stride_om, NW,
                       SPLIT, HAS_BIAS, True)
    else:
        store_lanes(a00, a01, a02, a03, a10, a11, a12, a13, b00, b01, b02, b03, b10, b11, b12,
                    b13, row, t, M, N, ws_ptr, cnt_ptr, bias_ptr, out_ptr, s_ptr, 16.0, pid_n,
                    pid_k, split_k, stride_om, TILES, WIDE, SPLIT, HAS_BIAS, True)


def mma_ok(x2: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether _w8_mma_kernel takes this call: 1-16 rows of bf16 x, 8-byte aligned; an int8 or
    e4m3 weight whose rows start 4-byte aligned; K a multiple of 64."""
    k = x2.shape[-1]
    return (x2.dtype == torch.bfloat16 and qweight.dtype in WEIGHT_DTYPES
            and 1 <= x2.shape[0] <= MAX_ROWS and k % CHUNK == 0 and x2.data_ptr() % 8 == 0
            and (x2.shape[0] == 1 or x2.stride(0) % 4 == 0) and qweight.data_ptr() % 4 == 0
            and qweight.stride(0) % 4 == 0 and qweight.stride(1) == 1)


def launch(args: tuple, rows: int, n_tiles: int, split: int, num_warps: int, block_n: int,
           has_bias: bool, asm: bool, prefetch: bool, pdl_kwargs: dict,
           gate_out: bool = False) -> None:
    """Launch over qgemv's argument tuple (x2, qweight, scale, bias, out, ws, cnt, M, N, K,
    stride_xm, stride_wn, stride_om, k_per_split, split_k) for `rows` rows of x. gate_out:
    one row, a [gate | up] weight, 32 rows per warp (gemv.gate_out_launch's tiles and
    workspace)."""
    tiles = tiles_per_warp(block_n, num_warps)
    if not tiles or (gate_out and (tiles != 2 or rows != 1)):
        raise ValueError(f"w8 mma: block_n {block_n} is not 16 or 32 rows per warp of "
                         f"{num_warps}{' (gate-out: 32, one row)' if gate_out else ''}")
    _w8_mma_kernel[(n_tiles, split)](*args, NW=num_warps, TILES=tiles, WIDE=rows > NARROW_ROWS,
                                     SPLIT=split > 1, HAS_BIAS=has_bias, ASM=asm,
                                     PREFETCH=prefetch, INT8=args[1].dtype == torch.int8,
                                     GATE_OUT=gate_out, num_warps=num_warps, **pdl_kwargs)
