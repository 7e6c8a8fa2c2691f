"""Rotary position embedding tables: cos/sin per position; default, linear, llama3, yarn,
longrope and dynamic (NTK) scaling, as transformers computes them, and "freq_factors": each
inverse frequency divided by its own factor, as llama.cpp applies a GGUF file's rope_freqs
tensor (Llama 3.x's long-context RoPE; models/gguf.py).

The table layout is what the kernels read: [max_positions, rotary_dim] float32, cos in the
first half of the last dim and sin in the second (NeoX / HF rotate_half convention). With
partial rotary (`partial_rotary_factor < 1`, Phi-4-mini) rotary_dim is less than head_dim:
every scaling type builds its frequencies over rotary_dim, as transformers does, and the first
rotary_dim dims of each head rotate while the rest pass through (kernels/reference.py
apply_rotary; the Triton kernels rotate whole heads, so such a table takes that path). yarn and
longrope multiply both by their attention factor. transformers switches longrope and dynamic
frequencies by the length of the whole sequence; a paged cache keeps keys rotated, so here the
switch is by position: positions inside the original context use the original frequencies
(equal to transformers while a sequence stays inside it), later ones the long / NTK ones
(dynamic: sized for the table's length).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic",
                        "freq_factors")


def rotary_dim_of(head_dim: int, hf_config: dict[str, Any]) -> int:
    """The dims of each head that RoPE rotates: int(head_dim * partial_rotary_factor), the
    factor top-level or in transformers 5's rope_parameters (1 where neither says)."""
    params = hf_config.get("rope_parameters") or {}
    factor = hf_config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * float(factor))
    if not 0 < float(factor) <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} with head_dim {head_dim} gives "
                         f"{rotary_dim} rotary dims: it must be in (0, 1] and give an even count")
    return rotary_dim


def rope_type(scaling: dict[str, Any] | None) -> str:
    """Old configs spell it `type`, new ones `rope_type`; None means default."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies after default, linear, llama3 or
    freq_factors scaling (the position-independent kinds; build_cos_sin_cache covers the
    others)."""
    inv_freq = 1.0 / (theta ** _exponents(rotary_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "freq_factors":
        return inv_freq / _freq_factors(scaling, inv_freq.numel())
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _freq_factors(s: dict[str, Any], num_freqs: int) -> torch.Tensor:
    factors = torch.tensor(s["freq_factors"], dtype=torch.float32, device="cpu")
    if factors.shape != (num_freqs,) or not bool((factors > 0).all()):
        raise ValueError(f"freq_factors rope scaling needs {num_freqs} positive factors (one "
                         f"per rotary frequency), got {tuple(factors.shape)}")
    return factors


def _exponents(rotary_dim: int) -> torch.Tensor:
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim


def _original_len(s: dict[str, Any], model_max_positions: int | None) -> int:
    orig = s.get("original_max_position_embeddings") or model_max_positions
    if not orig:
        raise ValueError(f"{rope_type(s)} rope scaling needs original_max_position_embeddings")
    return int(orig)


def _factor(s: dict[str, Any], orig: int, model_max_positions: int | None) -> float:
    """The configured factor, else the ratio of the model's context to the original one."""
    if s.get("factor") is not None:
        return float(s["factor"])
    return (model_max_positions or orig) / orig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim: int, theta: float, s: dict[str, Any], model_max_positions: int | None
          ) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (in
    rotations over the original context), and an attention factor."""
    orig = _original_len(s, model_max_positions)
    factor = _factor(s, orig, model_max_positions)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    dims = torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** _exponents(rotary_dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def _longrope_attention(s: dict[str, Any], orig: int, model_max_positions: int | None) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _factor(s, orig, model_max_positions)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, attention: float = 1.0
             ) -> torch.Tensor:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * attention if attention != 1.0 else table


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
                        scaling: dict[str, Any] | None,
                        model_max_positions: int | None = None) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos(p * f) then sin(p * f) for each frequency f.
    model_max_positions: the config's max_position_embeddings (what yarn, longrope and
    dynamic derive their defaults from)."""
    pos = torch.arange(max_positions, dtype=torch.int64, device="cpu")
    kind = rope_type(scaling)
    if kind == "yarn":
        inv_freq, attention = _yarn(rotary_dim, theta, scaling, model_max_positions)
        return _cos_sin(inv_freq, pos, attention)
    if kind == "longrope":
        orig = _original_len(scaling, model_max_positions)
        attention = _longrope_attention(scaling, orig, model_max_positions)
        short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32, device="cpu")
                              * theta ** _exponents(rotary_dim))
                       for k in ("short_factor", "long_factor"))
        return torch.cat([_cos_sin(short, pos[:orig], attention),
                          _cos_sin(long, pos[orig:], attention)])
    if kind == "dynamic":
        orig = int(scaling.get("original_max_position_embeddings") or model_max_positions
                   or max_positions)
        base = inverse_frequencies(rotary_dim, theta, None)
        factor = float(scaling["factor"])
        longest = max(max_positions, orig)
        ntk_theta = theta * ((factor * longest / orig) - (factor - 1)) ** (
            rotary_dim / (rotary_dim - 2))
        return torch.cat([_cos_sin(base, pos[:orig]),
                          _cos_sin(1.0 / (ntk_theta ** _exponents(rotary_dim)), pos[orig:])])
    return _cos_sin(inverse_frequencies(rotary_dim, theta, scaling), pos)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table (a float32 buffer, never cast to the model dtype)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, model_max_positions: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        # Built on the CPU so every device gets bit-identical tables, then moved.
        table = build_cos_sin_cache(rotary_dim, max_positions, theta, scaling,
                                    model_max_positions)
        self.register_buffer("cos_sin_cache", table.to(torch.get_default_device()),
                             persistent=False)
