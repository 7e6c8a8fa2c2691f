"""Dynamic per-token FP8 activation quantization in one launch (twin: quantization.utils.
quantize_per_token). The torch version is seven launches (copy, abs, amax, divide, clamp,
divide, cast) per linear layer, which the eager mixed prefill/decode steps pay in host time.
silu_and_mul_quant_fp8 also computes the gated-MLP activation first (twin: quantize_per_token
of silu_and_mul): the down projection's input is never written in bf16 nor read back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.quantization.utils import FP8_DTYPE, FP8_MAX, TINY

_BLOCK = 1024
_ONE_PASS_MAX = 16384


@triton.jit
def _row_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, QMAX: tl.constexpr,
                    TINY: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                    SILU: tl.constexpr):
    """Per-row FP8 quantization of the row's K values: x itself, or with SILU the row is
    [gate | up] (2K values) and the values are silu(gate) * up rounded to x's dtype, as
    silu_and_mul stores it. A row that fits in registers (BLOCK >= K) is read once; longer
    ones take two passes, the second reloading (from L2) instead of storing anything."""
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        x = _load_row(x_row, offs, K, SILU)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / QMAX, TINY)
        _store_fp8(q_row, offs, K, x, scale, QMAX)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(_load_row(x_row, k0 + tl.arange(0, BLOCK), K, SILU)))
        scale = tl.maximum(tl.max(amax, 0) / QMAX, TINY)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            _store_fp8(q_row, offs, K, _load_row(x_row, offs, K, SILU), scale, QMAX)
    tl.store(s_ptr + row, scale)


@triton.jit
def _load_row(x_row, offs, K, SILU: tl.constexpr):
    """float32 values offs of the row (masked past K)."""
    mask = offs < K
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if SILU:
        up = tl.load(x_row + K + offs, mask=mask, other=0.0)
        g = x.to(tl.float32)
        x = (g * tl.sigmoid(g) * up.to(tl.float32)).to(up.dtype)
    return x.to(tl.float32)


@triton.jit
def _store_fp8(q_row, offs, K, x, scale, QMAX: tl.constexpr):
    y = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
    tl.store(q_row + offs, y.to(q_row.dtype.element_ty), mask=offs < K)


def _quantize_rows(x: torch.Tensor, k: int, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = triton.next_power_of_2(k)
        # 16 warps hold 16K values in registers (32 a thread); longer rows take two passes.
        launch = (dict(BLOCK=block, ONE_PASS=True, num_warps=min(max(block // 512, 1), 16))
                  if block <= _ONE_PASS_MAX else dict(BLOCK=_BLOCK, ONE_PASS=False, num_warps=4))
        _row_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=FP8_MAX, TINY=TINY,
                              SILU=silu, **launch)
    return q, scale


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 E4M3 [M, K], float32 scale [M, 1]) with x ~= q * scale per row."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _quantize_rows(x, x.shape[1], silu=False)


def silu_and_mul_quant_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2N] -> (FP8 E4M3 [M, N], float32 scale [M, 1]) of silu(gate) * up."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    return _quantize_rows(gate_up, gate_up.shape[1] // 2, silu=True)


@triton.jit
def _norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, stride_x, stride_res,
                     stride_q, stride_res_out, n_cols, eps, HAS_RES: tl.constexpr,
                     QMAX: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr):
    """One row: [x + residual (rounded, stored as the new residual)], RMSNorm rounded to x's
    dtype as the norm kernel stores it, then per-row FP8 quantization of that, as
    quantize_per_token_fp8 computes it; the normalised row is never written in 16 bits."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((xf * rstd) * w).to(x.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), 0) / QMAX, TINY)
    q = tl.minimum(tl.maximum(y / scale, -QMAX), QMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [M, K] (+ residual) -> (FP8 E4M3 [M, K], float32 scale [M, 1], new residual or None):
    quantize_per_token of rms_norm(x) (or of fused_add_rms_norm(x, residual)[0]), one launch.
    The new residual goes into residual's storage when it fits, as fused_add_rms_norm does."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res_out = None
    if residual is not None:
        reusable = residual.is_contiguous() and residual.dtype == x.dtype and residual.shape == x.shape
        res_out = residual if reusable else torch.empty_like(x)
    if m and k:
        r = residual if residual is not None else x
        ro = res_out if res_out is not None else x
        block = triton.next_power_of_2(k)
        _norm_fp8_kernel[(m,)](x, r, weight, q, scale, ro, x.stride(0), r.stride(0), q.stride(0),
                               ro.stride(0), k, eps, HAS_RES=residual is not None, QMAX=FP8_MAX,
                               TINY=TINY, BLOCK=block, num_warps=min(max(block // 512, 1), 16))
    return q, scale, res_out
