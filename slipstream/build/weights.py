"""A loaded model's weights in the runtime layout, written and read back as they are.

The build saves every parameter and persistent buffer after loading: fused QKV and gate/up,
quantized, norms folded, KV-cache scales set. Loading an engine builds the same model skeleton
(the quant methods' create_weights: storage-less or empty parameters), then puts each saved
tensor in place of the parameter of the same name; parameters the skeleton has and the runtime
layout dropped (a 16-bit weight a method replaced) are removed. No conversion, no quantization.
The little non-tensor state loading leaves behind (which norms are folded, the quantized LM head's
format) is recorded in the manifest and set again here.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.models.loader import iterate_safetensors, safetensors_files
from slipstream.quantization.checkpoint import MAX_SHARD_BYTES, write_safetensors

logger = logging.getLogger(__name__)


def runtime_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor stored once, alias name -> the stored name it shares storage with)."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.is_meta:
            raise RuntimeError(f"{name} has no storage after loading: nothing to save")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:  # a tied weight (the head sharing the embedding's table)
            aliases[name] = seen[key]
        else:
            seen[key] = name
            stored[name] = t.data
    return stored, aliases


def runtime_state(model: nn.Module) -> dict[str, Any]:
    """The non-tensor state loading leaves: folded norms and the LM head's format."""
    folded = sorted(name for name, m in model.named_modules() if getattr(m, "folded", False))
    return {"folded_norms": folded}


def save_runtime_weights(model: nn.Module, out_dir: Path,
                         max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write the runtime tensors as safetensors shards; returns the manifest's `runtime` part."""
    stored, aliases = runtime_tensors(model)
    write_safetensors(stored, out_dir, lambda name, t: t.detach().contiguous().cpu(),
                      max_shard_bytes)
    nbytes = sum(t.numel() * t.element_size() for t in stored.values())
    return {"aliases": aliases, "num_tensors": len(stored), "weight_bytes": nbytes,
            **runtime_state(model)}


@torch.no_grad()
def load_runtime_weights(model: nn.Module, engine_dir: str | Path, runtime: dict[str, Any],
                         device: torch.device, lm_head_format: str | None) -> None:
    """Put the engine's saved tensors into the model skeleton (see the module docstring)."""
    shared = _shared_params(model)
    placed: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_safetensors(safetensors_files(engine_dir)):
        placed[name] = _place(model, name, tensor, device, shared)
    for alias, target in runtime.get("aliases", {}).items():
        if target not in placed:
            raise ValueError(f"engine {engine_dir}: {alias} is tied to {target}, which it lacks")
        _install(model, alias, placed[target])
        placed[alias] = placed[target]
    if len(placed) - len(runtime.get("aliases", {})) != runtime.get("num_tensors", len(placed)):
        raise ValueError(f"engine {engine_dir} holds {len(placed)} tensors, its manifest "
                         f"{runtime.get('num_tensors')}: the weight files are incomplete")
    _drop_unplaced(model, set(placed))
    for name in runtime.get("folded_norms", []):
        model.get_submodule(name).folded = True
    if lm_head_format:
        model.lm_head.bind_quantized(lm_head_format)


def _shared_params(model: nn.Module) -> set[int]:
    """ids of parameters that more than one name refers to (tied in the skeleton)."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {k for k, n in counts.items() if n > 1}


def _place(model: nn.Module, name: str, tensor: torch.Tensor, device: torch.device,
           shared: set[int]) -> torch.Tensor:
    """Copy into the skeleton's tensor where it matches (no second allocation), else install."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    old = module._parameters.get(leaf)
    if old is None:
        old = module._buffers.get(leaf)
    if (old is not None and not old.is_meta and id(old) not in shared
            and old.shape == tensor.shape and old.dtype == tensor.dtype):
        old.data.copy_(tensor)
        return old
    new = tensor.to(device)
    return _install(model, name, new)


def _install(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    module.__dict__.pop(leaf, None)  # a plain attribute (e.g. None until quantized) would shadow it
    if leaf in module._buffers:
        module._buffers[leaf] = tensor
        return tensor
    param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor,
                                                                         requires_grad=False)
    module._parameters[leaf] = param
    return param


def _drop_unplaced(model: nn.Module, placed: set[str]) -> None:
    """Remove skeleton parameters the runtime layout does not have (replaced at load)."""
    for module_path, module in model.named_modules():
        prefix = f"{module_path}." if module_path else ""
        for leaf in [k for k in module._parameters if f"{prefix}{k}" not in placed]:
            del module._parameters[leaf]
