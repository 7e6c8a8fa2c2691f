"""Triton W4A16 dequant-GEMV for decode (M <= 16): out = x @ ((q - zero) * scale)^T (+ bias).

int4_awq layout (quantization/utils.py): qweight uint8 [N, K/2] read as int32 words (see
int4_common), scales float16 and zeros uint8 [N, K/G]. The packed weight is streamed once and
unpacked in registers; each K chunk lies in one group, so its scale and zero apply per row and
chunk. M == 1 accumulates FMAs on float32 (or, as a tuner candidate, takes the M <= 16 path);
1 < M <= 16 runs a tensor-core product per chunk. Split-K and its in-kernel reduction are those
of kernels/gemv.py; int4_linear is the entry point for int4_awq's apply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels import pdl
from slipstream.kernels.gemm_int4 import w4_gemm, w4_linear_large
from slipstream.kernels.gemv import MAX_M, GemvConfig, _counters, _finish, _split_k
from slipstream.kernels.int4_common import (
    measure_best,
    packed_words,
    row_major,
    unpack_paired,
    w4_linear_reference,
)
from slipstream.kernels.pdl import pdl_release, pdl_wait

__all__ = ["MAX_M", "W4Config", "int4_linear", "w4_choices", "w4_gemm", "w4_gemv",
           "w4_linear_large", "w4_linear_reference", "w4_linear_small"]


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
def _f16_halves(p):
    """The two float16 halves of each int32 of p, as float32 (low half first)."""
    u = p.to(tl.uint32, bitcast=True)
    lo = u.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _f16_pairs(w):
    """The 8 nibbles of each word as float32 v_i = 1024 + f_i q_i (f_i = 1 for even i, 16 for
    odd i), two per AND/OR: a nibble pair 16 bits apart ORed under float16's exponent of 1024
    (0x6400) is two float16s at once, and float16 -> float32 is a plain convert. Returns
    (v0, v4), (v1, v5), (v2, v6), (v3, v7); one shift serves nibbles 2, 3, 6 and 7."""
    w8 = (w.to(tl.uint32, bitcast=True) >> 8).to(tl.int32, bitcast=True)
    return (_f16_halves((w & 0x000F000F) | 0x64006400),
            _f16_halves((w & 0x00F000F0) | 0x64006400),
            _f16_halves((w8 & 0x000F000F) | 0x64006400),
            _f16_halves((w8 & 0x00F000F0) | 0x64006400))


@triton.jit
def _f16_pairs_asm(w):
    """_f16_pairs in inline PTX (CUDA only): four LOP3s, one shift, and eight float16 -> float32
    converts that read a register half directly (Triton's own unpacking adds PRMTs and MOVs).
    Returns v0 .. v7 in nibble order."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, c, d, w8;
        .reg .b16 al, ah, bl, bh, cl, ch, dl, dh;
        lop3.b32 a, $8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 b, $8, 0x00F000F0, 0x64006400, 0xEA;
        shr.u32 w8, $8, 8;
        lop3.b32 c, w8, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 d, w8, 0x00F000F0, 0x64006400, 0xEA;
        mov.b32 {al, ah}, a;
        mov.b32 {bl, bh}, b;
        mov.b32 {cl, ch}, c;
        mov.b32 {dl, dh}, d;
        cvt.f32.f16 $0, al;
        cvt.f32.f16 $1, bl;
        cvt.f32.f16 $2, cl;
        cvt.f32.f16 $3, dl;
        cvt.f32.f16 $4, ah;
        cvt.f32.f16 $5, bh;
        cvt.f32.f16 $6, ch;
        cvt.f32.f16 $7, dh;
        }""",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[w], dtype=(tl.float32,) * 8,
        is_pure=True, pack=1)


@triton.jit
def _word_dot_pairs(w, z, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """sum_i (q_i - z) x_i per word by _f16_pairs: sum_i v_i x~_i - 1024 sum x~ - z sum x with
    x~_i = x_i / f_i (the x terms broadcast against the words: shared by every row)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = _f16_pairs_asm(w)
    else:
        (v0, v4), (v1, v5), (v2, v6), (v3, v7) = _f16_pairs(w)
    x1, x3, x5, x7 = 0.0625 * x1, 0.0625 * x3, 0.0625 * x5, 0.0625 * x7
    sx_t = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    sx = ((x0 + 16.0 * x1) + (x2 + 16.0 * x3)) + ((x4 + 16.0 * x5) + (x6 + 16.0 * x7))
    t = -(1024.0 * sx_t) - z * sx
    t += v0 * x0
    t += v1 * x1
    t += v2 * x2
    t += v3 * x3
    t += v4 * x4
    t += v5 * x5
    t += v6 * x6
    t += v7 * x7
    return t


