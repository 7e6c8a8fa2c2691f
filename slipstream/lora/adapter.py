"""Read and check a Hugging Face PEFT LoRA adapter against the model it is meant for.

An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` per
targeted projection: A [r, in], B [out, r]. Modules: q/k/v/o/gate/up/down_proj, or the fused
qkv_proj / gate_up_proj. Every problem (missing file, pickle-only weights, rank above the
engine's limit, a module the model lacks, a shape that does not fit) is a ValueError naming it.

The result is laid out per engine layer ("images"): for each decoder layer's fused projection,
A [n_sub, r, K] (one A per sub-projection: q, k, v or gate, up) and B [N, r] (each
sub-projection's B in its output rows), scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)
folded into B. Sub-projections the adapter leaves out are zeros.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.config import ModelConfig

# Engine projection -> (its module path in a decoder layer, the checkpoint names it fuses).
PROJECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv": ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn.o_proj", ("o_proj",)),
    "gate_up": ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    "down": ("mlp.down_proj", ("down_proj",)),
}
_FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
_OWNER = {name: kind for kind, (_, subs) in PROJECTIONS.items() for name in subs}
TARGET_NAMES = (*_OWNER, *_FUSED)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")

Image = tuple[torch.Tensor, torch.Tensor]  # (A [n_sub, r, K], B [N, r])


@dataclass
class LoRAAdapter:
    lora_int_id: int
    path: str
    rank: int
    scaling: float
    images: dict[tuple[int, str], Image]  # (layer, projection kind) -> A, B

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.images.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Projection kind -> (input size K, output size of each sub-projection)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]),
            "down": (inter, [h])}


def load_adapter(lora_int_id: int, path: str | Path, cfg: ModelConfig, max_rank: int,
                 dtype: torch.dtype, pin: bool = False) -> LoRAAdapter:
    """The adapter at `path`, checked against `cfg`, as per-layer images in `dtype`."""
    root = Path(path)
    config = _read_config(root)
    rank, scaling = _rank_and_scaling(config, root, max_rank)
    tensors = _read_tensors(root)
    pairs = _pair_tensors(tensors, root, cfg.num_hidden_layers)
    shapes = projection_shapes(cfg)
    images: dict[tuple[int, str], Image] = {}
    for (layer, name), (a, b) in sorted(pairs.items()):
        kind = _FUSED.get(name) or _OWNER[name]
        k, outs = shapes[kind]
        fused = name in _FUSED
        want_out = sum(outs) if fused else outs[PROJECTIONS[kind][1].index(name)]
        if a.shape != (rank, k) or b.shape != (want_out, rank):
            raise ValueError(
                f"LoRA adapter {root}: layer {layer} {name}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the model (want ({rank}, {k}) and "
                f"({want_out}, {rank}) for r={rank})")
        img_a, img_b = images.get((layer, kind)) or _empty_image(len(outs), rank, k, sum(outs))
        b = b.float() * scaling
        if fused:  # one A shared by every shard: each shard's rank block gets a copy
            img_a[:] = a
            img_b.copy_(b)
        else:
            j = PROJECTIONS[kind][1].index(name)
            img_a[j] = a
            img_b[sum(outs[:j]) : sum(outs[: j + 1])] = b
        images[(layer, kind)] = (img_a, img_b)
    if not images:
        raise ValueError(f"LoRA adapter {root}: adapter_model.safetensors has no lora_A/lora_B "
                         "weights")
    images = {key: (_finish(a, dtype, pin), _finish(b, dtype, pin)) for key, (a, b) in images.items()}
    return LoRAAdapter(lora_int_id, str(root), rank, scaling, images)


def _empty_image(n_sub: int, rank: int, k: int, n: int) -> Image:
    return torch.zeros(n_sub, rank, k), torch.zeros(n, rank)


def _finish(t: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    t = t.to(dtype).contiguous()
    return t.pin_memory() if pin else t


def _read_config(root: Path) -> dict:
    if not root.is_dir():
        raise ValueError(f"LoRA adapter {root}: no such directory")
    path = root / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {root}: adapter_config.json is missing")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"LoRA adapter {root}: adapter_config.json is not valid JSON: {exc}") \
            from exc
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {root}: adapter_config.json must hold an object")
    return config


def _rank_and_scaling(config: dict, root: Path, max_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {root}: peft_type {peft_type!r} is not LORA")
    for field in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"LoRA adapter {root}: {field} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {root}: bias={config['bias']!r} is not supported "
                         "(only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGET_NAMES]
        if unknown:
            raise ValueError(f"LoRA adapter {root}: target module(s) {unknown} are not LoRA-"
                             f"capable layers of this model (supported: {list(TARGET_NAMES)})")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {root}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {root}: rank {rank} is above max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {root}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    path = root / "adapter_model.safetensors"
    if not path.is_file():
        pickled = (root / "adapter_model.bin").is_file()
        raise ValueError(f"LoRA adapter {root}: adapter_model.safetensors is missing" + (
            " (adapter_model.bin is a pickle, which slipstream never loads: save the adapter "
            "with safe_serialization=True)" if pickled else ""))
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"LoRA adapter {root}: cannot read adapter_model.safetensors: {exc}") \
            from exc


def _pair_tensors(tensors: dict[str, torch.Tensor], root: Path, num_layers: int
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"LoRA adapter {root}: tensor {key!r} is not a lora_A / lora_B "
                             "weight of a decoder layer's projection")
        layer, name, which = int(m.group(1)), m.group(2), m.group(3)
        if name not in TARGET_NAMES:
            raise ValueError(f"LoRA adapter {root}: tensor {key!r} targets {name!r}, which is "
                             f"not a LoRA-capable layer of this model ({list(TARGET_NAMES)})")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {root}: tensor {key!r} is for layer {layer}; the "
                             f"model has {num_layers}")
        found.setdefault((layer, name), {})[which] = t
    pairs = {}
    for (layer, name), ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {root}: layer {layer} {name} has no {missing}")
        pairs[(layer, name)] = (ab["A"], ab["B"])
    return pairs
