"""Triton W4A16 dequant-GEMV for decode (M <= 16): out = x @ ((q - zero) * scale)^T (+ bias);
with float zeros (the zero point times the scale, int4_common) x @ (q * scale - zero)^T.

int4_awq layout (quantization/utils.py): qweight uint8 [N, K/2] read as int32 words (see
int4_common), scales float16 and zeros uint8 [N, K/G]. The packed weight is streamed once and
unpacked in registers; each K chunk lies in one group, so its scale and zero apply per row and
chunk. M == 1 accumulates FMAs on float32 (or, as a tuner candidate, takes the M <= 16 path);
1 < M <= 16 runs a tensor-core product per chunk. Split-K and its in-kernel reduction are those
of kernels/gemv/dense.py; int4_linear is the entry point for int4_awq's apply.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels.cuda import w4_stream
from slipstream.kernels.gemm import int4 as gemm_int4
from slipstream.kernels.gemm.int4 import w4_gemm, w4_linear_large
from slipstream.kernels.gemv import int4_mma as gemv_int4_mma
from slipstream.kernels.gemv.dense import (
    MAX_M,
    GemvConfig,
    call_kind,
    choose_split_k,
    counters,
    finish,
    finish_gate_out,
    gate_out_launch,
    gate_out_ok,
    num_sms,
    rms_ok,
    tile_rows,
)
from slipstream.kernels.gemv.int4_common import (
    float_zero_split,
    float_zeros,
    kernel_chunk,
    kernel_shape_ok,
    measure_best,
    packed_words,
    pairs_sum,
    row_major,
    unpack_paired,
    w4_linear_reference,
    x_pairs,
    x_pairs_prmt,
)
from slipstream.kernels.gemv.mma_fragments import tiles_per_warp
from slipstream.kernels.reference import silu_and_mul
from slipstream.kernels.runtime import pdl, tuning_cache
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

__all__ = ["MAX_M", "W4Config", "int4_linear", "w4_choices", "w4_gemm", "w4_gemv",
           "w4_gemv_gate_out", "w4_linear_large", "w4_linear_reference", "w4_linear_small",
           "w4_linear_small_gate_out", "w4_linear_small_rms"]


@triton.jit
def _tail(w, one, NIB: tl.constexpr):
    """Nibble NIB of each word and the nibbles below it as float32 1 + u, u = q_NIB/16 +
    q_(NIB-1)/256 + ... (truncated to 23 bits): one left shift drops the nibbles above, and the
    shift right under the exponent of 1.0 is a single LEA.HI. u_i - u_(i-1)/16 = q_i/16, so the
    caller multiplies by x'_i = x_i - x_(i+1)/16 instead of masking each nibble out.
    `one` is a runtime 1: a constant shift would be folded with the right shift into shift + mask
    + or (three instructions); a multiply by a runtime power of two stays one IMAD."""
    y = w.to(tl.uint32, bitcast=True)
    if NIB < 7:
        y = y * (one << (28 - 4 * NIB))
    return ((y >> 9) + 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _bf16x2_word_dot(w, p0, p1, p2, p3, z, ASM: tl.constexpr):
    """sum_i (q_i - z) x_i per word in float32, from bf16x2 arithmetic (ASM, sm_90 PTX): nibbles
    a and a+4 ORed under bf16's exponent of 128 (0x4300) are the pair (128 + q) in one
    instruction, minus (128 + z) exactly, times the x pair, summed over a = 0..3 in bf16 (each
    product rounded to bf16, far below int4's own error), then the two halves added in float32.
    Without ASM (the interpreter) the same pairing in float32 arithmetic."""
    if ASM:
        zc = ((z.to(tl.uint32) + 0x4300) * 0x10001).to(tl.int32, bitcast=True)
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, v, acc;
            .reg .b16 lo, hi;
            .reg .f32 flo, fhi;
            lop3.b32 v, $1, 0x000F000F, 0x43004300, 0xEA;
            sub.rn.bf16x2 v, v, $6;
            mul.rn.bf16x2 acc, v, $2;
            shr.u32 t, $1, 4;
            lop3.b32 v, t, 0x000F000F, 0x43004300, 0xEA;
            sub.rn.bf16x2 v, v, $6;
            fma.rn.bf16x2 acc, v, $3, acc;
            shr.u32 t, $1, 8;
            lop3.b32 v, t, 0x000F000F, 0x43004300, 0xEA;
            sub.rn.bf16x2 v, v, $6;
            fma.rn.bf16x2 acc, v, $4, acc;
            shr.u32 t, $1, 12;
            lop3.b32 v, t, 0x000F000F, 0x43004300, 0xEA;
            sub.rn.bf16x2 v, v, $6;
            fma.rn.bf16x2 acc, v, $5, acc;
            mov.b32 {lo, hi}, acc;
            cvt.f32.bf16 flo, lo;
            cvt.f32.bf16 fhi, hi;
            add.f32 $0, flo, fhi;
            }""",
            constraints="=r,r,r,r,r,r,r", args=[w, p0, p1, p2, p3, zc], dtype=tl.float32,
            is_pure=True, pack=1)
    else:
        return _word_dot_f32(w.to(tl.uint32, bitcast=True), p0, p1, p2, p3, z.to(tl.float32))


@triton.jit
def _word_dot_f32(u, p0, p1, p2, p3, zf):
    """_bf16x2_word_dot's float32 twin for one row (the interpreter)."""
    t = _pair_dot(u, p0, zf, 0)
    t += _pair_dot(u, p1, zf, 4)
    t += _pair_dot(u, p2, zf, 8)
    return t + _pair_dot(u, p3, zf, 12)


@triton.jit
def _pair_dot(u, p, zf, SHIFT: tl.constexpr):
    """(q_lo - z) x_lo + (q_hi - z) x_hi for the nibbles at SHIFT and SHIFT + 16 of u and the
    bf16 pair p (float32 arithmetic: _bf16x2_word_dot's interpreter twin)."""
    q_lo = ((u >> SHIFT) & 0xF).to(tl.float32)
    q_hi = ((u >> (SHIFT + 16)) & 0xF).to(tl.float32)
    x_lo = (p << 16).to(tl.float32, bitcast=True)
    x_hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    return (q_lo - zf) * x_lo + (q_hi - zf) * x_hi


def _chained_dot_asm(rows: int = 1) -> str:
    """sm_90 PTX of four words of one weight row as _bf16x2_word_dot computes one, the products
    of all four chained in one packed-bf16 sum (16 per half) before the one conversion to
    float32: ~1.1 instructions per word fewer than four word sums. With rows = 2 each nibble
    pair is unpacked once for two rows of x. Operands: $0 .. the float32 sums (one per x row),
    then the four words, the zero pair, and x row r's pair a for word i at 4 (4 r + i) + a
    past it."""
    words, zc = rows, rows + 4
    lines = [".reg .b32 t, v;", ".reg .f32 flo, fhi;"] + [f".reg .b32 acc{r};" for r in range(rows)]
    for i in range(4):
        for a in range(4):
            src = f"${words + i}"
            if a:
                lines.append(f"shr.u32 t, {src}, {4 * a};")
                src = "t"
            lines += [f"lop3.b32 v, {src}, 0x000F000F, 0x43004300, 0xEA;",
                      f"sub.rn.bf16x2 v, v, ${zc};"]
            for r in range(rows):
                pair = f"${zc + 1 + 4 * (4 * r + i) + a}"
                lines.append(f"mul.rn.bf16x2 acc{r}, v, {pair};" if i == a == 0
                             else f"fma.rn.bf16x2 acc{r}, v, {pair}, acc{r};")
    for r in range(rows):
        # bf16 -> float32 is a shift into the upper half (the low half) or a mask (the high one).
        lines += [f"shl.b32 t, acc{r}, 16;", f"and.b32 v, acc{r}, 0xFFFF0000;", "mov.b32 flo, t;",
                  "mov.b32 fhi, v;", f"add.f32 ${r}, flo, fhi;"]
    return "{\n" + "\n".join(lines) + "\n}"


_CHAINED_ASM = tl.constexpr(_chained_dot_asm())
_CHAINED_TWO_ROWS_ASM = tl.constexpr(_chained_dot_asm(2))
_CHAINED_FOUR_ROWS_ASM = tl.constexpr(_chained_dot_asm(4))


