"""Known model shapes for benchmarks: a name -> the checkpoint's Hugging Face config.json.

`materialize_shape` writes a directory holding only config.json, which the engine loads with
`load_format="dummy"` (random weights of the right shape); speed does not depend on the values.
"""
from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

_LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

_QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# 141 GB in bf16: one H200 runs it with a load-time 8-bit method (quantized layer by layer).
_LLAMA_3_1_70B: dict[str, Any] = {**_LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672,
                                  "num_hidden_layers": 80, "num_attention_heads": 64}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.1-70b": _LLAMA_3_1_70B,
    "qwen3-0.6b": _QWEN3_0_6B,
}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


def shape_config(name: str) -> dict[str, Any]:
    """A fresh copy of the config dict of a known shape (KeyError lists the known names)."""
    key = name.lower()
    if key not in SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    return copy.deepcopy(SHAPES[key])


def is_shape_name(name: str | None) -> bool:
    return name is not None and name.lower() in SHAPES


def materialize_shape(name: str, root: str | Path | None = None) -> Path:
    """Write `<dir>/config.json` for a known shape; returns the directory (a temp dir by default)."""
    cfg = shape_config(name)
    out = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix=f"slipstream-{name}-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def resolve_model(model: str | None) -> tuple[str | None, str]:
    """`--model` value -> (model directory or None for the default, shape label for reports)."""
    if is_shape_name(model):
        return str(materialize_shape(model)), model.lower()
    if model is None:
        return None, "default"
    return model, Path(model).name or model


def load_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def count_parameters(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) from its config."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = _head_dim(cfg)
    model_type = cfg.get("model_type", "")
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if cfg.get("attention_bias", model_type == "qwen2"):
        attn += q_out + 2 * kv_out
    if model_type == "qwen3":
        attn += 2 * head_dim  # q_norm and k_norm weights
    mlp = 3 * hidden * inter
    layer = attn + mlp + 2 * hidden  # two RMSNorms
    embed = vocab * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return embed + lm_head + cfg["num_hidden_layers"] * layer + hidden


def dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


# Bytes per weight of a quantized linear layer (int4: groups of 128 with an fp16 scale and a
# uint8 zero each); per-row scales are left out (4 bytes per row of thousands).
QUANT_WEIGHT_BYTES = {"fp8": 1.0, "int8_wo": 1.0, "w8a8_sq": 1.0, "int4_awq": 0.5 + 3 / 128}


def linear_parameters(cfg: dict[str, Any]) -> int:
    """Weights of the decoder layers' linear projections (what a quant method stores)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    q_out, kv_out = heads * _head_dim(cfg), kv_heads * _head_dim(cfg)
    per_layer = 2 * hidden * q_out + 2 * hidden * kv_out + 3 * hidden * inter
    return cfg["num_hidden_layers"] * per_layer


def weight_bytes(cfg: dict[str, Any], dtype: str, quantization: str | None = None,
                 quantized_lm_head: bool = False) -> int:
    """Bytes a decode step streams for the weights: every parameter once (the convention of
    BENCHMARKS.md's speed-of-light figure, embedding table included), the linear layers at their
    quantization method's bytes per weight, a quantized LM head at one byte (its own copy when
    tied to the embedding)."""
    size = dtype_bytes(dtype)
    total = count_parameters(cfg) * size
    per_weight = QUANT_WEIGHT_BYTES.get(quantization or "")
    if per_weight is not None:
        total -= linear_parameters(cfg) * (size - per_weight)
    if quantized_lm_head:
        head = cfg["vocab_size"] * cfg["hidden_size"]
        total += head if cfg.get("tie_word_embeddings", False) else -head * (size - 1)
    return int(total)


def kv_bytes_per_token(cfg: dict[str, Any], dtype: str) -> int:
    """K and V bytes of one token over all layers."""
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * _head_dim(cfg) * dtype_bytes(dtype)
