"""Per-layer sliding windows from HF configs, old spellings and new (models/layer_types.py)."""

from __future__ import annotations

import pytest

from slipstream.config import ModelConfig
from slipstream.models.layer_types import freeable_window, layer_sliding_windows, within

BASE = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2)


def _cfg(**fields) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **fields})


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        (dict(model_type="mistral", sliding_window=4096), [4096] * 4),
        (dict(model_type="mistral", sliding_window=None), [None] * 4),
        # Qwen2's hub configs carry a window they only use with use_sliding_window
        (dict(model_type="qwen2", sliding_window=32768, use_sliding_window=False), [None] * 4),
        (
            dict(model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=2),
            [None, None, 64, 64],
        ),
        (dict(model_type="gemma2", sliding_window=4096), [4096, None, 4096, None]),
        (dict(model_type="gemma3_text", sliding_window=512, sliding_window_pattern=3), [512, 512, None, 512]),
        (
            dict(
                model_type="gemma3_text",
                sliding_window=512,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
            ),
            [None, 512, 512, None],
        ),
    ],
)
def test_layer_sliding_windows(fields, windows):
    assert layer_sliding_windows(_cfg(**fields)) == windows


def test_freeable_window_needs_every_layer_to_slide():
    assert freeable_window(_cfg(model_type="mistral", sliding_window=4096), 32768) == 4096
    assert freeable_window(_cfg(model_type="gemma2", sliding_window=4096), 32768) is None
    # A window at least as long as any sequence hides nothing: full attention.
    assert freeable_window(_cfg(model_type="phi3", sliding_window=262144), 131072) is None
    assert within(262144, 131072) is None and within(2047, 4096) == 2047


def test_layer_types_of_the_wrong_length():
    with pytest.raises(ValueError, match="layer_types has 2 entries for 4 layers"):
        layer_sliding_windows(_cfg(model_type="gemma2", sliding_window=8, layer_types=["full_attention"] * 2))
