"""Quantize each linear layer as soon as its weights are in, not after the whole model is.

A method that quantizes at load time (fp8, int8_wo, int4_awq, w8a8_sq from a 16-bit checkpoint)
creates its unquantized weight without storage while the engine builds the model
(quantization.utils.load_time_weight). The loader asks this object for each parameter before
filling it: a storage-less one gets device memory then. When the last tensor of a layer has
arrived, the layer's process_after_loading runs and its 16-bit weight is freed. The device holds
the quantized model plus about one layer of 16-bit weights at a time, instead of the whole 16-bit
model: Llama-3.1-70B (141 GB in bf16) can be quantized to FP8 at load on one 141 GB GPU.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class QuantizeAsLoaded:
    """Tracks, per linear layer with deferred weights, which of its tensors are still to come."""

    def __init__(self, model: nn.Module, device: torch.device | str):
        self.model = model
        self.device = torch.device(device)
        self.processed: set[str] = set()
        self._pending: dict[str, set[str]] = {}

    def expect(self, keys: Iterable[tuple[str, str]]) -> None:
        """(module path, key) pairs that must arrive before that module is processed; only
        modules that own a storage-less parameter are tracked (the others process at finish)."""
        for path, key in keys:
            if path in self._pending or _has_deferred_param(self.model.get_submodule(path)):
                self._pending.setdefault(path, set()).add(key)

    def param(self, pname: str) -> nn.Parameter:
        """Parameter `pname`, given device storage first if it had none."""
        path, _, leaf = pname.rpartition(".")
        if path in self.processed:  # its 16-bit weights are gone: a late copy cannot land
            raise ValueError(f"{pname} arrived again after {path} was quantized (the checkpoint "
                             "holds this tensor twice)")
        module = self.model.get_submodule(path)
        param = module._parameters[leaf]
        if param.is_meta:
            param = _materialize(module, leaf, self.device)
        return param

    def arrived(self, path: str, key: str) -> None:
        """`key` of module `path` is filled: process the module if it was the last one."""
        keys = self._pending.get(path)
        if keys is None:
            return
        keys.discard(key)
        if not keys:
            del self._pending[path]
            self._process(path)

    def finish(self) -> None:
        """Process every quantized module not processed yet (pre-quantized checkpoints, layers
        without deferred weights), in module order, as the loader always did."""
        for path, module in self.model.named_modules():
            if path not in self.processed and getattr(module, "quant_method", None) is not None:
                self._process(path)

    def _process(self, path: str) -> None:
        module = self.model.get_submodule(path)
        with torch.no_grad():
            module.quant_method.process_after_loading(module)
        self.processed.add(path)
        leftover = [name for name, p in module.named_parameters(recurse=False) if p.is_meta]
        if leftover:
            raise RuntimeError(f"{path}: parameters {leftover} were never loaded")


def _has_deferred_param(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters(recurse=False))


def _materialize(module: nn.Module, leaf: str, device: torch.device) -> nn.Parameter:
    """Replace a storage-less parameter by an empty one on `device` with the same loader
    attributes (output_dim, weight_loader, ...): a meta tensor cannot take storage in place."""
    old = module._parameters[leaf]
    new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device),
                       requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    module._parameters[leaf] = new
    return new
