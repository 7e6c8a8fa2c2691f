"""Triton gated-MLP activations: SiLU(gate) * up, and gelu_tanh(gate) * up (Gemma's GeGLU),
from the fused gate/up projection output.

Same semantics as kernels/reference.py's silu_and_mul and gelu_tanh_and_mul: x = [gate | up] on
the last dim, float32 math, result in the input dtype. One pass: each element of x is read once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr,
                        GELU_TANH: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        # sigmoid(+-40) is 1 / 4e-18 already: the clamp only keeps exp from overflowing
        y = gate * tl.sigmoid(tl.minimum(tl.maximum(2.0 * z, -40.0), 40.0)) * up
    else:
        y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> gelu(gate, approximate="tanh") * up."""
    return _act_and_mul(x, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], n_cols), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    if x2.shape[0] == 0 or n_cols == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(n_cols))
    grid = (x2.shape[0], triton.cdiv(n_cols, block))
    _act_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), n_cols, BLOCK=block, GELU_TANH=gelu_tanh,
        num_warps=4,
    )
    return out
