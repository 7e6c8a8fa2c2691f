"""A GGUF file written out as a Hugging Face checkpoint directory: config.json from its metadata,
its tensors (quantized ones dequantized, Llama's q/k rows in HF's order) as safetensors shards,
and its tokenizer and chat template as tokenizer files. `slipstream quantize` reads a GGUF model
through it, so every method quantizes from the same float weights the engine would run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from slipstream.models.gguf import gguf_hf_config, iterate_gguf_weights

INDEX_FILE = "model.safetensors.index.json"
_LAYER_TENSORS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


def hf_tensor_names(config: dict[str, Any]) -> list[str]:
    """Every tensor name a Llama / Qwen2 / Qwen3 checkpoint of `config` may hold (weights and
    biases); the file's tensors are matched against these."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        for module in _LAYER_TENSORS:
            names += [f"model.layers.{i}.{module}.weight", f"model.layers.{i}.{module}.bias"]
    return names


def _shards(tensors: Iterator[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t.contiguous()
        size += nbytes
    if shard:
        yield shard


def write_hf_checkpoint(gguf_path: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 << 30) -> Path:
    """Write the GGUF file's model to `out_dir` as an HF checkpoint (float32 for dequantized
    tensors, F16 / BF16 ones as stored); one shard at a time is in memory. Returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = gguf_hf_config(gguf_path)
    config.pop("gguf")
    tensors = iterate_gguf_weights(gguf_path, hf_tensor_names(config))
    weight_map: dict[str, str] = {}
    files: list[tuple[Path, list[str]]] = []
    dtypes: set[torch.dtype] = set()
    for i, shard in enumerate(_shards(tensors, max_shard_bytes), start=1):
        path = out / f"model-{i:05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        files.append((path, list(shard)))
        dtypes |= {t.dtype for t in shard.values() if t.dim() == 2}
    _name_shards(out, files, weight_map)
    half = dtypes & {torch.bfloat16, torch.float16}
    config["torch_dtype"] = (
        "float32" if dtypes != half or len(half) != 1 else str(half.pop()).removeprefix("torch.")
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(gguf_path, out)
    return out


def _name_shards(out: Path, files: list[tuple[Path, list[str]]], weight_map: dict[str, str]) -> None:
    """model.safetensors for one shard, else model-0000i-of-0000n names and their index."""
    if len(files) == 1:
        files[0][0].rename(out / "model.safetensors")
        return
    for i, (path, names) in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        path.rename(out / name)
        weight_map.update(dict.fromkeys(names, name))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")


def _write_tokenizer(gguf_path: str | Path, out: Path) -> None:
    from slipstream.tokenizer.gguf_tokenizer import load_gguf_tokenizer

    load_gguf_tokenizer(gguf_path).hf.save_pretrained(str(out))
