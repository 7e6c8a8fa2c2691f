"""Shared pieces of the W4A16 kernels (kernels/gemv/int4.py, kernels/gemm/int4.py): in-register
nibble unpacking, the layout checks, the plain-torch reference twin (w4_linear_reference) and
the measured choice among candidates.

Packed words: qweight uint8 [N, K/2] (even k in the low nibble) read as int32 [N, K/8]; nibble i
(bits 4i..4i+3) of word j is k = 8j + i. Scales and zeros [N, ceil(K/G)]: where G does not divide
K the last group is short. Zeros are integers (uint8: w = (q - z) s, AWQ / GPTQ) or floats
(float16 holding the zero point times the scale: w = q s - zs). A float zs rather than a float
z: GGUF Q4_1's w = q d + m is then zs = -m, exact to the file's fp16 m (z = -m / d in fp16 is
not), and no kernel multiplies z by s. The packed-bf16 kernels keep their integer products
centred with z = 8 and add (8 s - zs) sum(x) per group and row (float_zero_split): one FMA a
row and group plus the sums of the x each program reads anyway. The kernels step along K in
chunks of gcd(tile, G, K) (kernel_chunk), so every chunk lies in one group and none runs past
K: no mask and no padding. Nibbles become floats by the exponent trick: 4 bits placed in the
mantissa under the exponent of 1.0 read as 1 + q/16, exact in fp32, fp16 and bf16 (int->float
conversion instructions run at a quarter of the FMA rate: too slow to keep up).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils as qu

logger = logging.getLogger(__name__)


@triton.jit
def _shift(w, S: tl.constexpr):
    if S >= 0:
        return w << S
    else:
        return w >> (-S)  # arithmetic: the sign bits land above the field and are masked off


@triton.jit
def magic_pair(w, A: tl.constexpr, DT: tl.constexpr):
    """Nibbles A and A+4 (A < 4) of each word as 1 + q/16 in DT. For 16-bit DT both come from
    one shift and one AND/OR of the word (they sit 16 bits apart): the two halves of a register."""
    if DT == tl.float32:
        lo = ((_shift(w, 19 - 4 * A) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        hi = ((_shift(w, 3 - 4 * A) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
        return lo, hi
    else:
        if DT == tl.float16:
            p = (_shift(w, 6 - 4 * A) & 0x3C003C0) | 0x3C003C00
        else:
            p = (_shift(w, 3 - 4 * A) & 0x780078) | 0x3F803F80
        p = p.to(tl.uint32, bitcast=True)
        lo = p.to(tl.uint16).to(DT, bitcast=True)
        hi = (p >> 16).to(tl.uint16).to(DT, bitcast=True)
        return lo, hi


@triton.jit
def _load_or_zero(ptrs, mask):
    """tl.load, with the masked-off elements 0 (mask None: every element)."""
    if mask is None:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def x_pairs(x_ptr, k, offs_w, mask=None):
    """The chunk's bf16 x (from k) as packed pairs per word column j: p_a = (x_8j+a low,
    x_8j+a+4 high), a = 0..3, the order of a word's nibbles a and a+4 (16 bits apart).
    x_ptr may be one pointer or a tensor of them (a row per element). mask: word columns to
    read (the others are 0)."""
    xi = x_ptr.to(tl.pointer_type(tl.uint32)) + k // 2 + 4 * offs_w
    xa, xb = _load_or_zero(xi, mask), _load_or_zero(xi + 1, mask)
    xc, xd = _load_or_zero(xi + 2, mask), _load_or_zero(xi + 3, mask)
    return ((xa & 0xFFFF) | (xc << 16), (xa >> 16) | (xc & 0xFFFF0000),
            (xb & 0xFFFF) | (xd << 16), (xb >> 16) | (xd & 0xFFFF0000))


@triton.jit
def x_pairs_prmt(x_ptr, k, offs_w, mask=None):
    """x_pairs from two 64-bit loads per word column and one PRMT per pair (sm_90 PTX): half
    the loads and instructions of the 32-bit loads and masks."""
    xi = x_ptr.to(tl.pointer_type(tl.uint64)) + k // 4 + 2 * offs_w
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b, c, d;
        mov.b64 {a, b}, $4;
        mov.b64 {c, d}, $5;
        prmt.b32 $0, a, c, 0x5410;
        prmt.b32 $1, a, c, 0x7632;
        prmt.b32 $2, b, d, 0x5410;
        prmt.b32 $3, b, d, 0x7632;
        }""",
        constraints="=r,=r,=r,=r,l,l",
        args=[_load_or_zero(xi, mask), _load_or_zero(xi + 1, mask)],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)


