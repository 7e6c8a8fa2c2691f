"""Shared pieces of the W4A16 kernel tests: quantized weights in int4_awq's stored layout and
the relative error measure."""
from __future__ import annotations

import torch

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
