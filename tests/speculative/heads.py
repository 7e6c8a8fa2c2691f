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
    blocks = [
        [
            (0.05 * torch.randn(hidden, hidden, generator=gen), 0.05 * torch.randn(hidden, generator=gen))
            for _ in range(num_layers)
        ]
        for _ in range(num_heads)
    ]
    return blocks, [head.clone() for _ in range(num_heads)]


def write_medusa(
    out: Path, target: Path, num_heads: int = 3, num_layers: int = 1, layout: str = "faster", seed: int = 0
) -> Path:
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
    config = (
        {
            "medusa_num_heads": num_heads,
            "medusa_num_layers": num_layers,
            "base_model_name_or_path": str(target),
        }
        if layout == "faster"
        else {
            "architectures": ["MedusaModel"],
            "num_heads": num_heads,
            "num_hidden_layers": num_layers,
            "hidden_size": hidden,
            "vocab_size": vocab,
        }
    )
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_eagle(out: Path, target: Path, eagle3: bool = False, seed: int = 0) -> Path:
    """A random EAGLE (`layers.0.*`, `fc` over [embedding, feature]) or EAGLE-3 head
    (`midlayer.*`, `fc` over three target layers, its own draft vocabulary with `d2t`)."""
    hidden, vocab = target_shape(target)
    heads, kv_heads, head_dim, inter = 4, 2, 16, 128
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: 0.15 * torch.randn(*shape, generator=gen)  # noqa: E731
    p = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * hidden if eagle3 else hidden
    t = {
        p + "self_attn.q_proj.weight": rnd(heads * head_dim, attn_in),
        p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, attn_in),
        p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, attn_in),
        p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": rnd(inter, hidden),
        p + "mlp.up_proj.weight": rnd(inter, hidden),
        p + "mlp.down_proj.weight": rnd(hidden, inter),
        p + "post_attention_layernorm.weight": 1 + rnd(hidden),
    }
    cfg = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "num_hidden_layers": 1,
    }
    if eagle3:
        draft_vocab = vocab // 2  # the even target ids: d2t[i] = i
        t |= {
            "fc.weight": rnd(hidden, 3 * hidden),
            p + "input_layernorm.weight": 1 + rnd(hidden),
            p + "hidden_norm.weight": 1 + rnd(hidden),
            "norm.weight": 1 + rnd(hidden),
            "lm_head.weight": rnd(draft_vocab, hidden),
            "d2t": torch.arange(draft_vocab),
        }
        cfg |= {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft_vocab,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
        }
    else:
        t |= {"fc.weight": rnd(hidden, 2 * hidden), "fc.bias": rnd(hidden)}
        cfg |= {"architectures": ["LlamaForCausalLM"]}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out