@triton.jit
def unpack_natural(w, DT: tl.constexpr):
    """int32 words [R, W] -> [R, 8W] values 1 + q/16 in DT in k order (column 8j + i is nibble
    i of word j): three rounds of interleaving, column bits (t, u, v) = nibble 4t + 2u + v."""
    l0, h0 = magic_pair(w, 0, DT)
    l1, h1 = magic_pair(w, 1, DT)
    l2, h2 = magic_pair(w, 2, DT)
    l3, h3 = magic_pair(w, 3, DT)
    a0 = tl.interleave(l0, h0)
    a1 = tl.interleave(l1, h1)
    a2 = tl.interleave(l2, h2)
    a3 = tl.interleave(l3, h3)
    return tl.interleave(tl.interleave(a0, a2), tl.interleave(a1, a3))


@triton.jit
def unpack_paired(w, DT: tl.constexpr):
    """Like unpack_natural, but column 8j + o holds nibble o // 2 + 4 (o % 2) of word j: each
    register's two halves (nibbles a, a+4) stay side by side, so nothing is re-packed. The
    caller reads x in the same order."""
    l0, h0 = magic_pair(w, 0, DT)
    l1, h1 = magic_pair(w, 1, DT)
    l2, h2 = magic_pair(w, 2, DT)
    l3, h3 = magic_pair(w, 3, DT)
    lo = tl.interleave(tl.interleave(l0, l2), tl.interleave(l1, l3))
    hi = tl.interleave(tl.interleave(h0, h2), tl.interleave(h1, h3))
    return tl.interleave(lo, hi)


@triton.jit
def dequant_tile(q, s, z, DT: tl.constexpr, FLOAT_ZERO: tl.constexpr = False):
    """int32 words [R, W] with the rows' scale s and zero z (float32 [R], one group) -> [R, 8W]
    (q - z) * s in DT, k order. (v - (1 + z/16)) = (q - z)/16 is exact in DT; 16 s is split in
    two DT parts so that a bf16 result is rounded once, not once for s and once for the product.
    FLOAT_ZERO (z is the zero point times the scale): q s - z in float32 (q s is exact there),
    rounded once to DT."""
    if FLOAT_ZERO:
        v = unpack_natural(q, tl.float32) - 1.0
        return (v * (16.0 * s)[:, None] - z[:, None]).to(DT)
    d = unpack_natural(q, DT) - (1.0 + 0.0625 * z).to(DT)[:, None]
    s_hi = (16.0 * s).to(DT)
    s_lo = (16.0 * s - s_hi.to(tl.float32)).to(DT)
    return tl.fma(d, s_hi[:, None], d * s_lo[:, None])


@triton.jit
def float_zero_split(z, s, FLOAT_ZERO: tl.constexpr):
    """(the integer zero the packed products subtract, the float32 coefficient of sum(x)) for a
    chunk's zeros z and float32 scales s: uint8 zeros (z, 0); float zeros zs (8, 8 s - zs), as
    w = q s - zs = (q - 8) s + (8 s - zs): the products stay centred like an integer zero's
    (their packed-bf16 sums stay small), and 8 s - zs is rounded at most once, in float32."""
    if FLOAT_ZERO:
        return tl.full(z.shape, 8, tl.uint8), 8.0 * s - z.to(tl.float32)
    else:
        return z, 0.0


