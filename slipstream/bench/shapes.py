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

from slipstream.models.sizes import (  # noqa: F401 (re-exported: the benchmarks' size arithmetic)
    QUANT_WEIGHT_BYTES,
    count_parameters,
    dtype_bytes,
    kv_bytes_per_token,
    linear_parameters,
    weight_bytes,
)

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

# The default model's architecture (SmolLM2-135M-Instruct), for GPU runs where its GGUF file
# cannot travel: random weights of the same shapes run the same kernels.
_SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49152,
}

# Mixture of experts: 46.7B parameters (12.9B active, 2 of 8 experts); about 47 GB in fp8.
_MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

# 30.5B parameters (3.3B active, 8 of 128 experts a layer); about 61 GB in bf16.
_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.1-70b": _LLAMA_3_1_70B,
    "qwen3-0.6b": _QWEN3_0_6B,
    "smollm2-135m": _SMOLLM2_135M,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
}



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
    if model is None:  # the engine's default model (SmolLM2 GGUF, else the embedded one)
        from slipstream.assets.smollm2 import default_model

        return str(default_model()), "default"
    return model, Path(model).name or model


def load_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json; a GGUF file (or a directory holding one): its metadata as
    the config.json it stands for."""
    from slipstream.models.gguf import gguf_hf_config, is_gguf_file, resolve_model_path

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        resolved = resolve_model_path(str(path))
        if is_gguf_file(resolved):
            return gguf_hf_config(resolved)
    return json.loads((path / "config.json").read_text())
