"""RoPE tables (layers/rotary.py) against transformers' own frequency functions, row by row.

yarn: every position. longrope: positions inside the original context against transformers'
short factors, later ones against its long factors (what it uses for a sequence that long).
dynamic: inside the original context the plain frequencies, later ones the NTK base for a
sequence of the table's length.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.layers.rotary import build_cos_sin_cache

DIM, THETA, MAX_POS, ORIG = 16, 10000.0, 256, 64


def _hf(kind: str, params: dict, seq_len: int | None, max_pos: int = MAX_POS):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=DIM, max_position_embeddings=max_pos)
    config.rope_parameters = {"rope_type": kind, "rope_theta": THETA, **params}
    if kind == "default":
        inv_freq, attention = 1.0 / THETA ** (torch.arange(0, DIM, 2).float() / DIM), 1.0
    else:
        inv_freq, attention = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    freqs = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": ORIG},
        {
            "factor": 8.0,
            "original_max_position_embeddings": ORIG,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_yarn(params):
    ours = build_cos_sin_cache(DIM, MAX_POS, THETA, {"rope_type": "yarn", **params}, MAX_POS)
    torch.testing.assert_close(ours, _hf("yarn", params, None), atol=1e-5, rtol=1e-5)


def test_longrope_short_then_long():
    params = {
        "short_factor": [1.0 + 0.1 * i for i in range(DIM // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(DIM // 2)],
        "original_max_position_embeddings": ORIG,
    }
    ours = build_cos_sin_cache(DIM, MAX_POS, THETA, {"rope_type": "longrope", **params}, MAX_POS)
    short, long = _hf("longrope", params, ORIG), _hf("longrope", params, ORIG + 1)
    assert not torch.allclose(short, long)
    torch.testing.assert_close(ours[:ORIG], short[:ORIG], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[ORIG:], long[ORIG:], atol=1e-5, rtol=1e-5)


def test_dynamic_ntk():
    params = {"factor": 2.0}
    ours = build_cos_sin_cache(DIM, MAX_POS, THETA, {"rope_type": "dynamic", **params}, ORIG)
    plain = _hf("default", {}, None)
    ntk = _hf("dynamic", params, MAX_POS, max_pos=ORIG)
    torch.testing.assert_close(ours[:ORIG], plain[:ORIG], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[ORIG:], ntk[ORIG:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[ORIG:], plain[ORIG:])


def test_unknown_type_is_a_value_error():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'su'"):
        build_cos_sin_cache(DIM, 8, THETA, {"rope_type": "su"})


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": ORIG},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
        {"rope_type": "longrope", "short_factor": [1.0] * (DIM // 2),
         "long_factor": [2.0] * (DIM // 2), "original_max_position_embeddings": ORIG},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "freq_factors", "freq_factors": [1.0 + i for i in range(DIM // 2)]},
    ],
    ids=lambda s: (s or {}).get("rope_type", "default"),
)
def test_tables_are_built_on_the_cpu_whatever_the_default_device(scaling):
    """The engine builds models under torch.set_default_device(<the GPU>); every table must still
    be computed on the CPU (bit-identical on every device) or mixed devices fail at start-up."""
    want = build_cos_sin_cache(DIM, MAX_POS, THETA, scaling, ORIG)
    with torch.device("meta"):
        got = build_cos_sin_cache(DIM, MAX_POS, THETA, scaling, ORIG)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, atol=0, rtol=0)


PARTIAL_SCALINGS = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIG},
    "dynamic": {"factor": 4.0, "original_max_position_embeddings": ORIG},
    "longrope": {
        "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.5 * i for i in range(6)],
        "original_max_position_embeddings": ORIG,
    },
}


@pytest.mark.parametrize("kind", list(PARTIAL_SCALINGS))
def test_partial_rotary_tables_follow_transformers(kind):
    """partial_rotary_factor 0.75 of a 16-dim head: every scaling type builds its 6
    frequencies over the 12 rotary dims, as transformers does (rows inside the original
    context, where transformers' choice of frequencies does not depend on the length)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from slipstream.layers.rotary import rotary_dim_of

    params = PARTIAL_SCALINGS[kind]
    hf_params = {"rope_type": kind, "rope_theta": THETA, "partial_rotary_factor": 0.75, **params}
    rotary_dim = rotary_dim_of(DIM, {"rope_parameters": hf_params})
    assert rotary_dim == 12
    scaling = {"rope_type": kind, **params} if kind != "default" else None
    ours = build_cos_sin_cache(rotary_dim, MAX_POS, THETA, scaling, MAX_POS)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=DIM, max_position_embeddings=MAX_POS)
    config.rope_parameters = hf_params
    if kind == "default":  # transformers keeps it in the model class: the plain frequencies
        inv_freq, attention = 1.0 / THETA ** (torch.arange(0, 12, 2).float() / 12), 1.0
    else:
        inv_freq, attention = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=None)
    freqs = torch.arange(32, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    want = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention
    assert ours.shape == (MAX_POS, 12)
    torch.testing.assert_close(ours[:32], want, atol=1e-5, rtol=1e-5)


def test_rotary_dim_of():
    from slipstream.layers.rotary import rotary_dim_of

    assert rotary_dim_of(128, {}) == 128
    assert rotary_dim_of(128, {"partial_rotary_factor": 0.75}) == 96  # Phi-4-mini
    assert rotary_dim_of(128, {"rope_parameters": {"partial_rotary_factor": 0.5}}) == 64
    for bad in (1.5, 0.1, 0.2):  # above 1; 1 dim; 3 dims (odd)
        with pytest.raises(ValueError, match="partial_rotary_factor"):
            rotary_dim_of(16, {"partial_rotary_factor": bad})