@triton.jit
def _word_dot_tails(w, z, one, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_i (q_i - z) x_i / 16 per word by _tail: t = sum_i v_i x'_i minus the word's share of
    the constant 1 in v and of the zero point (the x terms broadcast against the words)."""
    sx = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    t = -(15.0 + z) * (0.0625 * sx) - 0.0625 * x0
    t += _tail(w, one, 7) * x7
    t += _tail(w, one, 6) * (x6 - 0.0625 * x7)
    t += _tail(w, one, 5) * (x5 - 0.0625 * x6)
    t += _tail(w, one, 4) * (x4 - 0.0625 * x5)
    t += _tail(w, one, 3) * (x3 - 0.0625 * x4)
    t += _tail(w, one, 2) * (x2 - 0.0625 * x3)
    t += _tail(w, one, 1) * (x1 - 0.0625 * x2)
    t += _tail(w, one, 0) * (x0 - 0.0625 * x1)
    return t


# M and the split count are runtime values (no recompile per batch size or shape).
@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split, split_k,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr,
                    USE_PDL: tl.constexpr = False, STAGES: tl.constexpr = 1,
                    PAIRS: tl.constexpr = 0):
    """M == 1: per chunk and word, t = the word's share of x . (q - z), then acc += s t
    elementwise (one reduction at the end). A chunk is part of one group or several whole groups
    (each word then reads its own group's scale and zero): several give each row a longer
    contiguous read per step. Nibbles to floats by _tail (per element one IMAD, one LEA.HI and
    one FFMA) or, with PAIRS, by _f16_pairs (5 integer instructions per word instead of 16; 2:
    in inline PTX). The x terms are shared by the rows each thread holds. PREFETCH keeps two
    tiles in flight in registers; STAGES > 1 (without PREFETCH) streams them through shared
    memory."""
    WORDS: tl.constexpr = CHUNK // 8
    WPG: tl.constexpr = min(CHUNK, GROUP) // 8  # words of one group in a chunk
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N-1: no mask
    offs_w = tl.arange(0, WORDS)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # K is a multiple of CHUNK: no K mask either
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_w[None, :]
    x_ptrs = x_ptr + 8 * offs_w
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    one = (K > 0).to(tl.uint32)  # 1, unknown to the compiler (see _tail)
    if PREFETCH:  # Triton does not pipeline loads that feed no tl.dot: keep two tiles in flight
        w_next = tl.load(w_ptrs + tl.multiple_of(k_lo // 8, WORDS))
    pdl_wait(USE_PDL)  # the first weight tile is already in flight (kernels/pdl.py)
    for k in tl.range(k_lo, k_hi, CHUNK, num_stages=STAGES):
        if PREFETCH:
            w = w_next
            k_next = tl.minimum(k + CHUNK, k_hi - CHUNK)  # past the end: re-read the last tile
            w_next = tl.load(w_ptrs + tl.multiple_of(k_next // 8, WORDS))
        else:
            w = tl.load(w_ptrs + tl.multiple_of(k // 8, WORDS))
        g = k // GROUP
        if WPG == WORDS:  # one group: a scale and zero per row
            s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)[:, None]
        else:
            gw = (g + offs_w // WPG)[None, :]
            s = tl.load(s_ptr + rows[:, None] * stride_sn + gw).to(tl.float32)
            z = tl.load(z_ptr + rows[:, None] * stride_zn + gw).to(tl.float32)
        x0 = tl.load(x_ptrs + k).to(tl.float32)[None, :]
        x1 = tl.load(x_ptrs + k + 1).to(tl.float32)[None, :]
        x2 = tl.load(x_ptrs + k + 2).to(tl.float32)[None, :]
        x3 = tl.load(x_ptrs + k + 3).to(tl.float32)[None, :]
        x4 = tl.load(x_ptrs + k + 4).to(tl.float32)[None, :]
        x5 = tl.load(x_ptrs + k + 5).to(tl.float32)[None, :]
        x6 = tl.load(x_ptrs + k + 6).to(tl.float32)[None, :]
        x7 = tl.load(x_ptrs + k + 7).to(tl.float32)[None, :]
        if PAIRS:
            acc += _word_dot_pairs(w, z, x0, x1, x2, x3, x4, x5, x6, x7, PAIRS == 2) * s
        else:
            acc += _word_dot_tails(w, z, one, x0, x1, x2, x3, x4, x5, x6, x7) * (16.0 * s)
    part = tl.sum(acc, 1)[None, :]
    _finish(part, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, tl.arange(0, 1), offs_n, M,
            N, stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_skinny_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
                      split_k, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """1 < M <= 16: per chunk a tensor-core product with v = 1 + q/16 (exact in x's dtype),
    then acc += s (16 x.v - (16 + z) sum(x)) with the chunk's group scale and zero."""
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
        acc += t * (16.0 * s)[None, :] - sx[:, None] * (s * (16.0 + z))[None, :]
    _finish(acc, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
            stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "split_k"])
def _w4_wleft_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                     stride_xm, stride_wn, stride_sn, stride_zn, stride_om, k_per_split,
                     split_k, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    """M <= 16, the transposed product: out^T [BLOCK_N, BLOCK_M] = v [BLOCK_N, CHUNK] @ x^T.
    The unpacked weight tile is the left operand, which Hopper's tensor cores (wgmma) take from
    registers, so the 4x larger unpacked tile never goes through shared memory (the right operand
    must: here it is the small x^T). Per chunk as _w4_skinny_kernel; transposed once at the end."""
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + tl.arange(0, CHUNK // 8)[None, :]
    # x^T [CHUNK, BLOCK_M] read straight in unpack_paired's column order (a 2-D load: Triton
    # 3.6 fails to lay out a permuted and reshaped operand for the right-hand side).
    c = tl.arange(0, CHUNK)
    k_of_col = 8 * (c // 8) + (c % 8) // 2 + 4 * (c % 2)
    xt_ptrs = x_ptr + x_rows[None, :] * stride_xm + k_of_col[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(k_lo, k_hi, CHUNK, num_stages=STAGES):
        v = unpack_paired(tl.load(w_ptrs + tl.multiple_of(k // 8, CHUNK // 8)),
                          x_ptr.dtype.element_ty)
        xt = tl.load(xt_ptrs + k)
        sx = tl.sum(xt.to(tl.float32), 0)
        t = tl.dot(v, xt, input_precision=DOT_PREC)
        g = k // GROUP
        s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)
        z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)
        acc += t * (16.0 * s)[:, None] - (s * (16.0 + z))[:, None] * sx[None, :]
    _finish(tl.trans(acc), ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k,
            tl.arange(0, BLOCK_M), offs_n, M, N, stride_om, split_k, SPLIT, HAS_BIAS)


@dataclass(frozen=True)
class W4Config(GemvConfig):
    """GemvConfig for packed int4: block_k is the K chunk (clamped to the group size: each chunk
    has one scale and zero per row) and the split-K granularity. dot: run M == 1 through the
    tensor-core (M <= 16) kernel instead of float32 FMAs; wleft: the tensor-core kernel with the
    weight tile as the left operand (_w4_wleft_kernel), at any M <= 16; bit_convert: the FMA
    kernel converts nibbles by float16 pairs (PAIRS)."""

    dot: bool = False
    wleft: bool = False

    def label(self) -> str:
        """A short name for logs and benchmark tables."""
        kind = ("dot wleft" if self.wleft else "dot" if self.dot
                else "fma" + (" pairs" if self.bit_convert else "")
                + (" prefetch" if self.prefetch else ""))
        split = f"split {self.split_k}" if self.split_k else "split auto"
        return (f"w4 {kind} n{self.block_n} k{self.block_k} {split} warps {self.num_warps}"
                + (f" stages {self.num_stages}" if self.num_stages > 1 else ""))


def default_w4_config(m: int) -> W4Config:
    """An untuned config: 8 KiB of packed weight per tile (as gemv's 8 x 512 bf16 at M == 1)."""
    if m == 1:
        return W4Config(block_n=128, block_k=128, num_warps=2, prefetch=True)
    return W4Config(block_n=128, block_k=128, num_warps=4, dot=True)


def candidate_w4_configs(m: int) -> list[W4Config]:
    """The configs w4_linear_small measures per shape. Compiles are per tile shape only: split_k
    is a runtime value, so the split variants (0: from the shape) cost just their timing.
    M == 1 FMA kernel: rows per thread = block_n / (8 num_warps); 8 amortizes the x work best."""
    dot = [W4Config(bn, 128, sk, w, st, dot=True) for bn, sk, w, st in
           [(128, 0, 4, 1), (256, 0, 8, 1), (64, 0, 4, 1), (128, 0, 4, 3), (128, 2, 4, 1),
            (128, 4, 4, 1)]]
    # The weight tile as the tensor cores' left operand: 64 rows per warp group.
    wleft = [W4Config(bn, 128, 0, w, st, wleft=True) for bn, w, st in
             [(64, 4, 1), (64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 5)]]
    if m > 1:
        return dot + [W4Config(128, 64, 0, 4, dot=True)] + wleft
    fma = [W4Config(bn, 128, 0, w, 1, pf) for bn, w, pf in
           [(128, 2, True), (256, 4, True), (128, 4, True), (64, 2, True), (128, 2, False)]]
    splits = [W4Config(128, 128, sk, 2, 1, True) for sk in (1, 2, 4, 8)]
    # Packed tiles through shared memory (tl.range stages): more bytes in flight per SM.
    staged = [W4Config(bn, 128, 0, w, st) for bn, w, st in
              [(128, 2, 4), (128, 4, 4), (256, 4, 3), (64, 2, 4)]]
    # Several groups per step: longer contiguous reads per row (256-512 bytes).
    wide = [W4Config(bn, bk, 0, w, 1, True) for bn, bk, w in
            [(32, 512, 4), (64, 512, 4), (64, 256, 4), (16, 1024, 4), (32, 512, 2)]]
    # Nibbles to floats by float16 pairs (fewer integer instructions per weight).
    pairs = [W4Config(bn, bk, 0, w, st, pf, bit_convert=1) for bn, bk, w, st, pf in
             [(128, 128, 4, 1, True), (128, 128, 2, 1, True), (256, 128, 4, 3, False),
              (32, 512, 4, 1, True), (64, 512, 4, 1, True), (64, 256, 4, 1, True),
              (16, 1024, 4, 1, True)]]
    return fma + splits + staged + wide + pairs + dot[:2] + wleft


def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, bias: torch.Tensor | None = None,
            config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(qweight)^T (+ bias) for at most MAX_M rows of x; output in x's dtype.

    Constraints: group_size a multiple of 16 dividing K (K itself: one group per row); any N.
    The K chunk is gcd(config.block_k, group_size); block_k is also the split-K granularity.
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
    chunk = _chunk(cfg, m, group_size, k)
    split, per_split = _split_k(cfg, n, k, x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device, n_tiles) if split > 1 else out
    scales, zeros = row_major(scales), row_major(zeros)
    args = (x2, words, scales, zeros, bias if bias is not None else out, out, ws, cnt, m, n, k,
            x2.stride(0), words.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
            per_split, split)
    common = dict(GROUP=group_size, BLOCK_N=cfg.block_n, CHUNK=chunk, SPLIT=split > 1,
                  HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl.launch_kwargs(x.device))
    if getattr(cfg, "wleft", False):
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        _w4_wleft_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec,
                                           STAGES=cfg.num_stages, **common)
    elif m == 1 and not getattr(cfg, "dot", False):
        _w4_gemv_kernel[(n_tiles, split)](*args, PREFETCH=cfg.prefetch, STAGES=cfg.num_stages,
                                          PAIRS=(2 if x.is_cuda else 1) if cfg.bit_convert else 0,
                                          **common)
    else:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        _w4_skinny_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec, **common)
    return out.view(*x.shape[:-1], n)


def _chunk(cfg: GemvConfig, m: int, group_size: int, k: int) -> int:
    """The K step: part of one group (gcd(block_k, group), a power of two >= 16), or for the
    M == 1 FMA kernel block_k itself when it is whole groups that tile K."""
    fma = m == 1 and not getattr(cfg, "dot", False) and not getattr(cfg, "wleft", False)
    if fma and cfg.block_k % group_size == 0 and k % cfg.block_k == 0:
        return cfg.block_k
    return math.gcd(cfg.block_k, group_size)


_SMALL_CHOICES: dict[tuple, W4Config] = {}


def w4_linear_small(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """w4_gemv with a config measured once per (M bucket, N, K, group, dtype) on CUDA. Off CUDA,
    and for an unmeasured shape during CUDA-graph capture, the default config runs."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    bucket = 1 if m == 1 else 4 if m <= 4 else MAX_M
    key = (bucket, qweight.shape[0], k, group_size, x.dtype, bias is not None, x.device.index)
    cfg = _SMALL_CHOICES.get(key)
    if cfg is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return w4_gemv(x, qweight, scales, zeros, group_size, bias)
        xs = torch.randn((bucket, k), device=x.device, dtype=x.dtype)
        cands = [(c, lambda x_, q_, s_, z_, c=c: w4_gemv(x_, q_, s_, z_, group_size, bias, c))
                 for c in candidate_w4_configs(bucket)]
        want = w4_linear_reference(xs, qweight, scales, zeros, group_size, bias)
        label = f"w4 M<={bucket} N={qweight.shape[0]} K={k} G={group_size}"
        cfg = _SMALL_CHOICES[key] = measure_best(cands, (xs, qweight, scales, zeros), want,
                                                 default_w4_config(bucket), label)
    return w4_gemv(x, qweight, scales, zeros, group_size, bias, cfg)


def w4_choices() -> dict[str, str]:
    """The per-shape choices made so far (both M ranges), for the start-up log."""
    from slipstream.kernels import gemm_int4

    out = {}
    for (m, n, k, g, dt, b, _), cfg in {**_SMALL_CHOICES, **gemm_int4._LARGE_CHOICES}.items():
        label = cfg.label() if hasattr(cfg, "label") else str(cfg)
        out[f"M<={m} N={n} K={k} G={g} {str(dt).removeprefix('torch.')}{' +bias' if b else ''}"] = label
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """int4_awq's apply: on CUDA, M <= 16 -> w4_linear_small, larger M -> w4_linear_large (the
    measured faster of w4_gemm and dequantize + cuBLAS); elsewhere the reference twin."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not x.is_cuda or m == 0:
        return w4_linear_reference(x, qweight, scales, zeros, group_size, bias)
    if m <= MAX_M:
        return w4_linear_small(x, qweight, scales, zeros, group_size, bias)
    return w4_linear_large(x, qweight, scales, zeros, group_size, bias)
