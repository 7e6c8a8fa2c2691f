"""Triton W4A16 GEMM for prefill and large batches: out = x @ ((q - zero) * scale)^T (+ bias),
or with float zeros (the zero point times the scale) x @ (q * scale - zero)^T.

Each [BLOCK_N, BLOCK_K] weight tile (one group along K) is unpacked and dequantized in registers
and fed to tl.dot with x's tile (float32 accumulation). w4_linear_large measures, once per shape,
these tiles against dequantizing the whole weight to x's dtype and calling cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slipstream.kernels.gemv.int4_common import (
    GemmTileConfig,
    dequant_tile,
    float_zeros,
    grouped_tile,
    kernel_chunk,
    large_m_bucket,
    measure_best,
    packed_words,
    row_major,
    w4_linear_reference,
)
from slipstream.kernels.runtime import tuning_cache
from slipstream.quantization import utils as qu


@triton.jit
def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
                    stride_wn, stride_sn, stride_zn, stride_om, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                    FLOAT_ZERO: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] output tile; K steps of BLOCK_K (a divisor of GROUP, so each
    step has one scale and zero per row), the weight tile dequantized in x's dtype."""
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past the end re-read the last one
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):  # BLOCK_K divides K and GROUP (kernel_chunk): no masks
        x = tl.load(x_ptrs + k)
        q = tl.load(w_ptrs + tl.multiple_of(k // 8, BLOCK_K // 8))
        g = k // GROUP
        s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)
        z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)
        w = dequant_tile(q, s, z, x.dtype, FLOAT_ZERO)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, stride_wn, stride_sn, stride_zn,
                       stride_on, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, FLOAT_ZERO: tl.constexpr = False):
    """out[N, K] = (q - z) * s (FLOAT_ZERO: q * s - z) in out's dtype, one [BLOCK_N, BLOCK_K]
    tile (one group) each."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    q = tl.load(w_ptr + rows[:, None] * stride_wn + k // 8 + tl.arange(0, BLOCK_K // 8)[None, :])
    s = tl.load(s_ptr + rows * stride_sn + k // GROUP).to(tl.float32)
    z = tl.load(z_ptr + rows * stride_zn + k // GROUP).to(tl.float32)
    w = dequant_tile(q, s, z, out_ptr.dtype.element_ty, FLOAT_ZERO)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + k
             + tl.arange(0, BLOCK_K)[None, :], w, mask=offs_n[:, None] < N)


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, dtype: torch.dtype, kernel: bool | None = None) -> torch.Tensor:
    """The [N, K] weight (q - zero) * scale in dtype: one Triton pass (reads the packed bytes,
    writes dtype; kernel None: on CUDA), else utils.dequantize_int4_groupwise."""
    if not (qweight.is_cuda if kernel is None else kernel):
        return qu.dequantize_int4_groupwise(qu.unpack_int4_rows(qweight), scales, zeros, dtype,
                                            group_size)
    k = qweight.shape[1] * 2
    words = packed_words(qweight, scales, zeros, group_size, k)
    scales, zeros = row_major(scales), row_major(zeros)
    n = words.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_k = kernel_chunk(128, group_size, k)
    _w4_dequant_kernel[(triton.cdiv(n, 64), k // block_k)](
        words, scales, zeros, out, n, words.stride(0), scales.stride(0), zeros.stride(0),
        out.stride(0), GROUP=group_size, BLOCK_N=64, BLOCK_K=block_k,
        FLOAT_ZERO=float_zeros(zeros), num_warps=4)
    return out


@dataclass(frozen=True)
class W4GemmConfig(GemmTileConfig):
    """Output tile, K step (gcd with the group size) and launch parameters."""

    KIND = "w4 gemm"


def default_gemm_config(m: int) -> W4GemmConfig:
    return W4GemmConfig(64, 128, 64, 4, 3) if m <= 64 else W4GemmConfig(128, 128, 64, 8, 3)


def candidate_gemm_configs(m: int) -> list[W4GemmConfig]:
    """The few tiles w4_linear_large measures per (M bucket, N, K)."""
    if m <= 64:
        tiles = [(32, 128, 128, 4, 3), (64, 128, 64, 4, 3), (64, 64, 128, 4, 4)]
    else:
        tiles = [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                 (64, 128, 128, 4, 3), (128, 128, 128, 8, 3)]
    return [W4GemmConfig(*t) for t in tiles]


def w4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, bias: torch.Tensor | None = None,
            config: W4GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(qweight)^T (+ bias), any number of rows; output in x's dtype.

    Constraints: K and group_size multiples of 16 (a short last group where the group size
    does not divide K; K itself: one group per row); any M, N.
    """
    k = x.shape[-1]
    n = qweight.shape[0]
    words = packed_words(qweight, scales, zeros, group_size, k)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_gemm_config(m)
    block_k = kernel_chunk(cfg.block_k, group_size, k)  # one group per K step, none past K
    scales, zeros = row_major(scales), row_major(zeros)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _w4_gemm_kernel[grid](
        x2, words, scales, zeros, bias if bias is not None else out, out, m, n, k, x2.stride(0),
        words.stride(0), scales.stride(0), zeros.stride(0), out.stride(0), GROUP=group_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        FLOAT_ZERO=float_zeros(zeros), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], n)


def w4_dequant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, group_size: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize the whole weight to x's dtype (a temporary [N, K]), then cuBLAS."""
    return F.linear(x, w4_dequantize(qweight, scales, zeros, group_size, x.dtype), bias)


CUBLAS = "dequantize+cuBLAS"
FLOAT_ZERO_KIND = "float-zero"  # tuner keys and logs: a layer with float zeros
LARGE_CHOICES: dict[tuple, W4GemmConfig | str] = tuning_cache.register("gemm.int4.large", {})


def w4_linear_large(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Large M on CUDA: the faster of w4_gemm's tiles and dequantize + cuBLAS, measured once per
    (M bucket, N, K, group, dtype); an unmeasured shape during CUDA-graph capture runs w4_gemm."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    bucket = large_m_bucket(m)
    key = (bucket, qweight.shape[0], k, group_size, x.dtype, bias is not None, x.device.index)
    if float_zeros(zeros):  # another kernel variant: measured apart
        key += (FLOAT_ZERO_KIND,)
    choice = LARGE_CHOICES.get(key)
    if choice is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return w4_gemm(x, qweight, scales, zeros, group_size, bias)
        xs = torch.randn((bucket, k), device=x.device, dtype=x.dtype)
        cands = [(c, lambda x_, q_, s_, z_, c=c: w4_gemm(x_, q_, s_, z_, group_size, bias, c))
                 for c in candidate_gemm_configs(bucket)]
        cands.append((CUBLAS, lambda x_, q_, s_, z_: w4_dequant_linear(x_, q_, s_, z_,
                                                                      group_size, bias)))
        want = w4_linear_reference(xs, qweight, scales, zeros, group_size, bias)
        choice = measure_best(cands, (xs, qweight, scales, zeros), want, CUBLAS,
                              f"w4 M<={bucket} N={qweight.shape[0]} K={k}")
        LARGE_CHOICES[key] = choice
    if choice == CUBLAS:
        return w4_dequant_linear(x, qweight, scales, zeros, group_size, bias)
    return w4_gemm(x, qweight, scales, zeros, group_size, bias, choice)