@triton.jit
def pair_sum(p):
    """The two bf16 values of a packed x pair (x_pairs) added in float32."""
    p = p.to(tl.uint32, bitcast=True)
    return (p << 16).to(tl.float32, bitcast=True) + (p & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def pairs_sum(p0, p1, p2, p3):
    """sum of the eight x values of a word column from its four pairs (x_pairs), float32."""
    return (pair_sum(p0) + pair_sum(p1)) + (pair_sum(p2) + pair_sum(p3))


def packed_words(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, k: int) -> torch.Tensor:
    """qweight uint8 [N, K/2] viewed as int32 [N, K/8], after checking the layout's shapes."""
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] * 2 != k:
        raise ValueError(f"int4 kernels: qweight must be uint8 [N, K/2] = [{n}, {k // 2}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    if not kernel_shape_ok(k, group_size):
        raise ValueError(f"int4 kernels: the group size ({group_size}) and K ({k}) must be "
                         f"multiples of 16")
    want = (n, qu.int4_groups(k, group_size))
    if (tuple(scales.shape) != want or tuple(zeros.shape) != want
            or not (zeros.dtype == torch.uint8 or zeros.is_floating_point())):
        raise ValueError(f"int4 kernels: scales and zeros (uint8, or float: the zero point "
                         f"times the scale) must be {want}, got {tuple(scales.shape)} / "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    if qweight.stride(1) != 1 or qweight.stride(0) % 4 or qweight.storage_offset() % 4:
        qweight = qweight.contiguous()
    return qweight.view(torch.int32)


def float_zeros(zeros: torch.Tensor) -> bool:
    """Whether zeros are the float form (the zero point times the scale, w = q s - zs)."""
    return zeros.is_floating_point()


def kernel_shape_ok(k: int, group_size: int) -> bool:
    """Whether the Triton kernels take K and the group size: chunks of at least 16 k (a word
    pair per row for the products, one tensor-core K step), each in one group."""
    return k % 16 == 0 and group_size % 16 == 0 and k > 0


def kernel_chunk(block_k: int, group_size: int, k: int) -> int:
    """The K step of a kernel with tile block_k: within one group (a short last group
    included) and never past K."""
    return math.gcd(block_k, group_size, k)


def row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def w4_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor, group_size: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch twin: dequantize (utils), then F.linear in float32; output in x's dtype.
    Any K and group size (a short last group where G does not divide K); uint8 or float zeros."""
    if qu.int4_groups(x.shape[-1], group_size) != scales.shape[1]:
        raise ValueError(f"w4 reference: {scales.shape[1]} groups of {group_size} do not cover K "
                         f"{x.shape[-1]}")
    w = qu.dequantize_int4_groupwise(qu.unpack_int4_rows(qweight), scales, zeros, torch.float32,
                                     group_size)
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row offsets, column offsets) of program_id(0)'s output tile in the large-M GEMMs:
    GROUP_M row blocks in a row walk the same weight tiles while they are in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@dataclass(frozen=True)
class GemmTileConfig:
    """A dequantizing GEMM's output tile, K step and launch parameters (the int4 and int8
    GEMMs' configs extend it)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8

    KIND = "gemm"  # the label's first words (a class attribute, not a field)

    def label(self) -> str:
        """A short name for logs and benchmark tables."""
        return (f"{self.KIND} {self.block_m}x{self.block_n}x{self.block_k} "
                f"warps {self.num_warps} stages {self.num_stages}")


def large_m_bucket(m: int) -> int:
    """Powers of two from 32 to 4096: the large-M tuners (W4 and W8 GEMMs) share a measured
    choice within a bucket."""
    return min(4096, max(32, 1 << (m - 1).bit_length()))


def measure_best(candidates: list[tuple[object, Callable[..., torch.Tensor]]],
                 args: tuple[torch.Tensor, ...], want: torch.Tensor, fallback: object,
                 label: str) -> object:
    """The fastest candidate `run(*args)` whose result matches `want` (bf16 accuracy relative to
    max|want|); a wrong or failing candidate (a miscompile, a tile that does not fit) is never
    chosen. Timed like the other tuners (kernels/runtime/tuning.py: CUDA graph, L2-sized weight copies).
    `fallback` when none qualifies."""
    want = want.float()
    tol = 2e-2 * want.abs().max().item() + 1e-6
    name = lambda c: c.label() if hasattr(c, "label") else str(c)  # noqa: E731
    arg_sets = weight_copies(args)
    best, best_us = fallback, float("inf")
    for choice, run in candidates:
        try:
            if not torch.allclose(run(*args).float(), want, rtol=2e-2, atol=tol):
                logger.warning("%s: %s gave a wrong result; skipped", label, name(choice))
                continue
            us = graph_time_us(lambda a, run=run: run(*a), arg_sets)
        except Exception as exc:  # e.g. out of shared memory for this tile
            logger.debug("%s: %s failed: %s", label, name(choice), exc)
            continue
        if us < best_us:
            best, best_us = choice, us
    logger.info("%s: %s (%.1f us)", label, name(best), best_us)
    return best
