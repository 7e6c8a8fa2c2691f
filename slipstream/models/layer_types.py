"""Which decoder layers attend through a sliding window, and how wide, from an HF config.

transformers >= 4.5x writes `layer_types` ("sliding_attention" / "full_attention" per layer);
older configs say it with per-family flags (Qwen's use_sliding_window and max_window_layers,
Gemma's alternation pattern), read here the way transformers reads them.
"""

from __future__ import annotations

from slipstream.config import ModelConfig

# Local layers in every `pattern` (the last of each group is global) when layer_types is absent.
_GEMMA_PATTERNS = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6}


def layer_sliding_windows(cfg: ModelConfig) -> list[int | None]:
    """Per decoder layer: its window in tokens, or None for full attention."""
    hf, n = cfg.hf_config, cfg.num_hidden_layers
    window = hf.get("sliding_window")
    model_type = str(hf.get("model_type", ""))
    if model_type.startswith("qwen") and not hf.get("use_sliding_window", False):
        return [None] * n  # Qwen configs carry a window they do not use unless told to
    if not window:
        return [None] * n
    types = hf.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return [window if t == "sliding_attention" else None for t in types]
    if model_type.startswith("qwen"):
        first = int(hf.get("max_window_layers", 0))
        return [window if i >= first else None for i in range(n)]
    if model_type in _GEMMA_PATTERNS:
        pattern = int(hf.get("sliding_window_pattern", _GEMMA_PATTERNS[model_type]))
        return [window if (i + 1) % pattern else None for i in range(n)]
    return [window] * n  # Mistral, Phi-3: every layer


def within(window: int | None, max_len: int) -> int | None:
    """The window a layer applies when sequences stay under max_len tokens: None where it
    covers them all (Phi-3-128k's 262144), so no kernel pays for a mask that hides nothing."""
    return window if window and window < max_len else None


def freeable_window(cfg: ModelConfig, max_len: int) -> int | None:
    """The window the KV manager may free blocks behind: the widest one when every layer has a
    window (a block outside it is outside all of them); None when any layer attends fully."""
    windows = [within(w, max_len) for w in layer_sliding_windows(cfg)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
