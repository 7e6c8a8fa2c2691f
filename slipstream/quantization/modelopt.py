"""NVIDIA ModelOpt checkpoints (what TensorRT-LLM users arrive with, e.g.
nvidia/Llama-3.1-8B-Instruct-FP8), read into slipstream's methods: FP8 only.

ModelOpt FP8 stores each linear layer as `weight` (FP8 E4M3), a per-tensor `weight_scale` and a
static per-tensor `input_scale` (FP8_PER_CHANNEL_PER_TOKEN: a per-channel `weight_scale`, no
input scale), and, with an FP8 KV cache, `k_proj.k_scale` / `v_proj.v_scale`.
The settings sit in config.json's `quantization_config` (`quant_method: modelopt`, then either
flat: `quant_algo`, `kv_cache_quant_algo`, `ignore`; or older: a nested `quantization` dict with
`exclude_modules`), or, in older exports, only in `hf_quant_config.json` beside it.
"""
from __future__ import annotations

import json
from pathlib import Path

QUANT_METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"
# ModelOpt's quant_algo -> the slipstream method that loads it.
_ALGOS = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8"}
_KV_ALGOS = {"FP8": "fp8", "INT8": "int8"}


def is_modelopt(qc: dict) -> bool:
    return str(qc.get("quant_method", "")).lower() == QUANT_METHOD


def with_hf_quant_config(cfg: dict, model_dir: str | Path) -> dict:
    """config.json's dict, given a `quantization_config` from hf_quant_config.json when it has
    none (older ModelOpt exports write the settings only there)."""
    path = Path(model_dir) / HF_QUANT_CONFIG
    if cfg.get("quantization_config") or not path.is_file():
        return cfg
    settings = json.loads(path.read_text())
    quantization = settings.get("quantization") if isinstance(settings, dict) else None
    if not isinstance(quantization, dict):
        raise ValueError(f"{path}: expected a 'quantization' object, got {settings!r:.200}")
    return {**cfg, "quantization_config": {"quant_method": QUANT_METHOD, **quantization}}


def _settings(qc: dict) -> dict:
    nested = qc.get("quantization")
    return nested if isinstance(nested, dict) else qc


def quant_algo(qc: dict) -> str:
    return str(_settings(qc).get("quant_algo") or "").upper()


def checkpoint_method(qc: dict) -> str:
    """The slipstream method that loads this ModelOpt checkpoint; a clear error for the others."""
    algo = quant_algo(qc)
    if algo not in _ALGOS:
        raise ValueError(f"ModelOpt checkpoint with quant_algo={algo or None!r} is not supported; "
                         f"supported: {', '.join(_ALGOS)} (for 4-bit weights use an AWQ / GPTQ "
                         "checkpoint or `slipstream quantize --method int4_awq`)")
    return _ALGOS[algo]


def static_input_scale(qc: dict) -> bool:
    """Whether each layer stores an input_scale (per-tensor FP8; per-token FP8 has none)."""
    return quant_algo(qc) == "FP8"


def excluded_modules(qc: dict) -> tuple[str, ...]:
    """Modules the checkpoint left unquantized (`ignore`, or `exclude_modules` in the nested
    form); entries may hold `*` wildcards."""
    settings = _settings(qc)
    listed = settings.get("ignore", settings.get("exclude_modules")) or []
    if isinstance(listed, str) or not all(isinstance(n, str) for n in listed):
        raise ValueError(f"ModelOpt ignore / exclude_modules must be a list of module names, "
                         f"got {listed!r}")
    return tuple(listed)


def kv_cache_dtype(qc: dict) -> str | None:
    """The KV-cache dtype the checkpoint's scales were calibrated for (None: none)."""
    algo = _settings(qc).get("kv_cache_quant_algo")
    return _KV_ALGOS.get(str(algo).upper()) if algo else None
