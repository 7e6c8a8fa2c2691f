"""What a mixture-of-experts config.json says, in plain Python (no torch): shared by the model
(models/moe.py) and the size arithmetic (models/sizes.py)."""
from __future__ import annotations

from typing import Any


def num_experts_of(cfg: dict[str, Any]) -> int:
    """Mixtral: num_local_experts; Qwen: num_experts (transformers 5 writes either); 0: dense."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def expert_intermediate_size(cfg: dict[str, Any]) -> int:
    """Qwen: moe_intermediate_size (intermediate_size is the dense layers'); Mixtral: the one."""
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])


def renormalizes(cfg: dict[str, Any]) -> bool:
    """Whether the top-k routing weights are rescaled to sum to 1: Mixtral always, Qwen-MoE
    when norm_topk_prob is set (Qwen3-MoE checkpoints set it, Qwen1.5/2-MoE do not)."""
    if cfg.get("model_type") == "mixtral":
        return True
    return bool(cfg.get("norm_topk_prob", False))


def is_sparse_layer(cfg: dict[str, Any], index: int) -> bool:
    """Qwen-MoE's rule for which decoder layers hold experts (Mixtral: every one)."""
    if index in (cfg.get("mlp_only_layers") or []):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return num_experts_of(cfg) > 0 and (index + 1) % step == 0


def expected_experts_hit(cfg: dict[str, Any], batch: int) -> float:
    """Mean number of distinct experts a layer reads for `batch` tokens routed uniformly at
    random (k of E each): E * (1 - (1 - k/E)^batch); k at batch 1."""
    experts, top_k = num_experts_of(cfg), int(cfg.get("num_experts_per_tok") or 0)
    if not experts:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** max(batch, 1))
