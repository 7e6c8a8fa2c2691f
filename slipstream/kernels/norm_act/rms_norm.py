"""Triton RMSNorm and residual-add RMSNorm: one program per row, each input read once.

Same semantics as rms_norm / fused_add_rms_norm in kernels/reference.py (float32 math, results in
the input dtype). fused_add_rms_norm writes into the storage of x and residual when it can.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                     BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res,
                         stride_out, stride_res_out, n_cols, eps, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    # Round the sum to the storage dtype before normalising, exactly like the reference.
    s = (x + r).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (sf * rstd) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_params(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    # About 16 elements per thread: enough bytes in flight without spilling.
    num_warps = min(max(block // 512, 1), 16)
    return block, num_warps


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, cols] view with a unit column stride (a copy only when unavoidable)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    x2 = _as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return out
    block, num_warps = _launch_params(x2.shape[1])
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out2, x2.stride(0), out2.stride(0), x2.shape[1], eps,
        BLOCK=block, num_warps=num_warps, **pdl.launch_kwargs(x.device),
    )
    return out


def _reusable(t: torch.Tensor, like: torch.Tensor) -> bool:
    return t.is_contiguous() and t.dtype == like.dtype and t.shape == like.shape


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual).

    Writes the normalised output into x and the new residual into residual when their storage
    fits (contiguous, same dtype and shape); callers must not read x or residual afterwards.
    """
    out = x if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = residual if _reusable(residual, x) else torch.empty_like(out)
    n_cols = x.shape[-1]
    x2, r2 = _as_rows(x), _as_rows(residual)
    out2, ro2 = out.view(-1, n_cols), res_out.view(-1, n_cols)
    if x2.shape[0] == 0:
        return out, res_out
    block, num_warps = _launch_params(n_cols)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, ro2, x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
        n_cols, eps, BLOCK=block, num_warps=num_warps, **pdl.launch_kwargs(x.device),
    )
    return out, res_out
