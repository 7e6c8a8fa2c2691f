"""Random speculative heads for tiny targets, written in their published layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def target_shape(target: Path) -> tuple[int, int]:
    cfg = json.loads((target / "config.json").read_text())
    return cfg["hidden_size"], cfg["vocab_size"]


def target_lm_head(target: Path) -> torch.Tensor:
    tensors = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])


def medusa_tensors(target: Path, num_heads: int, num_layers: int, seed: int = 0):
    """Per head: num_layers random residual blocks (small, so each head's argmax is near the
    target's own next-token guess) and the target's LM head as its vocabulary map."""
    hidden, _ = target_shape(target)
    gen = torch.Generator().manual_seed(seed)
    head = target_lm_head(target)
    blocks = [[(0.05 * torch.randn(hidden, hidden, generator=gen),
                0.05 * torch.randn(hidden, generator=gen)) for _ in range(num_layers)]
              for _ in range(num_heads)]
    return blocks, [head.clone() for _ in range(num_heads)]


def write_medusa(out: Path, target: Path, num_heads: int = 3, num_layers: int = 1,
                 layout: str = "faster", seed: int = 0) -> Path:
    """FasterDecoding's layout (`medusa_lm_head.safetensors`, `{i}.{j}.linear.*`, `{i}.{L}.weight`)
    or vLLM's (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`)."""
    blocks, heads = medusa_tensors(target, num_heads, num_layers, seed)
    tensors = {}
    for i, (head_blocks, head) in enumerate(zip(blocks, heads)):
        for j, (w, b) in enumerate(head_blocks):
            if layout == "faster":
                tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"] = w, b
            else:
                tensors[f"blocks.{i}.layers.{j}.weight"] = w
                tensors[f"blocks.{i}.layers.{j}.bias"] = b
        tensors[f"{i}.{num_layers}.weight" if layout == "faster" else f"lm_heads.{i}.weight"] = head
    out.mkdir(parents=True, exist_ok=True)
    name = "medusa_lm_head.safetensors" if layout == "faster" else "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name))
    hidden, vocab = target_shape(target)
    config = ({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
               "base_model_name_or_path": str(target)} if layout == "faster" else
              {"architectures": ["MedusaModel"], "num_heads": num_heads,
               "num_hidden_layers": num_layers, "hidden_size": hidden, "vocab_size": vocab})
    (out / "config.json").write_text(json.dumps(config))
    return out
