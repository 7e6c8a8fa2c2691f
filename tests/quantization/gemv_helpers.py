"""Shared pieces of the quantized GEMV tests: int4 weights in int4_awq's stored layout, the
relative error measure and the gate-out check."""
from __future__ import annotations

import torch

from slipstream.kernels.gemv import _COUNTERS
from slipstream.kernels.reference import silu_and_mul
from slipstream.quantization import utils as qu


def quantized(n: int, k: int, group: int, device: str = "cpu", seed: int = 0):
    """(packed uint8 [N, K/2], float16 scales, uint8 zeros) of a random [N, K] weight."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device)
    q, scales, zeros = qu.quantize_int4_groupwise(w, group)
    return qu.pack_int4_rows(q), scales.half(), zeros


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def check_gate_out(got: torch.Tensor, product: torch.Tensor) -> None:
    """A one-row gate-out result equals silu_and_mul of the same config's stored [gate | up]
    product (each operand rounded to bf16 first), and the split-K counters are back at zero."""
    assert got.shape == (1, product.shape[-1] // 2) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), silu_and_mul(product.float()), atol=1e-5, rtol=1e-2)
    for buf in _COUNTERS.values():
        assert int(buf.abs().sum()) == 0


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) per row in float64: the reference input of the in-GEMV RMS norm."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
