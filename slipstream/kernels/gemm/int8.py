"""Triton W8A16 GEMM for prefill and large batches: out = (x @ q^T) * scale (+ bias), q int8.

Each [BLOCK_N, BLOCK_K] int8 weight tile is converted to x's dtype in registers (exact: every
int8 value is a bf16 / fp16 number) and fed to tl.dot with x's tile, float32 accumulation; the
per-output-channel scale multiplies the accumulator once, at the end. The alternative it replaces
converts the whole weight first (reads one byte and writes two per weight: longer than a
256-token prefill's product) and needs that [N, K] temporary. Twin: the dequantized weight
through F.linear. int8_linear_large measures, once per (M bucket, N, K), these tiles against
convert + cuBLAS and keeps the faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv.dense import counters, reduce_splits
from slipstream.kernels.gemv.int4_common import (
    GemmTileConfig,
    grouped_tile,
    large_m_bucket,
    measure_best,
)
from slipstream.kernels.gemv.int8 import qgemv_reference
from slipstream.kernels.runtime import tuning_cache
from slipstream.quantization.int8_wo import convert_linear


@triton.jit
def _w8_gemm_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                    stride_xm, stride_wn, stride_om, k_per_split, split_k,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DOT_PREC: tl.constexpr, SWAP_AB: tl.constexpr = False,
                    SPLIT: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] output tile over program_id(1)'s share of K (all of it without
    SPLIT; with it the last split to finish adds the float32 partials, gemv.reduce_splits).
    The weight tile's conversion is Triton's own (hand-written PTX byte permutes were no
    faster)."""
    offs_m, offs_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows past the end re-read the last one
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if SPLIT:
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
    else:  # all of K (the unsplit kernel's code is the same as before split-K existed)
        k_lo = 0
        k_hi = K
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # K and k_per_split are multiples of BLOCK_K
            x = tl.load(x_ptrs + k)
            q = tl.load(w_ptrs + k)
        else:
            k_ok = (k + offs_k < k_hi)[None, :]
            x = tl.load(x_ptrs + k, mask=k_ok, other=0.0)
            q = tl.load(w_ptrs + k, mask=k_ok, other=0)
        w = q.to(x.dtype)
        if SWAP_AB:  # out^T = w x^T: the converted tile is the product's register operand
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ws_ptrs = ws_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    acc, done = reduce_splits(acc, ws_ptrs, mask, M * N, cnt_ptr + tl.program_id(0),
                               tl.program_id(1), split_k, SPLIT)
    if done:
        acc = acc * tl.load(s_ptr + rows).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class W8GemmConfig(GemmTileConfig):
    """Output tile, K step and launch parameters."""

    swap_ab: bool = False  # the product as w @ x^T (see _w8_gemm_kernel)
    split_k: int = 1  # programs sharing one output tile's K (at most one per K step)

    KIND = "w8 gemm"

    def label(self) -> str:
        return (super().label() + (" swap" if self.swap_ab else "")
                + (f" split {self.split_k}" if self.split_k > 1 else ""))


def default_gemm_config(m: int) -> W8GemmConfig:
    """The tile for a shape not yet measured (during CUDA-graph capture)."""
    return W8GemmConfig(32, 64, 256, 4, 4) if m <= 64 else W8GemmConfig(128, 128, 64, 4, 4)


def candidate_gemm_configs(m: int) -> list[W8GemmConfig]:
    """The tiles int8_linear_large measures per (M bucket, N, K): the winners of
    `bench_w8_gemm.py --sweep` (Llama-3.1-8B shapes, M 32 / 64 / 256 / 2048)."""
    if m <= 64:  # memory-bound: narrow tiles for more programs; K split where they are few
        tiles = [(16, 64, 256, 4, 4), (32, 64, 256, 4, 4), (32, 256, 128, 8, 3),
                 (64, 64, 256, 4, 3), (64, 128, 128, 4, 4, 8, True),
                 (32, 64, 256, 4, 4, 8, False, 2), (32, 64, 256, 4, 4, 8, False, 4),
                 (64, 128, 128, 4, 4, 8, True, 4)]
    else:
        tiles = [(128, 128, 128, 8, 3, 8, True), (64, 128, 128, 4, 4), (128, 128, 64, 4, 4),
                 (256, 128, 64, 8, 3)]
    return [W8GemmConfig(*t) for t in tiles]


def w8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None = None, config: W8GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scale [N])^T (+ bias), any number of rows; output in
    x's dtype (16-bit or float32)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.shape[1] != k or scale.numel() != n:
        raise ValueError(f"w8_gemm: x [..., {k}], weight {tuple(qweight.shape)}, "
                         f"{scale.numel()} scales: shapes do not match")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_gemm_config(m)
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    k_steps = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(k_steps, max(1, min(cfg.split_k, k_steps))) * block_k
    split = triton.cdiv(k, k_per_split)
    if split > 1 and split * m * n >= 2**31:  # the partials' int32 offsets: no split
        split, k_per_split = 1, k_steps * block_k
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    ws = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    cnt = counters(x.device, tiles) if split > 1 else ws
    _w8_gemm_kernel[(tiles, split)](
        x2, w, scale.reshape(-1), bias if bias is not None else out, out, ws, cnt, m, n, k,
        x2.stride(0), w.stride(0), out.stride(0), k_per_split, split, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        SWAP_AB=cfg.swap_ab, SPLIT=split > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], n)


CUBLAS = "convert+cuBLAS"
_LARGE_CHOICES: dict[tuple, W8GemmConfig | str] = tuning_cache.register("gemm.int8.large", {})


def int8_linear_large(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """M > 16 on CUDA: the faster of w8_gemm's tiles and convert + cuBLAS, measured once per
    (M bucket, N, K, dtype, bias); an unmeasured shape during CUDA-graph capture runs w8_gemm."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    bucket = large_m_bucket(m)
    key = (bucket, qweight.shape[0], k, x.dtype, bias is not None, x.device.index)
    choice = _LARGE_CHOICES.get(key)
    if choice is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return w8_gemm(x, qweight, scale, bias)
        xs = torch.randn((bucket, k), device=x.device, dtype=x.dtype)
        cands = [(c, lambda x_, q_, s_, c=c: w8_gemm(x_, q_, s_, bias, c))
                 for c in candidate_gemm_configs(bucket)]
        cands.append((CUBLAS, lambda x_, q_, s_: convert_linear(x_, q_, s_, bias)))
        want = qgemv_reference(xs, qweight, scale, bias)
        choice = measure_best(cands, (xs, qweight, scale), want, CUBLAS,
                              f"int8 M<={bucket} N={qweight.shape[0]} K={k}")
        _LARGE_CHOICES[key] = choice
    if choice == CUBLAS:
        return convert_linear(x, qweight, scale, bias)
    return w8_gemm(x, qweight, scale, bias, choice)
