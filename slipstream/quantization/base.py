"""QuantMethod: how a linear layer stores its weights and multiplies by them.

Every linear layer delegates to one: create_weights (register parameters, uninitialised),
process_after_loading (repack / quantize once the checkpoint is in), apply (the matmul).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization.utils import CHECKPOINT_FORMATS


class QuantMethod(ABC):
    """Strategy object owned by one linear layer.

    folds_norm: whether the input RMSNorm's weight may be folded into this layer's 16-bit
    weight before process_after_loading (models/norm_fold.py).

    Parameters that create_weights registers may carry attributes the loader reads:
    `output_dim` / `input_dim` (which tensor dim is the output / input one, None if neither:
    such a param is not sliced for fused shards or tensor parallelism), and `weight_loader`
    (a callable (param, loaded_tensor, shard_index) that replaces the default copy).
    """

    folds_norm = False

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's parameters. output_sizes: one entry per fused shard (this rank)."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Called once after all weights are loaded (or dummy-initialised)."""
        return None  # nothing to repack by default

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W^T (+ bias) for x [..., input_size]."""

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None,
                    act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """apply(act(gate_up)) for the down projection of a gated MLP (act: silu_and_mul).
        Methods whose decode kernel can compute the activation while loading x override it."""
        return self.apply(layer, act(gate_up), bias)

    def apply_gate_out(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       rms_eps: float = 0.0) -> torch.Tensor | None:
        """silu_and_mul(apply(x)) of a [gate | up] layer in one kernel, where the method has one
        for this input (decode GEMVs at one row); None: the caller runs apply, then the act.
        rms_eps > 0: of x / rms(x), as apply_rms."""
        return None

    def apply_rms(self, layer: nn.Module, x: torch.Tensor, eps: float,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
        """apply(x / rms(x)) in one kernel for a layer whose input RMSNorm weight was folded
        into its weight (models/norm_fold.py), where the method has one for this input (decode
        GEMVs at one row); None: the caller runs the norm, then apply."""
        return None

    def apply_residual(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
        """apply(x) + residual with the add in the product's epilogue: at one row of x the
        residual is that row's bias, so every method's kernel adds it as it writes (rounded
        once). None (a real bias, or more rows): the caller adds."""
        if bias is not None or x.numel() != x.shape[-1] or residual.numel() != layer.output_size:
            return None
        return self.apply(layer, x, residual.reshape(-1))

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: nn.Module, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(norm(x [+ residual])), the new residual) for a linear layer fed by an RMSNorm
        (`layers.norm.RMSNorm`; residual None: no add, x is the residual). Methods that
        quantize their input override it to quantize inside the norm's kernel. The layer is
        called as a module here, so forward hooks (calibration statistics) see its input."""
        if residual is None:
            return layer(norm(x)), x
        h, residual = norm(x, residual)
        return layer(h), residual


class UnquantizedLinearMethod(QuantMethod):
    """Plain weight [out, in] in the model dtype; apply is F.linear."""

    # The checkpoint's weights are used bit for bit: folding a norm into them would round them
    # once more, and greedy tokens could then differ from transformers'.
    folds_norm = False

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype,
    ) -> None:
        # torch.empty: no random init is ever materialised; the loader fills it.
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        weight.output_dim = 0
        weight.input_dim = 1
        layer.register_parameter("weight", weight)

    def checkpoint_tensors(self, layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The weight in checkpoint layout (a fused layer is split into its shards by name)."""
        return {"weight": (layer.weight.data, 0, 1)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:  # small batches: a Triton GEMV when it measured faster than cuBLAS
            return linear_kernels().linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor, bias: torch.Tensor | None,
                    act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if gate_up.is_cuda:
            return linear_kernels().linear_gated(gate_up, layer.weight, bias, act)
        return F.linear(act(gate_up), layer.weight, bias)

    def apply_gate_out(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                       rms_eps: float = 0.0) -> torch.Tensor | None:
        gate_out = getattr(linear_kernels(), "linear_gate_out", None) if x.is_cuda else None
        return gate_out(x, layer.weight, bias, rms_eps) if gate_out is not None else None

    def apply_rms(self, layer: nn.Module, x: torch.Tensor, eps: float,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
        linear_rms = getattr(linear_kernels(), "linear_rms", None) if x.is_cuda else None
        return linear_rms(x, layer.weight, bias, eps) if linear_rms is not None else None


def linear_kernels():
    """kernels.triton_ops, or a stand-in with torch's linear when Triton cannot load."""
    global _TRITON_OPS
    if _TRITON_OPS is None:
        try:
            # Lazy: Triton is an optional dependency, and CPU engines never need it.
            from slipstream.kernels import triton_ops as _TRITON_OPS
        except ImportError:  # no triton: cuBLAS for every shape
            _TRITON_OPS = SimpleNamespace(
                linear=F.linear, linear_gated=lambda gu, w, b, act: F.linear(act(gu), w, b))
    return _TRITON_OPS


_TRITON_OPS = None


# The methods (each a module slipstream.quantization.<name> that registers itself).
METHOD_NAMES = ("int8_wo", "fp8", "int4_awq", "w8a8_sq")
# name -> factory(prefix) -> QuantMethod; quantization modules register themselves here.
QuantMethodFactory = Callable[[str], QuantMethod]
_FACTORIES: dict[str, Callable[..., QuantMethodFactory]] = {}


def register_quant_method(name: str):
    """Decorator for `make(hf_config: dict) -> QuantMethodFactory` of one quantization method."""

    def wrap(make: Callable[..., QuantMethodFactory]):
        _FACTORIES[name] = make
        return make

    return wrap


def get_quant_method_factory(method: str | None, hf_config: dict | None = None) -> QuantMethodFactory:
    """The factory the model uses to give each linear layer (by prefix) its QuantMethod.

    None -> unquantized. Otherwise slipstream.quantization.<method> is imported (it registers
    itself with @register_quant_method) and its factory is returned.
    """
    if method is None:
        return lambda prefix: UnquantizedLinearMethod()
    if method not in _FACTORIES:
        try:
            importlib.import_module(f"slipstream.quantization.{method}")
        except ImportError:
            pass
    if method not in _FACTORIES:
        known = sorted({*METHOD_NAMES, *_FACTORIES})
        raise ValueError(f"unknown quantization method {method!r}; choose one of "
                         f"{', '.join(known)} (or, for a pre-quantized checkpoint, its format: "
                         f"{', '.join(CHECKPOINT_FORMATS)})")
    return _FACTORIES[method](hf_config or {})
