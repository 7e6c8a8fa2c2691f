"""Rotary position embedding tables: cos/sin per position, default, linear and llama3 scaling.

The table layout is what the kernels read: [max_positions, rotary_dim] float32, cos in the
first half of the last dim and sin in the second (NeoX / HF rotate_half convention).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """Old configs spell it `type`, new ones `rope_type`; None means default."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies after the configured scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(rotary_dim: int, max_positions: int, theta: float,
                        scaling: dict[str, Any] | None) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos(p * f) then sin(p * f) for each frequency f."""
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
    pos = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table (a float32 buffer, never cast to the model dtype)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None):
        super().__init__()
        self.rotary_dim = rotary_dim
        # Built on the CPU so every device gets bit-identical tables, then moved.
        table = build_cos_sin_cache(rotary_dim, max_positions, theta, scaling)
        self.register_buffer("cos_sin_cache", table.to(torch.get_default_device()),
                             persistent=False)
