"""Model sizes from a Llama-family config.json: parameter counts and the bytes the weights and
the KV cache take, per dtype and quantization method (the benchmarks' speed-of-light bounds and
the loader's out-of-memory message)."""
from __future__ import annotations

from typing import Any

from slipstream.models.moe_config import (
    expected_experts_hit,
    expert_intermediate_size,
    is_sparse_layer,
    num_experts_of,
)

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def count_parameters(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) from its config."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = _head_dim(cfg)
    model_type = cfg.get("model_type", "")
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe")):
        attn += q_out + 2 * kv_out
    if model_type in ("qwen3", "qwen3_moe"):
        attn += 2 * head_dim  # q_norm and k_norm weights
    layers = cfg["num_hidden_layers"] * (attn + 2 * hidden)  # two RMSNorms a layer
    layers += sum(_mlp_parameters(cfg, i) + _router_parameters(cfg, i)
                  for i in range(cfg["num_hidden_layers"]))
    embed = vocab * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return embed + lm_head + layers + hidden


def _mlp_parameters(cfg: dict[str, Any], index: int, experts: float | None = None) -> int:
    """Linear weights of decoder layer `index`'s MLP: dense, or an MoE layer's experts (all of
    them, or `experts` of them) plus its shared expert."""
    hidden = cfg["hidden_size"]
    if not is_sparse_layer(cfg, index):
        return 3 * hidden * cfg["intermediate_size"]
    count = num_experts_of(cfg) if experts is None else experts
    shared = cfg.get("shared_expert_intermediate_size") or 0
    return round(count * 3 * hidden * expert_intermediate_size(cfg)) + 3 * hidden * shared


def _router_parameters(cfg: dict[str, Any], index: int) -> int:
    """An MoE layer's router (and shared-expert gate): kept unquantized."""
    if not is_sparse_layer(cfg, index):
        return 0
    shared_gate = 1 if cfg.get("shared_expert_intermediate_size") else 0
    return (num_experts_of(cfg) + shared_gate) * cfg["hidden_size"]


def inactive_expert_parameters(cfg: dict[str, Any], batch: int) -> int:
    """Expert weights a decode step of `batch` tokens does not read (MoE configs; 0 for dense):
    the experts no token is routed to, in expectation under uniform routing."""
    if not num_experts_of(cfg):
        return 0
    hit = expected_experts_hit(cfg, batch)
    return sum(_mlp_parameters(cfg, i) - _mlp_parameters(cfg, i, hit)
               for i in range(cfg["num_hidden_layers"]))


def dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


# Bytes per weight of a quantized linear layer (int4: groups of 128 with an fp16 scale and a
# uint8 zero each); per-row scales are left out (4 bytes per row of thousands).
QUANT_WEIGHT_BYTES = {"fp8": 1.0, "int8_wo": 1.0, "w8a8_sq": 1.0, "int4_awq": 0.5 + 3 / 128}
_HEAD_METHODS = {"fp8": "fp8", "int8_wo": "int8_wo", "int4": "int4_awq"}  # head format -> layout


def linear_parameters(cfg: dict[str, Any]) -> int:
    """Weights of the decoder layers' linear projections (what a quant method stores)."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    q_out, kv_out = heads * _head_dim(cfg), kv_heads * _head_dim(cfg)
    attn = 2 * hidden * q_out + 2 * hidden * kv_out
    return sum(attn + _mlp_parameters(cfg, i) for i in range(cfg["num_hidden_layers"]))


def weight_bytes(cfg: dict[str, Any], dtype: str, quantization: str | None = None,
                 quantized_lm_head: bool | str | None = False,
                 decode_batch: int | None = None) -> int:
    """Bytes a decode step streams for the weights: every parameter once (the convention of
    BENCHMARKS.md's speed-of-light figure, embedding table included), the linear layers at their
    quantization method's bytes per weight, a quantized LM head at its format's (True: one byte;
    quantization/lm_head.py), its own copy when tied to the embedding. decode_batch: an MoE
    model's step of that many tokens reads only the experts they are routed to
    (inactive_expert_parameters are left out); None: every expert (the memory they take)."""
    size = dtype_bytes(dtype)
    total = count_parameters(cfg) * size
    per_weight = QUANT_WEIGHT_BYTES.get(quantization or "")
    if per_weight is not None:
        total -= linear_parameters(cfg) * (size - per_weight)
    if decode_batch is not None:
        total -= inactive_expert_parameters(cfg, decode_batch) * (per_weight or size)
    if quantized_lm_head:
        head = cfg["vocab_size"] * cfg["hidden_size"]
        # a head format's bytes are its method's (quantization/lm_head.py); True: one byte
        per_head = QUANT_WEIGHT_BYTES.get(_HEAD_METHODS.get(quantized_lm_head), 1.0)
        total += head * per_head if cfg.get("tie_word_embeddings", False) else \
            -head * (size - per_head)
    return int(total)


def kv_bytes_per_token(cfg: dict[str, Any], dtype: str) -> int:
    """K and V bytes of one token over all layers."""
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * _head_dim(cfg) * dtype_bytes(dtype)
