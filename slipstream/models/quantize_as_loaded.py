"""Quantize each linear layer as soon as its weights are in, not after the whole model is.

A method that quantizes at load time (fp8, int8_wo, int4_awq, w8a8_sq from a 16-bit checkpoint)
creates its unquantized weight without storage while the engine builds the model
(quantization.utils.load_time_weight). The loader asks this object for each parameter before
filling it: a storage-less one gets device memory then. When the last tensor of a layer has
arrived, the layer's process_after_loading runs and its 16-bit weight is freed. The device holds
the quantized model plus about one layer of 16-bit weights at a time, instead of the whole 16-bit
model: Llama-3.1-70B (141 GB in bf16) can be quantized to FP8 at load on one 141 GB GPU.

A calibration that needs a whole decoder layer in 16 bits before any of its linears is quantized
(AWQ's scale search) runs inside `before_each_layer(hook)`: the linears of decoder layer i are
then held until all of them are in, `hook(model, i, layer)` runs, and they are quantized
together. The loader feeds such a load one decoder layer at a time, in order
(loader.iterate_in_layer_order).
"""
from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from slipstream.engine.startup import counting
from slipstream.models.norm_fold import can_fold, fold_norm, fold_pairs

LayerHook = Callable[[nn.Module, int, nn.Module], None]
_FOLD_KEY = "<the folded norm's weight>"
_LAYER_HOOK: contextvars.ContextVar[LayerHook | None] = contextvars.ContextVar(
    "slipstream_before_each_layer", default=None)
_DECODER_LAYER = re.compile(r"^(.*\.layers\.(\d+))\.")


@contextlib.contextmanager
def before_each_layer(hook: LayerHook) -> Iterator[None]:
    """Models loaded in this context call hook(model, i, decoder_layer) once decoder layer i's
    weights are all in, before its linears are quantized."""
    token = _LAYER_HOOK.set(hook)
    try:
        yield
    finally:
        _LAYER_HOOK.reset(token)


def layer_hook_active() -> bool:
    return _LAYER_HOOK.get() is not None


def decoder_layer_of(name: str) -> tuple[str, int] | None:
    """(decoder layer path, index) of a parameter / module / checkpoint name inside one."""
    m = _DECODER_LAYER.match(name)
    return (m.group(1), int(m.group(2))) if m else None


class QuantizeAsLoaded:
    """Tracks, per linear layer with deferred weights, which of its tensors are still to come."""

    def __init__(self, model: nn.Module, device: torch.device | str):
        self.model = model
        self.device = torch.device(device)
        self.processed: set[str] = set()
        self._pending: dict[str, set[str]] = {}
        self._hook = _LAYER_HOOK.get()
        self._held: dict[str, list[str]] = {}  # decoder layer -> its complete, unprocessed modules
        # Projection -> the norm folded into it before it is processed (norm_fold.py); a whole-
        # layer calibration reads and rescales the norms itself, so it gets none.
        self._fold = fold_pairs(model) if self._hook is None else {}
        self._fold_waiters: dict[str, list[str]] = {}  # norm -> projections waiting for it

    def expect(self, keys: Iterable[tuple[str, str]]) -> None:
        """(module path, key) pairs that must arrive before that module is processed; only
        modules that own a storage-less parameter are tracked (the others process at finish),
        and under a layer hook every module of a decoder layer (its norms too: the hook reads
        the whole layer)."""
        for path, key in keys:
            if (path in self._pending or _has_deferred_param(self.model.get_submodule(path))
                    or (self._hook is not None and decoder_layer_of(path) is not None)):
                self._pending.setdefault(path, set()).add(key)
        for path, norm in self._fold.items():  # a folded projection also waits for its norm
            if path in self._pending and path not in self._fold_waiters.get(norm, []):
                self._pending[path].add(_FOLD_KEY)
                self._fold_waiters.setdefault(norm, []).append(path)

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
        for waiting in self._fold_waiters.pop(path, []):  # a norm (one tensor): now foldable
            self.arrived(waiting, _FOLD_KEY)
        keys = self._pending.get(path)
        if keys is None:
            return
        keys.discard(key)
        if keys:
            return
        del self._pending[path]
        layer = decoder_layer_of(path) if self._hook is not None else None
        if layer is None:
            self._process(path)
            return
        self._held.setdefault(layer[0], []).append(path)
        if not any(p.startswith(layer[0] + ".") for p in self._pending):
            self._release(*layer)

    def _release(self, layer_path: str, index: int) -> None:
        """Decoder layer `index` is complete: the hook, then its linears in module order."""
        self._hook(self.model, index, self.model.get_submodule(layer_path))
        for path in sorted(self._held.pop(layer_path), key=self._module_order().index):
            if getattr(self.model.get_submodule(path), "quant_method", None) is not None:
                self._process(path)

    def _module_order(self) -> list[str]:
        if not hasattr(self, "_order"):
            self._order = [name for name, _ in self.model.named_modules()]
        return self._order

    def finish(self) -> None:
        """Process every quantized module not processed yet (pre-quantized checkpoints, layers
        without deferred weights), in module order, as the loader always did."""
        if self._held:
            raise RuntimeError(f"decoder layers {sorted(self._held)} never received all their "
                               "weights")
        for path, module in self.model.named_modules():
            if path not in self.processed and getattr(module, "quant_method", None) is not None:
                self._process(path)

    def _process(self, path: str) -> None:
        with counting("quantize"):  # the start-up log's "quantize" phase
            self._fold_and_process(path)

    def _fold_and_process(self, path: str) -> None:
        module = self.model.get_submodule(path)
        norm_path = self._fold.get(path)
        if norm_path is not None:
            norm = self.model.get_submodule(norm_path)
            if can_fold(module, norm):
                fold_norm(module, norm)
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
