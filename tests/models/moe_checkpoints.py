"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) saved with save_pretrained.

Kept apart from tests/helpers.py: the dense families' factory grows there in parallel.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers import TINY_DEFAULTS, _fresh_dir

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# Enough experts and k that several experts get no token in a short prompt, and the routing
# weights are far from uniform (large init) so a wrong normalisation changes the logits.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": dict(num_local_experts=6, num_experts_per_tok=2),
    "Qwen2MoeForCausalLM": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
                                shared_expert_intermediate_size=80, norm_topk_prob=False,
                                mlp_only_layers=[1]),
    "Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                norm_topk_prob=True),
}


def tiny_moe_config(arch: str, **overrides: Any):
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    kwargs = {**TINY_DEFAULTS, "head_dim": 16, **_MOE_DEFAULTS[arch], **overrides}
    if arch == "MixtralForCausalLM":
        kwargs.setdefault("sliding_window", None)
    config = config_cls(**kwargs)
    config.architectures = [arch]
    return config


@torch.no_grad()
def make_tiny_moe_checkpoint(tmp_path: Path, arch: str, **overrides: Any) -> Path:
    """A random tiny `arch` model (float32) saved under tmp_path; norm weights and biases are
    randomised as in tests/helpers.make_tiny_checkpoint."""
    import transformers

    seed = overrides.pop("seed", 0)
    config = tiny_moe_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    out = _fresh_dir(Path(tmp_path), f"tiny-{arch}")
    model.save_pretrained(out, safe_serialization=True)
    return out
