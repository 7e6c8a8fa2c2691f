"""LoRA on the model's linear layers: per-layer slot buffers and the batch state they read.

`attach_lora` gives each decoder layer's qkv, o, gate_up and down projection a `LoRALinear`
(`LinearBase.lora`): A [max_loras, n_sub * max_rank, K] and B [max_loras, N, max_rank] on the
device, zeros until an adapter is paged into a slot. All of them share one `LoRAState`, which
the runner sets before each forward:

- off: no request of the step uses an adapter, and the layers run exactly as without LoRA.
- eager: the step's layout (kernels/lora/meta.py) for its token count.
- static: the layout lives in a fixed device buffer, sliced by the token count of the forward;
  CUDA graphs captured in this mode replay any mix of adapters once the buffer is staged.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.kernels.lora import lora_ops
from slipstream.kernels.lora.meta import LoRAMeta, meta_views, packed_size
from slipstream.lora.adapter import PROJECTIONS, Image, projection_shapes


class LoRAState:
    """Which LoRA layout the next forward uses (see the module docstring)."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device):
        self.num_slots = num_slots
        self.mode = "off"
        self._eager: LoRAMeta | None = None
        self.static = torch.full((packed_size(max_tokens, num_slots),), -1, dtype=torch.int32,
                                 device=device)
        self.max_static_tokens = max_tokens
        # The shrinks of a forward of up to max_tokens rows write their own columns of one
        # workspace, zeroed once by the forward's first projection: one memset a step instead
        # of one a projection. None: each shrink allocates.
        self.h_workspace: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def set_eager(self, meta: LoRAMeta) -> None:
        self.mode, self._eager = "eager", meta

    def set_off(self) -> None:
        self.mode, self._eager = "off", None

    def meta_for(self, num_tokens: int) -> LoRAMeta:
        if self.mode == "static":
            return meta_views(self.static, num_tokens, self.num_slots)
        if self._eager is None or self._eager.num_tokens != num_tokens:
            raise RuntimeError(f"LoRA layout for {self._eager and self._eager.num_tokens} "
                               f"tokens, forward of {num_tokens}")
        return self._eager


class LoRALinear:
    """Slot buffers of one projection and its product; a plain object, not a module, so the
    model's parameters, state dict and L2 prefetch tables stay those of the base model."""

    def __init__(self, state: LoRAState, in_size: int, out_sizes: list[int], max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.state = state
        self.max_rank = max_rank
        self.out_sizes = out_sizes
        self.shard_starts = tuple(sum(out_sizes[:j]) for j in range(len(out_sizes)))
        slots = state.num_slots
        self.a = torch.zeros((slots, len(out_sizes) * max_rank, in_size), dtype=dtype, device=device)
        self.b = torch.zeros((slots, sum(out_sizes), max_rank), dtype=dtype, device=device)
        self.ops = lora_ops(str(device))
        self.h_cols: slice | None = None  # this projection's columns of state.h_workspace
        self.zeroes_h = False  # the first projection of a forward zeroes the workspace

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each row's adapter delta; y is updated in place."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        meta = self.state.meta_for(x2.shape[0])
        self.ops.lora_add(x2, y2, self.a, self.b, meta, self.shard_starts, self._h(x2.shape[0]))
        return y

    def _h(self, num_tokens: int) -> torch.Tensor | None:
        """This projection's zeroed shrink buffer in the shared workspace, or None."""
        ws = self.state.h_workspace
        if ws is None or self.h_cols is None:
            return None
        if num_tokens > ws.shape[0]:
            return None  # a long prefill allocates its own
        if self.zeroes_h:
            ws[:num_tokens].zero_()
        return ws[:num_tokens, self.h_cols]

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def load(self, slot: int, image: Image) -> None:
        """Copy one adapter's image (adapter.py) into a slot, zeros past its rank."""
        a, b = image
        n_sub, rank = a.shape[0], a.shape[1]
        if rank < self.max_rank:  # else the copies below overwrite the whole slot
            self.clear(slot)
        non_blocking = self.a.is_cuda and a.is_pinned()
        self.a[slot].view(n_sub, self.max_rank, -1)[:, :rank].copy_(a, non_blocking=non_blocking)
        self.b[slot][:, :rank].copy_(b, non_blocking=non_blocking)


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, max_tokens: int,
                dtype: torch.dtype, device: torch.device) -> tuple[LoRAState, dict]:
    """Give every decoder layer's projections a LoRALinear; returns the shared state and
    {(layer, projection kind): LoRALinear}."""
    state = LoRAState(max_loras, max_tokens, device)
    shapes = projection_shapes(model.config)
    layers = {}
    for i, layer in enumerate(model.model.layers):
        for kind, (path, _) in PROJECTIONS.items():
            linear = layer.get_submodule(path)
            k, outs = shapes[kind]
            if linear.input_size != k or linear.output_size != sum(outs):
                raise ValueError(f"layer {i} {path}: [{linear.output_size}, {linear.input_size}]"
                                 f" is not the shape LoRA expects [{sum(outs)}, {k}]")
            lora = LoRALinear(state, k, outs, max_rank, dtype, device)
            linear.lora = lora
            layers[(i, kind)] = lora
    if device.type == "cuda":
        _attach_workspace(state, layers, max_tokens, device)
    return state, layers


def _attach_workspace(state: LoRAState, layers: dict, max_tokens: int,
                       device: torch.device) -> None:
    """The Triton shrinks' workspace, allocated once before the KV cache is sized: a column
    range per projection, in forward order so the first projection called zeroes it."""
    width = 0
    for lora in layers.values():  # layer by layer, qkv first: the order of a forward
        lora.h_cols = slice(width, width + lora.a.shape[1])
        width += lora.a.shape[1]
    next(iter(layers.values())).zeroes_h = True
    state.h_workspace = torch.empty((max_tokens, width), dtype=torch.float32, device=device)
