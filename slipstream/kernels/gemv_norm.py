"""RMSNorm (with the residual add) computed while a decode GEMV loads its input: no norm launch.

In a decoder layer every q/k/v and gate/up projection reads rms_norm(x + residual). For decode
batches (M <= 16) the GEMV kernels take the un-normalised x instead: each program first sums
the squares of its rows over all K columns (a few KB from L2, while its first weight tile is in
flight), then normalises each x tile as it loads it; the programs of the first column tile also
store x + residual, the new residual stream. Same float32 math and roundings as
kernels/reference.fused_add_rms_norm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class NormInput:
    """The GEMV input is rms_norm(x + residual) * weight (residual None: rms_norm(x) * weight);
    residual_out receives x + residual (rounded to x's dtype). Tensors are [M, K] contiguous."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


@triton.jit
def norm_source(x_ptr, r_ptr, offs, mask, HAS_RES: tl.constexpr):
    """x, or x + residual rounded to x's dtype (the new residual stream), at offs."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def row_rstd(x_ptr, r_ptr, offs, cols, K, eps, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms over all K columns of the rows addressed by offs (row offsets + cols, any rank);
    the result keeps a trailing size-1 dim so it broadcasts against x tiles."""
    acc = tl.zeros_like(offs).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s = norm_source(x_ptr, r_ptr, offs + k0, cols + k0 < K, HAS_RES).to(tl.float32)
        acc += s * s
    return tl.rsqrt(tl.sum(acc, axis=-1, keep_dims=True) / K + eps)


@triton.jit
def norm_setup(x_ptr, r_ptr, offs, cols, K, k_hi, eps, pid_n, NORM: tl.constexpr,
               HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    """(rstd, res_hi) for a GEMV program: its rows' 1/rms, and the end of the K range whose new
    residual it stores (its own k_hi in the first column tile, else 0). Unused without NORM."""
    if NORM:
        rstd = row_rstd(x_ptr, r_ptr, offs, cols, K, eps, HAS_RES, BLOCK_K)
        res_hi = tl.where(pid_n == 0, k_hi, 0)
    else:
        rstd = 1.0
        res_hi = 0
    return rstd, res_hi


@triton.jit
def load_normed(x_ptr, r_ptr, nw_ptr, ro_ptr, offs, cols, mask, rstd, store_mask,
                HAS_RES: tl.constexpr):
    """The normalised input tile at offs (columns cols); where store_mask, also store x + residual
    to ro_ptr (one column tile of programs does, so each element is written once)."""
    s = norm_source(x_ptr, r_ptr, offs, mask, HAS_RES)
    if HAS_RES:
        tl.store(ro_ptr + offs, s, mask=store_mask)
    w = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return ((s.to(tl.float32) * rstd) * w).to(s.dtype)


def norm_launch_args(x2: torch.Tensor, norm: NormInput | None) -> tuple[tuple, dict]:
    """(r_ptr, nw_ptr, ro_ptr, eps) and the NORM / HAS_RES constexprs of a GEMV launch; without
    a norm, x stands in for the unread pointers."""
    if norm is None:
        return (x2, x2, x2, 0.0), {}
    res = norm.residual
    if res is None:
        return (x2, norm.weight, x2, norm.eps), {"NORM": True}
    return (res, norm.weight, norm.residual_out, norm.eps), {"NORM": True, "HAS_RES": True}


def prepare_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> NormInput:
    """A NormInput for x [..., K]: the residual as a contiguous [M, K] view and a fresh
    residual_out (new storage: every program reads the old residual while others write)."""
    k = x.shape[-1]
    if residual is None:
        return NormInput(weight, eps)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    res = residual.reshape(-1, k)
    res = res if res.is_contiguous() else res.contiguous()
    return NormInput(weight, eps, res, torch.empty(res.shape, dtype=x.dtype, device=x.device))


def check_norm(x2: torch.Tensor, norm: NormInput | None) -> NormInput | None:
    """Validate a NormInput against the GEMV's x [M, K] (which must then be contiguous)."""
    if norm is None:
        return None
    if not x2.is_contiguous():
        raise ValueError("a normed GEMV input must be contiguous")
    if norm.weight.shape != (x2.shape[1],):
        raise ValueError(f"norm weight {tuple(norm.weight.shape)} does not match K={x2.shape[1]}")
    if norm.residual is not None:
        for name, t in (("residual", norm.residual), ("residual_out", norm.residual_out)):
            if t is None or t.shape != x2.shape or not t.is_contiguous() or t.dtype != x2.dtype:
                raise ValueError(f"norm.{name} must be a contiguous {tuple(x2.shape)} "
                                 f"{x2.dtype} tensor (see prepare_norm)")
    return norm

