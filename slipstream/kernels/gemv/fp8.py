"""Tensor-core FP8 GEMV for decode: out = x @ (q * scale[:, None])^T (+ bias), M <= 16, q FP8 E4M3.

The FP8 method's activations are FP8 by definition (W8A8). Here each program quantizes its own
[M, BLOCK_K] slices of x to E4M3 with one dynamic scale per token and slice (amax / 448: finer
than the per-token scale of the large-batch path), so no other kernel runs for it, and feeds
weight and activation bytes straight to FP8 tensor-core products (sm_90: QGMMA from shared
memory): the weight is never converted in registers, ~1.2-2 instructions per weight in the main
loop against the dequant GEMV's ~4.75. The weight tile is the product's M side ([BLOCK_N,
BLOCK_K] @ [BLOCK_K, 16]), so the activation tile pads M at most to 16. Split-K and its
in-kernel reduction are those of kernels/gemv/dense.py.

At 2-16 rows it beats the dequant kernels; at one row the activation slice's load -> quantize
-> product chain leaves it slower than the dequant GEMV, so the tuner keeps that one there.
Twin: fp8_dot_gemv_reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention.rotary_cache import round_e4m3
from slipstream.kernels.gemv.dense import GemvConfig, finish, gemv_operands, load_x, split_buffers
from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

E4M3_MAX = 448.0
_E4M3_MAX = tl.constexpr(E4M3_MAX)
BLOCK_M = 16  # activation rows per product: the tensor-core N side


@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_dot_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                         stride_xm, stride_wn, stride_om, k_per_split, split_k,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         GATED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                         STAGES: tl.constexpr = 3, ROUND_IN_FLOAT: tl.constexpr = False):
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N-1: no mask
    offs_m = tl.arange(0, BLOCK_M)
    x_rows = tl.minimum(offs_m, M - 1)  # rows past M repeat row M-1; finish drops them
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    pdl_wait(USE_PDL)
    # x is requested one slice ahead: its quantization sits between the load and the product,
    # so a load issued in the same iteration would stall every step on an L2 round trip.
    x_next = _x_slice(x_ptrs, k_lo, k_hi, offs_k, K, GATED, EVEN_K, BLOCK_K)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=(k + offs_k < k_hi)[None, :], other=0.0)
        x = x_next.to(tl.float32)
        x_next = _x_slice(x_ptrs, k + BLOCK_K, k_hi, offs_k, K, GATED, EVEN_K, BLOCK_K)
        x_scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-30) / _E4M3_MAX  # per row of this slice
        xs = x / x_scale[:, None]
        if ROUND_IN_FLOAT:  # the interpreter's cast mis-rounds at binade edges (see round_e4m3)
            xs = round_e4m3(xs)
        xq = xs.to(tl.float8e4nv)
        acc += tl.dot(w, tl.trans(xq)) * x_scale[None, :]
    scale = tl.load(s_ptr + rows)
    part = tl.trans(acc * scale[:, None])  # [BLOCK_M, BLOCK_N]
    finish(part, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
            stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit
def _x_slice(x_ptrs, k, k_hi, offs_k, K, GATED: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] activation slice at column k of this program's K range (past
    the end, EVEN_K re-reads the last slice and otherwise masks: the prefetch after the last)."""
    if EVEN_K:
        return load_x(x_ptrs + tl.minimum(k, k_hi - BLOCK_K), None, K, GATED, EVEN_K)
    else:
        return load_x(x_ptrs + k, (k + offs_k < k_hi)[None, :], K, GATED, EVEN_K)


def fp8_dot_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, cfg: GemvConfig, gated: bool = False) -> torch.Tensor:
    """x [..., K] (gated: [..., 2K]) @ (qweight [N, K] E4M3 * scale [N, 1])^T (+ bias) for at
    most 16 rows of x, activations quantized per (row, block_k slice); output in x's dtype."""
    if qweight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_dot_gemv: weight dtype {qweight.dtype} is not float8_e4m3fn")
    x2, qweight, m, n, k = gemv_operands(x, qweight, gated)
    scale = scale.float().contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    split, per_split, n_tiles, ws, cnt = split_buffers(cfg, m, n, k, out)
    _fp8_dot_gemv_kernel[(n_tiles, split)](
        x2, qweight, scale, bias if bias is not None else out, out, ws, cnt, m, n, k,
        x2.stride(0), qweight.stride(0), out.stride(0), per_split, split, BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None, GATED=gated, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        ROUND_IN_FLOAT=not x.is_cuda, **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], n)


def fp8_dot_gemv_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None, block_k: int,
                           gated: bool = False) -> torch.Tensor:
    """The oracle: x (gated: silu(gate) * up, rounded to x's dtype) quantized to E4M3 per row
    and block_k slice of K (scale amax / 448), then float32 math on the dequantized operands."""
    k = qweight.shape[1]
    if gated:
        g, u = x.float().split(k, dim=-1)
        x = (g * torch.sigmoid(g) * u).to(x.dtype)
    xf = x.reshape(-1, k).float()
    pad = (-k) % block_k
    chunks = torch.nn.functional.pad(xf, (0, pad)).view(xf.shape[0], -1, block_k)
    x_scale = chunks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    xq = (chunks / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    xd = xq.view(xf.shape[0], -1)[:, :k]
    out = xd @ (qweight.float() * scale.float()[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])
