"""Random PEFT LoRA adapters for the tiny test checkpoints, saved as PEFT saves them.

`make_adapter(base_dir, out_dir, targets, r, ...)` -> the adapter directory; `peft_model(...)`
-> the transformers model with that adapter applied (the reference for greedy outputs).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import load_hf_model


def make_adapter(base_dir: Path, out_dir: Path, targets: list[str], r: int, alpha: float = 16,
                 use_rslora: bool = False, seed: int = 0, scale: float = 0.5) -> Path:
    """Save an adapter with random A and B (PEFT's default B is zeros: it would change
    nothing) for the model in base_dir; returns out_dir."""
    from peft import LoraConfig, get_peft_model

    model = load_hf_model(base_dir)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                        lora_dropout=0.0, init_lora_weights=False)
    peft = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    peft.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def peft_model(base_dir: Path, adapter_dir: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf_model(base_dir), adapter_dir).eval()