@triton.jit
def _quarters(v):
    """[..., C, 2, 2] (the last axis of 4C words reshaped) -> words 4c, 4c+1, 4c+2, 4c+3 as four
    [..., C] tensors; the four sit in one thread (16-byte loads), so nothing moves."""
    a, b = tl.split(v)  # words 4c + 2i and 4c + 2i + 1
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _run_sums(sw, WORDS: tl.constexpr):
    """Per-word sums [WORDS] -> per run of four words [1, WORDS // 4] (_chained_row_dot's
    columns)."""
    a, b, c, d = _quarters(tl.reshape(sw, [WORDS // 4, 2, 2]))
    return ((a + b) + (c + d))[None, :]


@triton.jit
def _quartet_x_sums(x):
    """sum(x) over each run of four words from its 16 pair tensors (_pair_quarters' or
    _whole_k_x's), float32."""
    t = pairs_sum(x[0], x[1], x[2], x[3]) + pairs_sum(x[4], x[5], x[6], x[7])
    return t + (pairs_sum(x[8], x[9], x[10], x[11]) + pairs_sum(x[12], x[13], x[14], x[15]))


@triton.jit
def _pair_quarters(p0, p1, p2, p3, WORDS: tl.constexpr):
    """The x pairs of words 4c + i (i = 0..3) as four (p0, p1, p2, p3) tuples of [1, WORDS // 4]
    rows, flattened in word order: 16 tensors."""
    a0, a1, a2, a3 = _quarters(tl.reshape(p0, [WORDS // 4, 2, 2]))
    b0, b1, b2, b3 = _quarters(tl.reshape(p1, [WORDS // 4, 2, 2]))
    c0, c1, c2, c3 = _quarters(tl.reshape(p2, [WORDS // 4, 2, 2]))
    d0, d1, d2, d3 = _quarters(tl.reshape(p3, [WORDS // 4, 2, 2]))
    return (a0[None, :], b0[None, :], c0[None, :], d0[None, :], a1[None, :], b1[None, :],
            c1[None, :], d1[None, :], a2[None, :], b2[None, :], c2[None, :], d2[None, :],
            a3[None, :], b3[None, :], c3[None, :], d3[None, :])


@triton.jit
def _quartet_dot_f32(w0, w1, w2, w3, zf, x):
    """_CHAINED_ASM's float32 twin for one row of x (x: _pair_quarters' 16 tensors)."""
    t = _word_dot_f32(w0.to(tl.uint32, bitcast=True), x[0], x[1], x[2], x[3], zf)
    t += _word_dot_f32(w1.to(tl.uint32, bitcast=True), x[4], x[5], x[6], x[7], zf)
    t += _word_dot_f32(w2.to(tl.uint32, bitcast=True), x[8], x[9], x[10], x[11], zf)
    return t + _word_dot_f32(w3.to(tl.uint32, bitcast=True), x[12], x[13], x[14], x[15], zf)


@triton.jit
def _chained_row_dot(w, z, p0, p1, p2, p3, ROWS: tl.constexpr, WORDS: tl.constexpr,
                     ASM: tl.constexpr):
    """[ROWS, WORDS] words -> [ROWS, WORDS // 4]: sum_i (q_i - z) x_i over each run of four
    words of a row (ASM: _CHAINED_ASM; else its float32 twin, the interpreter)."""
    w0, w1, w2, w3 = _quarters(tl.reshape(w, [ROWS, WORDS // 4, 2, 2]))
    return _quartet_dot(w0, w1, w2, w3, z, _pair_quarters(p0, p1, p2, p3, WORDS), ASM)


@triton.jit
def _quartet_dot(w0, w1, w2, w3, z, x, ASM: tl.constexpr):
    """sum_i (q_i - z) x_i over words w0..w3 (a run of four, the same shape each) with x their
    16 pair tensors (_pair_quarters' order): _CHAINED_ASM, or its float32 twin."""
    if ASM:
        zc = ((z.to(tl.uint32) + 0x4300) * 0x10001).to(tl.int32, bitcast=True)
        return tl.inline_asm_elementwise(
            asm=_CHAINED_ASM, constraints="=r" + ",r" * 21,
            args=[w0, w1, w2, w3, zc, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8],
                  x[9], x[10], x[11], x[12], x[13], x[14], x[15]],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        return _quartet_dot_f32(w0, w1, w2, w3, z.to(tl.float32), x)


@triton.jit
def _chained_two_rows_dot(w, z, p00, p01, p02, p03, p10, p11, p12, p13, ROWS: tl.constexpr,
                          WORDS: tl.constexpr, ASM: tl.constexpr):
    """_chained_row_dot for two rows of x (p<r><a>: row r's pairs), each nibble pair unpacked
    once for both (ASM: _CHAINED_TWO_ROWS_ASM; else the float32 twin per row)."""
    w0, w1, w2, w3 = _quarters(tl.reshape(w, [ROWS, WORDS // 4, 2, 2]))
    x = _pair_quarters(p00, p01, p02, p03, WORDS)
    y = _pair_quarters(p10, p11, p12, p13, WORDS)
    if ASM:
        zc = ((z.to(tl.uint32) + 0x4300) * 0x10001).to(tl.int32, bitcast=True)
        t0, t1 = tl.inline_asm_elementwise(
            asm=_CHAINED_TWO_ROWS_ASM, constraints="=r,=r" + ",r" * 37,
            args=[w0, w1, w2, w3, zc, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8],
                  x[9], x[10], x[11], x[12], x[13], x[14], x[15], y[0], y[1], y[2], y[3],
                  y[4], y[5], y[6], y[7], y[8], y[9], y[10], y[11], y[12], y[13], y[14],
                  y[15]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        zf = z.to(tl.float32)
        t0 = _quartet_dot_f32(w0, w1, w2, w3, zf, x)
        t1 = _quartet_dot_f32(w0, w1, w2, w3, zf, y)
    return t0, t1


@triton.jit
def _chained_four_rows_dot(w, z, x0, x1, x2, x3, ROWS: tl.constexpr, WORDS: tl.constexpr,
                           ASM: tl.constexpr):
    """_chained_row_dot for four rows of x (x<r>: row r's four pair tensors as x_pairs returns
    them), each nibble pair unpacked once for all four (ASM: _CHAINED_FOUR_ROWS_ASM, 73
    operands; else the float32 twin per row)."""
    w0, w1, w2, w3 = _quarters(tl.reshape(w, [ROWS, WORDS // 4, 2, 2]))
    a = _pair_quarters(x0[0], x0[1], x0[2], x0[3], WORDS)
    b = _pair_quarters(x1[0], x1[1], x1[2], x1[3], WORDS)
    c = _pair_quarters(x2[0], x2[1], x2[2], x2[3], WORDS)
    d = _pair_quarters(x3[0], x3[1], x3[2], x3[3], WORDS)
    if ASM:
        zc = ((z.to(tl.uint32) + 0x4300) * 0x10001).to(tl.int32, bitcast=True)
        return tl.inline_asm_elementwise(
            asm=_CHAINED_FOUR_ROWS_ASM, constraints="=r,=r,=r,=r" + ",r" * 69,
            args=[w0, w1, w2, w3, zc,
                  a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11],
                  a[12], a[13], a[14], a[15],
                  b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                  b[12], b[13], b[14], b[15],
                  c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11],
                  c[12], c[13], c[14], c[15],
                  d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11],
                  d[12], d[13], d[14], d[15]],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        zf = z.to(tl.float32)
        return (_quartet_dot_f32(w0, w1, w2, w3, zf, a), _quartet_dot_f32(w0, w1, w2, w3, zf, b),
                _quartet_dot_f32(w0, w1, w2, w3, zf, c), _quartet_dot_f32(w0, w1, w2, w3, zf, d))


@triton.jit
def _words_at(w_ptrs, k, k_hi, CHUNK: tl.constexpr):
    """The words of the chunk at k, or past the end the last one again (no mask)."""
    return tl.load(w_ptrs + tl.multiple_of(tl.minimum(k, k_hi - CHUNK) // 8, CHUNK // 8))


@triton.jit
def _first_words(w_ptrs, k_lo, k_hi, CHUNK: tl.constexpr, PREFETCH: tl.constexpr):
    """PREFETCH (1-3): the first PREFETCH chunks' words, requested before the PDL wait (in
    registers: the kernels keep PREFETCH + 1 tiles in flight themselves; the one-row kernel's
    STAGES instead lets Triton stream them through shared memory). Returns three tiles; the
    ones past PREFETCH are unused."""
    if PREFETCH:
        n1 = _words_at(w_ptrs, k_lo, k_hi, CHUNK)
    else:
        n1 = tl.zeros(w_ptrs.shape, tl.int32)  # unused
    n2, n3 = n1, n1
    if PREFETCH >= 2:
        n2 = _words_at(w_ptrs, k_lo + CHUNK, k_hi, CHUNK)
    if PREFETCH >= 3:
        n3 = _words_at(w_ptrs, k_lo + 2 * CHUNK, k_hi, CHUNK)
    return n1, n2, n3


@triton.jit
def _chunk_words(w_ptrs, n1, n2, n3, k, k_hi, CHUNK: tl.constexpr, PREFETCH: tl.constexpr):
    """(the words of the chunk at k, the requests in flight after it): PREFETCH rotates them and
    requests the chunk PREFETCH ahead; otherwise a plain load."""
    if PREFETCH == 3:
        return n1, n2, n3, _words_at(w_ptrs, k + 3 * CHUNK, k_hi, CHUNK)
    elif PREFETCH == 2:
        return n1, n2, _words_at(w_ptrs, k + 2 * CHUNK, k_hi, CHUNK), n3
    elif PREFETCH:
        return n1, _words_at(w_ptrs, k + CHUNK, k_hi, CHUNK), n2, n3
    else:
        return tl.load(w_ptrs + tl.multiple_of(k // 8, CHUNK // 8)), n1, n2, n3


# M and the split count are runtime values (no recompile per batch size or shape).
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split, split_k,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr,
                    USE_PDL: tl.constexpr = False, BF16X2: tl.constexpr = 0,
                    GATE_OUT: tl.constexpr = False, CHAIN: tl.constexpr = False,
                    STAGES: tl.constexpr = 1, WHOLE_K: tl.constexpr = 0,
                    WHOLE_KP: tl.constexpr = 0, RMS_EPS: tl.constexpr = 0.0,
                    RMS_KP: tl.constexpr = 0, FLOAT_ZERO: tl.constexpr = False):
    """M == 1: per chunk (one group) and word, t = sum_i v_i x'_i minus the word's share of the
    constant 1 in v and of the zero point, then acc += 16 s t elementwise (one reduction at the
    end). Per element: one IMAD, one LEA.HI and one FFMA; the x terms are shared by the
    BLOCK_N / (8 num_warps) rows each thread holds. BF16X2 (bf16 x only): t from packed bf16
    pairs (_bf16x2_word_dot: ~19 instructions per word instead of ~36; 2: its PTX); CHAIN
    (with BF16X2, CHUNK >= 32): four words of a row per packed sum (_chained_row_dot) and x
    pairs by PRMT (x_pairs_prmt). GATE_OUT: a [gate | up] weight, the program writes
    SiLU(gate)·up (gemv.tile_rows). WHOLE_K (= K; with CHAIN, no split; WHOLE_KP: K rounded
    up to a power of two): the program's whole weight slice, scales and zeros are requested
    before the PDL wait, then one chained product over all of K: no loop, every byte in flight
    at once. RMS_EPS > 0:
    the product is taken with x / rms(x), the RMSNorm whose weight was folded into this weight
    at load (models/norm_fold.py): x's sum of squares read alongside the products, or with a K
    split (RMS_KP: K rounded up to a power of two) all of x read by every program, 1 / rms
    applied to the row sums (as gemv's). FLOAT_ZERO: float zeros (int4_common.float_zero_split:
    the products with zero 8, plus (8 s - zs) times the x sums of each word or run)."""
    WORDS: tl.constexpr = CHUNK // 8
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tile_rows(pid_n, N, BLOCK_N, GATE_OUT)  # past N: row N-1 again, no mask
    offs_w = tl.arange(0, WORDS)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # K is a multiple of CHUNK: no K mask either
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_w[None, :]
    x_ptrs = x_ptr + 8 * offs_w
    if WHOLE_K:
        # The program's words, scales and zeros (never written by a kernel) before the PDL
        # wait, x after it; then one chained product over all of K.
        w, z8, s = _whole_k_tile(w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn, stride_zn,
                                 GROUP, WHOLE_K, WHOLE_KP)
        pdl_wait(USE_PDL)
        x = _whole_k_x(x_ptr, WHOLE_K, WHOLE_KP, BF16X2)
        sums = _whole_k_sums(w, z8, s, x, _whole_k_x_sums(x, FLOAT_ZERO), GROUP, BLOCK_N,
                             WHOLE_KP, BF16X2 == 2, FLOAT_ZERO)
        if RMS_EPS > 0:
            squares = _x_squares(x_ptr, K, WHOLE_KP)
    else:
        if CHAIN:
            acc = tl.zeros([BLOCK_N, WORDS // 4], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
        one = (K > 0).to(tl.uint32)  # 1, unknown to the compiler (see _tail)
        squares = tl.zeros([CHUNK], tl.float32)
        n1, n2, n3 = _first_words(w_ptrs, k_lo, k_hi, CHUNK, PREFETCH)
        pdl_wait(USE_PDL)  # the first weight tiles are already in flight (kernels/runtime/pdl.py)
        if RMS_KP:  # a K split: all of x for the statistic, reduced after the loop
            offs_all = tl.arange(0, RMS_KP)
            x_all = tl.load(x_ptr + offs_all, mask=offs_all < K, other=0.0)
        for k in tl.range(k_lo, k_hi, CHUNK, num_stages=STAGES):
            w, n1, n2, n3 = _chunk_words(w_ptrs, n1, n2, n3, k, k_hi, CHUNK, PREFETCH)
            if RMS_EPS > 0 and not RMS_KP:  # one load a thread: x is in L1 for the products
                xs = tl.load(x_ptr + k + tl.arange(0, CHUNK)).to(tl.float32)
                squares += xs * xs
            g = k // GROUP
            s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)[:, None]
            z8, c = float_zero_split(tl.load(z_ptr + rows * stride_zn + g)[:, None], s,
                                     FLOAT_ZERO)
            if CHAIN:
                if BF16X2 == 2:
                    p0, p1, p2, p3 = x_pairs_prmt(x_ptr, k, offs_w)
                else:
                    p0, p1, p2, p3 = x_pairs(x_ptr, k, offs_w)
                acc += _chained_row_dot(w, z8, p0, p1, p2, p3, BLOCK_N, WORDS, BF16X2 == 2) * s
                if FLOAT_ZERO:
                    acc += c * _run_sums(pairs_sum(p0, p1, p2, p3), WORDS)
            elif BF16X2:
                p0, p1, p2, p3 = x_pairs(x_ptr, k, offs_w)
                t = _bf16x2_word_dot(w, p0[None, :], p1[None, :], p2[None, :], p3[None, :], z8,
                                     BF16X2 == 2)
                acc += t * s
                if FLOAT_ZERO:
                    acc += c * pairs_sum(p0, p1, p2, p3)[None, :]
            else:
                z = z8.to(tl.float32)
                # sum_i (q_i - z) x_i = 16 sum_i v_i x'_i - (15 + z) sum_i x_i - x_0 per word,
                # with x'_i = x_i - x_(i+1) / 16 (x'_7 = x_7); the x terms are shared by all
                # rows.
                x0 = tl.load(x_ptrs + k).to(tl.float32)
                x1 = tl.load(x_ptrs + k + 1).to(tl.float32)
                x2 = tl.load(x_ptrs + k + 2).to(tl.float32)
                x3 = tl.load(x_ptrs + k + 3).to(tl.float32)
                x4 = tl.load(x_ptrs + k + 4).to(tl.float32)
                x5 = tl.load(x_ptrs + k + 5).to(tl.float32)
                x6 = tl.load(x_ptrs + k + 6).to(tl.float32)
                x7 = tl.load(x_ptrs + k + 7).to(tl.float32)
                sx = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
                t = -(15.0 + z) * (0.0625 * sx)[None, :] - (0.0625 * x0)[None, :]
                t += _tail(w, one, 7) * x7[None, :]
                t += _tail(w, one, 6) * (x6 - 0.0625 * x7)[None, :]
                t += _tail(w, one, 5) * (x5 - 0.0625 * x6)[None, :]
                t += _tail(w, one, 4) * (x4 - 0.0625 * x5)[None, :]
                t += _tail(w, one, 3) * (x3 - 0.0625 * x4)[None, :]
                t += _tail(w, one, 2) * (x2 - 0.0625 * x3)[None, :]
                t += _tail(w, one, 1) * (x1 - 0.0625 * x2)[None, :]
                t += _tail(w, one, 0) * (x0 - 0.0625 * x1)[None, :]
                acc += t * (16.0 * s)
                if FLOAT_ZERO:
                    acc += c * sx[None, :]
        sums = tl.sum(acc, 1)
        if RMS_KP:
            squares = x_all.to(tl.float32) * x_all.to(tl.float32)
    if RMS_EPS > 0:
        sums = sums * _inv_rms(squares, K, RMS_EPS)
    if GATE_OUT:
        finish_gate_out(sums, rows, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k,
                         N, split_k, SPLIT, HAS_BIAS, BLOCK_N)
    else:
        finish(sums[None, :], ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k,
                tl.arange(0, 1), offs_n, M, N, stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit
def _w4_whole_k_loop_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, N, n_tiles,
                            stride_wn, stride_sn, stride_zn, GROUP: tl.constexpr,
                            BLOCK_N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                            BF16X2: tl.constexpr, HAS_BIAS: tl.constexpr,
                            GATE_OUT: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                            RMS_EPS: tl.constexpr = 0.0, FLOAT_ZERO: tl.constexpr = False):
    """One row of x, whole-K tiles (as _w4_gemv_kernel's WHOLE_K) from fewer programs than
    tiles: program p takes tiles p, p + P, ..., and keeps the next one's words, scales and
    zeros in flight during this one's products, so its loads and its math overlap (one tile a
    program runs them back to back, and the programs of an SM start together). x, and with
    RMS_EPS its 1 / rms (FLOAT_ZERO: its sums per run of four words), are read once a program.

    The loop turns two buffers, each consumed and then refilled with the tile two on (past the
    program's last tile: the last again, no branch). Written as one buffer rotating (the next
    tile requested at the top of each step), ptxas issued the requests after the step's
    products, so each step waited out a whole load latency. Here a refill is written after its
    buffer's products and before the other buffer's, where ptxas keeps it, without a fence or
    a rotation's register moves (test_w4_load_order checks the placement)."""
    pdl_release(USE_PDL)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    n_it = tl.cdiv(n_tiles - pid, step)  # this program's tiles (>= 1: programs <= n_tiles)
    b0 = _loop_tile_loads(w_ptr, s_ptr, z_ptr, 0, n_it, pid, step, N, stride_wn, stride_sn,
                          stride_zn, GROUP, BLOCK_N, K, KP, GATE_OUT)
    b1 = _loop_tile_loads(w_ptr, s_ptr, z_ptr, 1, n_it, pid, step, N, stride_wn, stride_sn,
                          stride_zn, GROUP, BLOCK_N, K, KP, GATE_OUT)
    pdl_wait(USE_PDL)
    x = _whole_k_x(x_ptr, K, KP, BF16X2)
    xsum = _whole_k_x_sums(x, FLOAT_ZERO)
    inv_rms = 1.0
    if RMS_EPS > 0:
        inv_rms = _inv_rms(_x_squares(x_ptr, K, KP), K, RMS_EPS)
    for it in range(0, n_it, 2):
        _loop_tile_out(b0, pid + it * step, x, xsum, inv_rms, bias_ptr, out_ptr, N, GROUP,
                       BLOCK_N, KP, BF16X2, HAS_BIAS, GATE_OUT, FLOAT_ZERO)
        b0 = _loop_tile_loads(w_ptr, s_ptr, z_ptr, it + 2, n_it, pid, step, N, stride_wn,
                              stride_sn, stride_zn, GROUP, BLOCK_N, K, KP, GATE_OUT)
        if it + 1 < n_it:
            _loop_tile_out(b1, pid + (it + 1) * step, x, xsum, inv_rms, bias_ptr, out_ptr, N,
                           GROUP, BLOCK_N, KP, BF16X2, HAS_BIAS, GATE_OUT, FLOAT_ZERO)
        b1 = _loop_tile_loads(w_ptr, s_ptr, z_ptr, it + 3, n_it, pid, step, N, stride_wn,
                              stride_sn, stride_zn, GROUP, BLOCK_N, K, KP, GATE_OUT)


@triton.jit
def _loop_tile_loads(w_ptr, s_ptr, z_ptr, it, n_it, pid, step, N, stride_wn, stride_sn,
                     stride_zn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, K: tl.constexpr,
                     KP: tl.constexpr, GATE_OUT: tl.constexpr):
    """(rows, words, zeros, scales) of the program's it-th tile (past its last: the last
    again, unused, so that no branch guards the request)."""
    tile = pid + tl.minimum(it, tl.maximum(n_it - 1, 0)) * step
    rows = tile_rows(tile, N, BLOCK_N, GATE_OUT)
    w, z8, s = _whole_k_tile(w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn, stride_zn, GROUP,
                             K, KP)
    return rows, w, z8, s


@triton.jit
def _loop_tile_out(buf, tile, x, xsum, inv_rms, bias_ptr, out_ptr, N, GROUP: tl.constexpr,
                   BLOCK_N: tl.constexpr, KP: tl.constexpr, BF16X2: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GATE_OUT: tl.constexpr, FLOAT_ZERO: tl.constexpr):
    """A loaded tile's (_loop_tile_loads) row sums, written out."""
    rows, w, z8, s = buf
    sums = _whole_k_sums(w, z8, s, x, xsum, GROUP, BLOCK_N, KP, BF16X2 == 2,
                         FLOAT_ZERO) * inv_rms
    if GATE_OUT:
        finish_gate_out(sums, rows, out_ptr, out_ptr, bias_ptr, out_ptr, tile, 0, N, 1,
                         False, HAS_BIAS, BLOCK_N)
    else:
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        finish(sums[None, :], out_ptr, out_ptr, bias_ptr, out_ptr, tile, 0,
                tl.arange(0, 1), offs_n, 1, N, 0, 1, False, HAS_BIAS)


@triton.jit
def _whole_k_tile(w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn, stride_zn,
                  GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """(words [rows, KP // 8], zeros and scales [rows, KP // 32]) of a whole-K tile; past K
    the words read 0 and the scales 0."""
    WP: tl.constexpr = KP // 8
    offs = tl.arange(0, WP)
    ok = offs < K // 8
    # int32 element offsets (rows x stride + column) added to the 64-bit base once a load take
    # fewer instructions a weight than int64 row offsets; _whole_k_fits keeps a weight under
    # 2^31 words.
    rows = rows.to(tl.int32)
    w = tl.load(w_ptr + (rows[:, None] * stride_wn + offs[None, :]), mask=ok[None, :], other=0)
    # The runs' zeros and scales gathered as one flat [rows x runs] vector, then reshaped: that
    # lands in the words' own layout. A [rows, runs] gather got a layout of its own from
    # Triton 3.6, which then moved every word tile into it through shared memory.
    RUNS: tl.constexpr = WP // 4
    BLOCK_N: tl.constexpr = rows.shape[0]
    flat = tl.arange(0, BLOCK_N * RUNS)
    run = flat % RUNS
    row = tl.reshape(tl.broadcast_to(rows[:, None], [BLOCK_N, RUNS]), [BLOCK_N * RUNS])
    ok = run < K // 32
    z8 = tl.load(z_ptr + (row * stride_zn + run * 32 // GROUP), mask=ok, other=0)
    s = tl.load(s_ptr + (row * stride_sn + run * 32 // GROUP), mask=ok, other=0.0)
    return w, tl.reshape(z8, [BLOCK_N, RUNS]), tl.reshape(s, [BLOCK_N, RUNS])


@triton.jit
def _whole_k_sums(w, z8, s, x, xsum, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                  KP: tl.constexpr, ASM: tl.constexpr, FLOAT_ZERO: tl.constexpr = False):
    """A whole-K tile's row sums [BLOCK_N] from its words, zeros and scales (_whole_k_tile)
    and x (_whole_k_x; xsum: its sums per run, _whole_k_x_sums, for FLOAT_ZERO)."""
    w0, w1, w2, w3 = _quarters(tl.reshape(w, [BLOCK_N, KP // 32, 2, 2]))
    s = s.to(tl.float32)
    z8, c = float_zero_split(z8, s, FLOAT_ZERO)
    t = _quartet_dot(w0, w1, w2, w3, z8, x, ASM) * s
    if FLOAT_ZERO:
        t += c * xsum
    return tl.sum(t, 1)


@triton.jit
def _whole_k_x_sums(x, FLOAT_ZERO: tl.constexpr):
    """For FLOAT_ZERO, x's sums per run of four words ([1, KP // 32], _whole_k_x's layout);
    else an unused 0."""
    if FLOAT_ZERO:
        return _quartet_x_sums(x)
    else:
        return 0.0


@triton.jit
def _whole_k_x(x_ptr, K: tl.constexpr, KP: tl.constexpr, BF16X2: tl.constexpr):
    """x's pairs for a whole-K tile: 16 [1, KP // 32] tensors in the words' layout."""
    quad = tl.arange(0, KP // 32)
    x0 = _x_quarter(x_ptr, quad, 0, K, BF16X2)
    x1 = _x_quarter(x_ptr, quad, 1, K, BF16X2)
    x2 = _x_quarter(x_ptr, quad, 2, K, BF16X2)
    x3 = _x_quarter(x_ptr, quad, 3, K, BF16X2)
    return (x0[0], x0[1], x0[2], x0[3], x1[0], x1[1], x1[2], x1[3],
            x2[0], x2[1], x2[2], x2[3], x3[0], x3[1], x3[2], x3[3])


@triton.jit
def _x_squares(x_ptr, K, KP: tl.constexpr):
    """x's float32 squares [KP] (0 past K): the in-GEMV norm's statistic from all of x."""
    offs_x = tl.arange(0, KP)
    xs = tl.load(x_ptr + offs_x, mask=offs_x < K, other=0.0).to(tl.float32)
    return xs * xs


@triton.jit
def _inv_rms(squares, K, EPS: tl.constexpr):
    """1 / rms(x) as the RMSNorm kernel computes it: mean of the squares + eps, float32."""
    return tl.math.rsqrt(tl.sum(squares) / K + EPS)


@triton.jit
def _x_quarter(x_ptr, quad, AT: tl.constexpr, K: tl.constexpr, BF16X2: tl.constexpr):
    """The x pairs of words 4 quad + AT as [1, quads] rows, read in the layout of the words they
    meet (no shared-memory layout change after the PDL wait: sm_90a, 11 -> 3 barriers)."""
    word = (4 * quad + AT)[None, :]
    ok = word < K // 8
    if BF16X2 == 2:
        return x_pairs_prmt(x_ptr, 0, word, ok)
    else:
        return x_pairs(x_ptr, 0, word, ok)


def _two_rows_dot_asm() -> str:
    """sm_90 PTX of _bf16x2_word_dot for two rows of x at once: each nibble pair of the word is
    unpacked and has the zero subtracted once (lop3, sub), then multiplied into both rows'
    packed-bf16 sums, in the one-row kernel's order. Operands: the two outputs, the word, the
    zero pair, row 0's four x pairs, row 1's."""
    lines = [".reg .b32 t, v, a0, a1;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;"]
    for a in range(4):
        src = "$2"
        if a:
            lines.append(f"shr.u32 t, $2, {4 * a};")
            src = "t"
        lines += [f"lop3.b32 v, {src}, 0x000F000F, 0x43004300, 0xEA;", "sub.rn.bf16x2 v, v, $3;"]
        for r in range(2):
            pair = f"${4 + 4 * r + a}"
            lines.append(f"mul.rn.bf16x2 a{r}, v, {pair};" if a == 0
                         else f"fma.rn.bf16x2 a{r}, v, {pair}, a{r};")
    for r in range(2):
        lines += [f"mov.b32 {{lo, hi}}, a{r};", "cvt.f32.bf16 flo, lo;", "cvt.f32.bf16 fhi, hi;",
                  f"add.f32 ${r}, flo, fhi;"]
    return "{\n" + "\n".join(lines) + "\n}"


_TWO_ROWS_ASM = tl.constexpr(_two_rows_dot_asm())


@triton.jit
def _two_rows_word_dot(w, z, p00, p01, p02, p03, p10, p11, p12, p13, ASM: tl.constexpr):
    """sum_i (q_i - z) x_ri per word for rows r = 0, 1 (p<r><a>: row r's x pairs), each as
    _bf16x2_word_dot computes it (ASM: its PTX; else the float32 twin)."""
    if ASM:
        zc = ((z.to(tl.uint32) + 0x4300) * 0x10001).to(tl.int32, bitcast=True)
        t0, t1 = tl.inline_asm_elementwise(
            asm=_TWO_ROWS_ASM, constraints="=r,=r,r,r,r,r,r,r,r,r,r,r",
            args=[w, zc, p00, p01, p02, p03, p10, p11, p12, p13],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        u = w.to(tl.uint32, bitcast=True)
        zf = z.to(tl.float32)
        t0 = _word_dot_f32(u, p00, p01, p02, p03, zf)
        t1 = _word_dot_f32(u, p10, p11, p12, p13, zf)
    return t0, t1


@triton.jit
def _x_row_pairs(x_ptr, r, M, stride_xm, k, offs_w, PRMT: tl.constexpr):
    """Row r of x's pairs for the chunk at k (rows past M re-read row M - 1: no mask)."""
    x_row = x_ptr + tl.minimum(r, M - 1) * stride_xm
    if PRMT:
        return x_pairs_prmt(x_row, k, offs_w)
    else:
        return x_pairs(x_row, k, offs_w)


@triton.jit
def _row_x_sums(p, CHAIN: tl.constexpr, WORDS: tl.constexpr):
    """A row of x's sums from its four pair tensors (x_pairs): per run of four words (CHAIN,
    [1, WORDS // 4]) or per word ([1, WORDS])."""
    sw = pairs_sum(p[0], p[1], p[2], p[3])
    if CHAIN:
        return _run_sums(sw, WORDS)
    else:
        return sw[None, :]


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_few_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                        stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
                        split_k, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr,
                        ASM: tl.constexpr, USE_PDL: tl.constexpr = False,
                        CHAIN: tl.constexpr = False, FOUR: tl.constexpr = False,
                        FLOAT_ZERO: tl.constexpr = False):
    """M == 2 rows of bf16 x (FOUR, with CHAIN: 3-4 rows): the one-row kernel's packed-bf16
    products, each weight word unpacked once for every row (_two_rows_word_dot). Against the
    tensor-core kernel (16 rows padded, the dequantized tile through shared memory): ~4.8 sm_90
    instructions per weight at two rows. CHAIN: four words of a weight row per packed sum, as
    the one-row kernel's CHAIN. FLOAT_ZERO: float zeros, as the one-row kernel's."""
    WORDS: tl.constexpr = CHUNK // 8
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_w = tl.arange(0, WORDS)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # K is a multiple of CHUNK
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_w[None, :]
    if CHAIN:
        acc0 = tl.zeros([BLOCK_N, WORDS // 4], tl.float32)
        acc1 = tl.zeros([BLOCK_N, WORDS // 4], tl.float32)
        if FOUR:
            acc2 = tl.zeros([BLOCK_N, WORDS // 4], tl.float32)
            acc3 = tl.zeros([BLOCK_N, WORDS // 4], tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_N, WORDS], tl.float32)
        acc1 = tl.zeros([BLOCK_N, WORDS], tl.float32)
    n1, n2, n3 = _first_words(w_ptrs, k_lo, k_hi, CHUNK, PREFETCH)
    pdl_wait(USE_PDL)
    for k in range(k_lo, k_hi, CHUNK):
        w, n1, n2, n3 = _chunk_words(w_ptrs, n1, n2, n3, k, k_hi, CHUNK, PREFETCH)
        g = k // GROUP
        s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)[:, None]
        z8, c = float_zero_split(tl.load(z_ptr + rows * stride_zn + g)[:, None], s, FLOAT_ZERO)
        x0 = _x_row_pairs(x_ptr, 0, M, stride_xm, k, offs_w, CHAIN and ASM)
        x1 = _x_row_pairs(x_ptr, 1, M, stride_xm, k, offs_w, CHAIN and ASM)
        if FOUR:
            x2 = _x_row_pairs(x_ptr, 2, M, stride_xm, k, offs_w, ASM)
            x3 = _x_row_pairs(x_ptr, 3, M, stride_xm, k, offs_w, ASM)
            t0, t1, t2, t3 = _chained_four_rows_dot(w, z8, x0, x1, x2, x3, BLOCK_N, WORDS, ASM)
            acc2 += t2 * s
            acc3 += t3 * s
            if FLOAT_ZERO:
                acc2 += c * _row_x_sums(x2, CHAIN, WORDS)
                acc3 += c * _row_x_sums(x3, CHAIN, WORDS)
        elif CHAIN:
            t0, t1 = _chained_two_rows_dot(w, z8, x0[0], x0[1], x0[2], x0[3], x1[0], x1[1],
                                           x1[2], x1[3], BLOCK_N, WORDS, ASM)
        else:
            t0, t1 = _two_rows_word_dot(w, z8, x0[0][None, :], x0[1][None, :], x0[2][None, :],
                                        x0[3][None, :], x1[0][None, :], x1[1][None, :],
                                        x1[2][None, :], x1[3][None, :], ASM)
        acc0 += t0 * s
        acc1 += t1 * s
        if FLOAT_ZERO:
            acc0 += c * _row_x_sums(x0, CHAIN, WORDS)
            acc1 += c * _row_x_sums(x1, CHAIN, WORDS)
    if FOUR:
        # tl.join adds a last axis: [n, j, i] = row 2j + i after the reshape.
        both = tl.join(tl.join(tl.sum(acc0, 1), tl.sum(acc2, 1)),
                       tl.join(tl.sum(acc1, 1), tl.sum(acc3, 1)))
        part = tl.trans(tl.reshape(both, [BLOCK_N, 4]))
        offs_m = tl.arange(0, 4)
    else:
        part = tl.trans(tl.join(tl.sum(acc0, 1), tl.sum(acc1, 1)))
        offs_m = tl.arange(0, 2)
    finish(part, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
            stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_skinny_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
                      split_k, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                      USE_PDL: tl.constexpr = False, FLOAT_ZERO: tl.constexpr = False):
    """1 < M <= 16: per chunk a tensor-core product with v = 1 + q/16 (exact in x's dtype),
    then acc += s (16 x.v - (16 + z) sum(x)) with the chunk's group scale and zero
    (FLOAT_ZERO: acc += 16 s x.v - (16 s + zs) sum(x))."""
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = tl.minimum(offs_m, M - 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + tl.arange(0, CHUNK // 8)[None, :]
    # x as [M, words, v, a] (k = 8 word + 4 v + a), read contiguously; permuted to
    # unpack_paired's order (column 8 word + 2 a + v) for the product, summed as it is.
    offs_x = (8 * tl.arange(0, CHUNK // 8)[:, None, None] + 4 * tl.arange(0, 2)[None, :, None]
              + tl.arange(0, 4)[None, None, :])
    x_ptrs = x_ptr + x_rows[:, None, None, None] * stride_xm + offs_x[None, :, :, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, CHUNK):
        x4 = tl.load(x_ptrs + k)
        x = tl.reshape(tl.permute(x4, (0, 1, 3, 2)), [BLOCK_M, CHUNK])
        sx = tl.sum(tl.reshape(x4, [BLOCK_M, CHUNK]).to(tl.float32), 1)
        v = unpack_paired(tl.load(w_ptrs + tl.multiple_of(k // 8, CHUNK // 8)), x.dtype)
        t = tl.dot(x, tl.trans(v), input_precision=DOT_PREC)
        g = k // GROUP
        s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)
        z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)
        if FLOAT_ZERO:
            acc += t * (16.0 * s)[None, :] - sx[:, None] * (16.0 * s + z)[None, :]
        else:
            acc += t * (16.0 * s)[None, :] - sx[:, None] * (s * (16.0 + z))[None, :]
    finish(acc, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
            stride_om, split_k, SPLIT, HAS_BIAS)


@dataclass(frozen=True)
class W4Config(GemvConfig):
    """GemvConfig for packed int4: block_k is the K chunk (clamped to the group size: each chunk
    has one scale and zero per row) and the split-K granularity. dot: run M == 1 through the
    tensor-core (M <= 16) kernel instead of float32 FMAs. bit_convert (M == 1 FMA kernel, bf16
    x): products from packed bf16 pairs (BF16X2; 2: four words per packed sum, CHAIN).
    two_rows (two rows of bf16 x): the packed-bf16 kernel for both rows at once
    (_w4_few_rows_kernel), not the tensor-core one; four_rows (3-4 rows of bf16 x, bit_convert
    2): the same for four rows, falling back to the tensor-core kernel where x is not 8-byte
    aligned or a chunk row has fewer than four words. mma (1-16 rows of bf16 x, groups of 128,
    block_n 16 or 32 rows per warp): the tensor-core kernel that unpacks nibbles straight into
    mma fragments (gemv_int4_mma; a tuner candidate at 2-16 rows), falling back like four_rows."""

    dot: bool = False
    two_rows: bool = False
    four_rows: bool = False
    whole_k: bool = False  # M == 1 chained, split 1, _whole_k_fits: _w4_gemv_kernel's WHOLE_K

    def label(self) -> str:
        """A short name for logs and benchmark tables."""
        rows = "two-row" if self.two_rows else "four-row" if self.four_rows else ""
        kind = "dot" if self.dot else "mma" if self.mma else (rows or "fma") + (
            " bf16x2" if self.bit_convert or rows else "") + (
            " chained" if self.bit_convert == 2 else "")
        kind += (" prefetch" + (str(int(self.prefetch)) if self.prefetch > 1 else "")
                 if self.prefetch and not self.dot else "") + (" whole-K" if self.whole_k else "")
        kind += f" loop {self.persist}/SM" if self.persist else ""
        split = f"split {self.split_k}" if self.split_k else "split auto"
        return (f"w4 {kind} n{self.block_n} k{self.block_k} {split} warps {self.num_warps}"
                + (f" stages {self.num_stages}" if self.num_stages > 1 else ""))


def default_w4_config(m: int) -> W4Config:
    """An untuned config: 8 KiB of packed weight per tile (as gemv's 8 x 512 bf16 at M == 1)."""
    if m == 1:
        return W4Config(block_n=128, block_k=128, num_warps=2, prefetch=True)
    return W4Config(block_n=128, block_k=128, num_warps=4, dot=True)


def candidate_w4_configs(m: int, dtype: torch.dtype = torch.bfloat16) -> list[W4Config]:
    """The configs w4_linear_small measures per shape. Compiles are per tile shape only:
    split_k is a runtime value, so the split variants (0: from the shape) cost just their timing.
    M == 1 FMA kernel: rows per thread = block_n / (8 num_warps); 8 amortizes the x work best."""
    dot = [W4Config(bn, 128, sk, w, st, dot=True) for bn, sk, w, st in
           [(128, 0, 4, 1), (256, 0, 8, 1), (64, 0, 4, 1), (128, 0, 4, 3), (128, 2, 4, 1),
            (128, 4, 4, 1)]]
    if m > 1:
        mma = _mma_configs(m, dtype)
        # With the mma tiles (bf16 x) two dot tiles are enough: at 2-16 rows the mma or
        # few-row kernels win every Llama-3.1-8B projection.
        dots = dot[:2] if mma else dot + [W4Config(128, 64, 0, 4, dot=True)]
        return dots + _few_rows_configs(m, dtype) + mma
    fma = [W4Config(bn, 128, 0, w, 1, pf) for bn, w, pf in
           [(128, 2, True), (256, 4, True), (128, 4, True), (64, 2, True), (128, 2, False)]]
    splits = [W4Config(128, 128, sk, 2, 1, True) for sk in (1, 2, 4, 8)]
    if dtype != torch.bfloat16:
        return fma + splits + dot[:2]
    # bf16 x: packed bf16 products, four words per packed sum (bit_convert 2; per-word sums where
    # a chunk row has fewer than four words); split_k is a runtime value, so the split variants
    # cost only their timing.
    chained = [W4Config(bn, 128, sk, w, 1, True, bit_convert=2) for bn, w, sks in
               [(128, 8, (0, 2, 4, 8, 16)), (64, 4, (0, 2, 8, 16)), (32, 2, (2, 16)),
                (128, 2, (0,)), (128, 4, (0,))] for sk in sks]
    # Two or three chunks requested ahead: with one, too few bytes are in flight to cover the
    # memory latency (the loads are latency-bound).
    chained += [W4Config(bn, 128, sk, w, 1, pf, bit_convert=2) for bn, w, sk, pf in
                [(128, 8, 0, 2), (128, 8, 2, 2), (64, 4, 0, 2), (64, 4, 0, 3)]]
    # A program's whole weight slice requested at once, before the PDL wait (WHOLE_K; where
    # it does not fit, _whole_k_fits, these run the chained loop without a split): more bytes
    # in flight for loads that are latency-bound. No spills at Llama-3.1-8B's K.
    whole = [W4Config(bn, 128, 1, w, 1, True, bit_convert=2, whole_k=True) for bn, w in
             [(8, 4), (16, 4), (16, 8), (32, 8), (2, 4), (4, 8)]]
    # The same tiles from a few programs an SM, each looping with the next tile's weights in
    # flight (_w4_whole_k_loop_kernel): two programs an SM beat more.
    whole += [W4Config(bn, 128, 1, w, 1, True, bit_convert=2, whole_k=True, persist=p)
              for bn, w, p in [(8, 4, 2), (2, 4, 2), (4, 2, 4), (4, 2, 6)]]
    return fma + splits + chained + whole + _mma_configs(m, dtype) + dot[:2]


def _mma_configs(m: int, dtype: torch.dtype) -> list[W4Config]:
    """The tensor-core fragment kernel's tiles for bf16 x, MIN_ROWS-16 rows: 16 or 32 rows a
    warp, one group a step with or without PREFETCH, or 2-4 groups a step (block_k 256 / 512):
    each won a Llama-3.1-8B projection at 4 or 16 rows or came close; no explicit split counts
    (they lost everywhere to the shape's own)."""
    if (dtype != torch.bfloat16
            or not gemv_int4_mma.MIN_ROWS <= m <= gemv_int4_mma.MAX_ROWS):
        return []
    return [W4Config(16 * tiles * w, bk, 0, w, 1, pf, mma=True)
            for tiles, w, pf, bk in [(2, 4, False, 128), (2, 8, False, 128), (1, 8, True, 128),
                                     (1, 4, False, 256), (2, 4, False, 256), (1, 8, False, 512),
                                     (2, 4, False, 512)]]


def _few_rows_configs(m: int, dtype: torch.dtype) -> list[W4Config]:
    """The packed-bf16 few-row kernel's tiles for bf16 x: two rows (the two-row bucket; sm_90
    SASS ~4.8 instructions per weight per word sums, ~3.5 chained, no spills) or four (the
    3-4-row bucket, chained only: per word sums needed 8-10 per weight)."""
    if dtype != torch.bfloat16 or m not in (2, 4):
        return []
    if m == 4:
        return [W4Config(bn, 128, sk, w, 1, True, bit_convert=2, four_rows=True)
                for bn, w, sk in [(128, 8, 0), (64, 4, 0), (64, 2, 0), (128, 4, 0), (128, 8, 2)]]
    # Four words per packed sum (bit_convert 2; per-word sums where x is not 8-byte aligned).
    return [W4Config(bn, 128, sk, w, 1, True, bit_convert=2, two_rows=True)
            for bn, w, sk in [(128, 8, 0), (128, 8, 2), (64, 4, 0), (64, 4, 8), (64, 2, 0),
                              (128, 4, 0)]]


def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, bias: torch.Tensor | None = None,
            config: GemvConfig | None = None, rms_eps: float = 0.0) -> torch.Tensor:
    """x [..., K] @ dequant(qweight)^T (+ bias) for at most MAX_M rows of x; output in x's dtype.

    Constraints: K and group_size multiples of 16 (a short last group where the group size
    does not divide K; K itself: one group per row); any N. The K chunk is
    gcd(config.block_k, group_size, K); block_k is also the split-K granularity.
    rms_eps > 0 (one row, a one-row config: gemv.rms_ok): the product is taken with
    x / rms(x), as gemv's.
    """
    k = x.shape[-1]
    n = qweight.shape[0]
    words = packed_words(qweight, scales, zeros, group_size, k)
    x2 = row_major(x.reshape(-1, k))
    m = x2.shape[0]
    if m > MAX_M:
        raise ValueError(f"w4_gemv handles at most {MAX_M} rows, got {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_w4_config(m)
    if rms_eps and not rms_ok(m, n, k, cfg, x.device):
        raise ValueError(f"rms_eps needs one row and a one-row config (with a K split, an x "
                         f"that fits: gemv.split_rms_fits); got M={m}, {cfg}")
    chunk = kernel_chunk(cfg.block_k, group_size, k)  # within one group; a multiple of 16
    split, per_split = choose_split_k(cfg, n, k, x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = counters(x.device, n_tiles) if split > 1 else out
    scales, zeros = row_major(scales), row_major(zeros)
    args = (x2, words, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k,
            x2.stride(0), words.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
            per_split, split)
    float_zero = float_zeros(zeros)
    common = dict(GROUP=group_size, BLOCK_N=cfg.block_n, CHUNK=chunk, SPLIT=split > 1,
                  HAS_BIAS=bias is not None, FLOAT_ZERO=float_zero, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    if getattr(cfg, "mma", False) and gemv_int4_mma.mma_ok(x2, group_size, cfg.block_k):
        gemv_int4_mma.launch(args, m, n_tiles, split, cfg.num_warps, cfg.block_n,
                             bias is not None, x2.is_cuda, pdl.launch_kwargs(x.device),
                             prefetch=cfg.prefetch, block_k=cfg.block_k, float_zero=float_zero)
    elif m == 1 and not getattr(cfg, "dot", False):
        _launch_one_row(args, cfg, _one_row_path(cfg, x2, chunk, n, k, split, rms_eps), common,
                        n_tiles, split, x.device)
    elif getattr(cfg, "two_rows", False):
        if m != 2 or x2.dtype != torch.bfloat16 or x2.data_ptr() % 4 or x2.stride(0) % 2:
            raise ValueError(f"w4_gemv: {cfg.label()} takes two rows of 4-byte aligned bf16 x; "
                             f"got {m} rows of {x2.dtype}")
        _w4_few_rows_kernel[(n_tiles, split)](*args, PREFETCH=cfg.prefetch, ASM=x2.is_cuda,
                                              CHAIN=cfg.bit_convert == 2 and _chain_ok(x2, chunk),
                                              **common)
    elif getattr(cfg, "four_rows", False) and 2 < m <= 4 and _chain_ok(x2, chunk):
        _w4_few_rows_kernel[(n_tiles, split)](*args, PREFETCH=cfg.prefetch, ASM=x2.is_cuda,
                                              CHAIN=True, FOUR=True, **common)
    else:  # the tensor-core kernel (also four_rows' fallback)
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        _w4_skinny_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec, **common)
    return out.view(*x.shape[:-1], n)


def _one_row_path(cfg: GemvConfig, x2: torch.Tensor, chunk: int, n: int, k: int, split: int,
                  rms_eps: float = 0.0) -> dict:
    """_w4_gemv_kernel's path constexprs for a config. The plain product (which the tuner times)
    and the gate-out launch (which reuses its choice) both take them from here, so they run the
    same code (as kernels/gemv/dense.one_row_path)."""
    chain = _chained(cfg, x2, chunk)
    whole = getattr(cfg, "whole_k", False) and chain and split == 1 and _whole_k_fits(cfg, n, k)
    return dict(PREFETCH=cfg.prefetch, STAGES=cfg.num_stages, BF16X2=_bf16x2_mode(cfg, x2),
                CHAIN=chain, WHOLE_K=k if whole else 0,
                WHOLE_KP=triton.next_power_of_2(k) if whole else 0, RMS_EPS=float(rms_eps),
                RMS_KP=triton.next_power_of_2(k) if rms_eps and split > 1 else 0)


def _whole_k_fits(cfg: GemvConfig, n: int, k: int) -> bool:
    """Whether a whole-K tile holds at most 64 words (512 nibbles) a thread, K rounded up to a
    power of two: sm_90a ptxas, 80-217 registers and no spills for every such candidate at
    Llama-3.1-8B's K = 4,096 and 14,336; and the weight's word offsets fit in int32
    (_whole_k_tile)."""
    return (cfg.block_n * triton.next_power_of_2(k) // 8 <= 64 * 32 * cfg.num_warps
            and n * triton.next_power_of_2(k) // 8 < 2**31)


def _bf16x2_mode(cfg: GemvConfig, x2: torch.Tensor) -> int:
    """The M == 1 kernel's BF16X2: 2 (PTX) on CUDA, 1 (its float32 twin) in the interpreter, 0
    when the config does not ask for it or x is not bf16 read as aligned 32-bit pairs."""
    if not cfg.bit_convert or x2.dtype != torch.bfloat16 or x2.data_ptr() % 4:
        return 0
    return 2 if x2.is_cuda else 1


def _chained(cfg: GemvConfig, x2: torch.Tensor, chunk: int) -> bool:
    """The M == 1 kernel's CHAIN: bit_convert 2 asks for it; it needs packed bf16 products, four
    words per chunk row and x 8-byte aligned (read as 64-bit pairs of pairs)."""
    return cfg.bit_convert == 2 and _bf16x2_mode(cfg, x2) > 0 and _chain_ok(x2, chunk)


def _mma_gate_out(cfg: GemvConfig, x2: torch.Tensor, group_size: int) -> bool:
    """Whether a gate-out call with this config runs the mma kernel (32 rows a warp: a gate and
    an up tile) rather than the one-row FMA kernel."""
    return (getattr(cfg, "mma", False) and gemv_int4_mma.mma_ok(x2, group_size, cfg.block_k)
            and tiles_per_warp(cfg.block_n, cfg.num_warps) == 2)


def _chain_ok(x2: torch.Tensor, chunk: int) -> bool:
    """Four words per chunk row, and bf16 x whose rows start 8-byte aligned."""
    return (x2.dtype == torch.bfloat16 and chunk % 32 == 0 and x2.data_ptr() % 8 == 0
            and (x2.shape[0] == 1 or x2.stride(0) % 4 == 0))


_SMALL_CHOICES: dict[tuple, W4Config] = tuning_cache.register("gemv.int4.small", {})


def w4_linear_small(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """w4_gemv with a config measured once per (M bucket, N, K, group, dtype) on CUDA. Off CUDA,
    and for an unmeasured shape during CUDA-graph capture, the default config runs."""
    out = _maybe_cuda_cpp(x, qweight, scales, zeros, group_size, bias)
    if out is not None:  # the CUDA C++ one-row kernel took the call
        return out
    cfg = _small_choice(x, qweight, scales, zeros, group_size, bias)
    return w4_gemv(x, qweight, scales, zeros, group_size, bias, cfg)


def _maybe_cuda_cpp(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                    gate_out: bool = False, rms_eps: float = 0.0) -> torch.Tensor | None:
    """The CUDA C++ one-row kernel's output, or None where it does not take the call (then the
    Triton path runs)."""
    return w4_stream.maybe_stream(x, qweight, scales, zeros, group_size, bias, gate_out,
                                         rms_eps)


def _small_choice(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                  gate_out: bool = False, rms_eps: float = 0.0) -> W4Config | None:
    """w4_linear_small's measured config for x's row count (None: not measurable now). One row
    is measured as it will run: the plain product, with the in-GEMV norm (rms_eps > 0), as a
    gate-out, or both, each among the configs that run it (a config's gate-out need not rank
    as its plain product does)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    n = qweight.shape[0]
    bucket = m if m <= 2 else 4 if m <= 4 else MAX_M
    if 4 < m <= gemv_int4_mma.NARROW_ROWS:
        bucket = gemv_int4_mma.NARROW_ROWS  # the mma kernel's one-step bucket (5-8 rows)
    kind = " ".join(part for part in (call_kind(gate_out, rms_eps),
                                      gemm_int4.FLOAT_ZERO_KIND if float_zeros(zeros) else "")
                    if part)
    key = (bucket, n, k, group_size, x.dtype, bias is not None, x.device.index) + (
        (kind,) if kind else ())
    cfg = _SMALL_CHOICES.get(key)
    if cfg is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        xs = torch.randn((bucket, k), device=x.device, dtype=x.dtype)
        cands = [(c, _one_call(c, group_size, bias, gate_out, rms_eps))
                 for c in candidate_w4_configs(bucket, x.dtype)
                 if _runs(c, xs, n, k, group_size, gate_out, rms_eps)]
        xr = xs.double()
        if rms_eps:
            xr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + rms_eps)
        want = w4_linear_reference(xr, qweight, scales, zeros, group_size,
                                   None if bias is None else bias.double()).float()
        if gate_out:
            want = silu_and_mul(want)
        label = f"w4 M<={bucket} N={n} K={k} G={group_size}{' ' + kind if kind else ''}"
        cfg = _SMALL_CHOICES[key] = measure_best(cands, (xs, qweight, scales, zeros), want,
                                                 default_w4_config(bucket), label)
    return cfg


def _one_call(cfg: W4Config, group_size: int, bias: torch.Tensor | None, gate_out: bool,
              rms_eps: float):
    """The call _small_choice times for a config: (x, qweight, scales, zeros) -> out."""
    if gate_out:
        return lambda x_, q_, s_, z_: w4_gemv_gate_out(x_, q_, s_, z_, group_size, bias, cfg,
                                                       rms_eps)
    return lambda x_, q_, s_, z_: w4_gemv(x_, q_, s_, z_, group_size, bias, cfg, rms_eps)


def _runs(cfg: W4Config, xs: torch.Tensor, n: int, k: int, group_size: int, gate_out: bool,
          rms_eps: float) -> bool:
    """Whether a candidate config runs this call as itself (not as another kernel's fallback)."""
    m = xs.shape[0]
    if rms_eps and not rms_ok(m, n, k, cfg, xs.device):
        return False
    return not gate_out or (gate_out_ok(m, n, cfg) and (
        not getattr(cfg, "mma", False) or _mma_gate_out(cfg, xs, group_size)))


def w4_gemv_gate_out(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                     config: W4Config, rms_eps: float = 0.0) -> torch.Tensor:
    """silu_and_mul(w4_gemv(x)) for one row of x and a [gate | up] weight of 2I rows, in one
    launch of the M == 1 kernel (each program pairs its gate rows with the matching up rows).
    rms_eps > 0: of x / rms(x) (see w4_gemv; not with an mma config)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    words = packed_words(qweight, scales, zeros, group_size, k)
    x2 = row_major(x.reshape(-1, k))
    if not gate_out_ok(x2.shape[0], n, config) or (
            rms_eps and not rms_ok(x2.shape[0], n, k, config, x.device)):
        raise ValueError(f"w4_gemv_gate_out needs one row, an even N and a one-row config "
                         f"(rms_eps: gemv.rms_ok); got M={x2.shape[0]}, N={n}, {config}")
    out = torch.empty((1, n // 2), dtype=x.dtype, device=x.device)
    chunk = kernel_chunk(config.block_k, group_size, k)
    split, per_split, n_tiles, ws, cnt = gate_out_launch(config, n, k, x.device)
    scales, zeros = row_major(scales), row_major(zeros)
    args = (x2, words, scales, zeros, bias if bias is not None else out, out, ws, cnt, 1, n, k,
            x2.stride(0), words.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
            per_split, split)
    float_zero = float_zeros(zeros)
    if _mma_gate_out(config, x2, group_size):
        gemv_int4_mma.launch(args, 1, n_tiles, split, config.num_warps, config.block_n,
                             bias is not None, x2.is_cuda, pdl.launch_kwargs(x.device),
                             gate_out=True, prefetch=config.prefetch, block_k=config.block_k,
                             float_zero=float_zero)
        return out.view(*x.shape[:-1], n // 2)
    path = _one_row_path(config, x2, chunk, n, k, split, rms_eps)
    common = dict(GROUP=group_size, BLOCK_N=config.block_n, CHUNK=chunk, SPLIT=split > 1,
                  HAS_BIAS=bias is not None, FLOAT_ZERO=float_zero, num_warps=config.num_warps,
                  num_stages=config.num_stages, **pdl.launch_kwargs(x.device))
    _launch_one_row(args, config, path, common, n_tiles, split, x.device, gate_out=True)
    return out.view(*x.shape[:-1], n // 2)


def _launch_one_row(args: tuple, cfg: GemvConfig, path: dict, common: dict, n_tiles: int,
                    split: int, device: torch.device, gate_out: bool = False) -> None:
    """Launch the one-row FMA kernel (args, path and common as for _w4_gemv_kernel): a whole-K
    config with persist runs the whole-K loop from at most persist programs an SM, any other
    _w4_gemv_kernel a tile a program."""
    if not (path["WHOLE_K"] and cfg.persist):
        _w4_gemv_kernel[(n_tiles, split)](*args, **path, **common, GATE_OUT=gate_out)
        return
    x2, words, scales, zeros, bias, out = args[:6]
    programs = min(n_tiles, cfg.persist * num_sms(device))
    _w4_whole_k_loop_kernel[(programs,)](
        x2, words, scales, zeros, bias, out, args[9], n_tiles, words.stride(0),
        scales.stride(0), zeros.stride(0), GROUP=common["GROUP"], BLOCK_N=common["BLOCK_N"],
        K=path["WHOLE_K"], KP=path["WHOLE_KP"], BF16X2=path["BF16X2"],
        HAS_BIAS=common["HAS_BIAS"], GATE_OUT=gate_out, RMS_EPS=path["RMS_EPS"],
        FLOAT_ZERO=common["FLOAT_ZERO"], num_warps=common["num_warps"],
        **pdl.launch_kwargs(device))


def w4_linear_small_gate_out(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                             zeros: torch.Tensor, group_size: int,
                             bias: torch.Tensor | None = None,
                             rms_eps: float = 0.0) -> torch.Tensor | None:
    """w4_gemv_gate_out with the config measured for this gate-out call (rms_eps > 0: of
    x / rms(x)), for one row of x on CUDA; else None (not measured yet during a graph capture,
    or more rows: the caller runs the norm, the product, then the activation)."""
    if not x.is_cuda or x.numel() != x.shape[-1]:
        return None
    out = _maybe_cuda_cpp(x, qweight, scales, zeros, group_size, bias, True, rms_eps)
    if out is not None:
        return out
    cfg = _small_choice(x, qweight, scales, zeros, group_size, bias, gate_out=True,
                        rms_eps=rms_eps)
    if cfg is None or not _runs(cfg, x.reshape(1, -1), qweight.shape[0], x.shape[-1],
                                group_size, True, rms_eps):
        return None
    return w4_gemv_gate_out(x, qweight, scales, zeros, group_size, bias, cfg, rms_eps)


def w4_linear_small_rms(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor | None:
    """w4_linear_small of x / rms(x) in one launch (an RMSNorm whose weight was folded into
    this weight, models/norm_fold.py), with the config measured for that call, for one row of
    x on CUDA; else None (the caller runs the norm first)."""
    if not x.is_cuda or x.numel() != x.shape[-1]:
        return None
    out = _maybe_cuda_cpp(x, qweight, scales, zeros, group_size, bias, rms_eps=eps)
    if out is not None:
        return out
    cfg = _small_choice(x, qweight, scales, zeros, group_size, bias, rms_eps=eps)
    if cfg is None or not _runs(cfg, x.reshape(1, -1), qweight.shape[0], x.shape[-1],
                                group_size, False, eps):
        return None
    return w4_gemv(x, qweight, scales, zeros, group_size, bias, cfg, rms_eps=eps)


def w4_choices() -> dict[str, str]:
    """The per-shape choices made so far (both M ranges), for the start-up log."""
    out = {}
    for key, cfg in {**_SMALL_CHOICES, **gemm_int4.LARGE_CHOICES}.items():
        m, n, k, g, dt, b = key[:6]
        kind = f" {key[7]}" if len(key) > 7 else ""  # one row: gate-out and / or rms
        label = cfg.label() if hasattr(cfg, "label") else str(cfg)
        out[f"M<={m} N={n} K={k} G={g} {str(dt).removeprefix('torch.')}"
            f"{' +bias' if b else ''}{kind}"] = label
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """int4_awq's apply: on CUDA, M <= 16 -> w4_linear_small, larger M -> w4_linear_large (the
    measured faster of w4_gemm and dequantize + cuBLAS); elsewhere, and for a K or group size
    that is not a multiple of 16 (no real model's), the reference twin."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not x.is_cuda or m == 0 or not kernel_shape_ok(k, group_size):
        return w4_linear_reference(x, qweight, scales, zeros, group_size, bias)
    if m <= MAX_M:
        return w4_linear_small(x, qweight, scales, zeros, group_size, bias)
    return w4_linear_large(x, qweight, scales, zeros, group_size, bias)
