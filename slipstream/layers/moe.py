"""The routed experts of a mixture-of-experts layer: top-k routing and the experts' gated MLPs.

`FusedMoE` holds every expert this rank keeps as two stacked weights, w13 [E_local, 2I, H]
([gate | up] of each expert) and w2 [E_local, H, I], and runs them through the fused kernels
(kernels/moe/fused_moe.py on CUDA, their twin kernels/moe/reference.py elsewhere).

Tensor parallelism (tp_size > 1), one of two placements; either way every rank sees every
token (the attention's all-reduce leaves the whole batch on each rank), computes its share of
the routed sum, and `forward` all-reduces the shares across the tensor-parallel group:
- split experts (default): each expert's intermediate dimension is split across the ranks
  (gate/up rows and down columns), like the dense MLP;
- expert parallel (`local_experts`): each rank holds whole experts, a token's slot whose
  expert lives elsewhere maps to -1 and adds nothing here.

Weight-only quantization of the experts at load, fp8 (e4m3) or int8, or pre-quantized FP8 from
the checkpoint (layers/moe_fp8_checkpoint.py): one float32 scale per output row of each expert.
int4 at load (round to nearest) or pre-quantized GPTQ / AWQ (layers/moe_int4_checkpoint.py):
groups of `int4_group_size` input columns, each with a float16 scale and a uint8 zero, two
values packed a byte along K (kernels/moe/reference.Int4Experts).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slipstream.kernels.moe import reference
from slipstream.kernels.moe.reference import Int4Experts
from slipstream.layers.moe_fp8_checkpoint import (
    UNUSED_TENSORS,
    Fp8ExpertCheckpoint,
    PendingExpertTensors,
    per_row_fp8,
)
from slipstream.layers.moe_int4_checkpoint import (
    Int4ExpertCheckpoint,
    PendingInt4Tensors,
    slice_int4,
    unpack_expert,
)
from slipstream.parallel import state as parallel_state
from slipstream.parallel.checkpoint_slices import materialize
from slipstream.quantization.utils import (
    FP8_DTYPE,
    load_time_weight,
    new_param,
    pack_int4_rows,
    quantize_fp8_per_channel,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
    replace_param,
)

EXPERT_WEIGHT_FORMATS = (None, "fp8", "int8", "int4")
# Shard index of a checkpoint tensor inside an expert: gate and up rows of w13, then w2.
GATE, UP, DOWN = 0, 1, 2


class ExpertQuantMethod:
    """Quantizes the stacked expert weights once they are loaded (QuantizeAsLoaded calls
    process_after_loading when the layer's last tensor is in); None keeps them as loaded."""

    def __init__(self, weight_format: str | None, prequantized: bool = False,
                 group_size: int = 0):
        if weight_format not in EXPERT_WEIGHT_FORMATS:
            raise ValueError(f"MoE experts support weight formats {EXPERT_WEIGHT_FORMATS[1:]}, "
                             f"not {weight_format!r}")
        if weight_format == "int4" and group_size <= 0:
            raise ValueError(f"int4 experts need a positive group size, got {group_size}")
        self.weight_format, self.group_size = weight_format, group_size
        # The loader may skip these per-expert checkpoint tensors (static activation scales).
        self.unused_checkpoint_tensors = UNUSED_TENSORS if prequantized else ()

    def process_after_loading(self, layer: FusedMoE) -> None:
        if self.weight_format is None or not layer.w13_weight.is_floating_point() or \
                layer.w13_weight.element_size() == 1:
            return
        if self.weight_format == "int4":
            self._quantize_int4(layer)
            return
        quantize = quantize_fp8_per_channel if self.weight_format == "fp8" else \
            quantize_int8_per_channel
        for name in ("w13_weight", "w2_weight"):
            w = getattr(layer, name)
            experts, rows, cols = w.shape
            q, scale = quantize(w.data.reshape(experts * rows, cols))
            replace_param(layer, name, q.view(experts, rows, cols))
            replace_param(layer, name.replace("weight", "scale"), scale.view(experts, rows))


    def _quantize_int4(self, layer: FusedMoE) -> None:
        """Round to nearest in groups along K; weight [E, N, K/2] packed, scale and zero
        [E, N, groups]. (No AWQ scale search for experts: it would need each expert's inputs.)"""
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight")
            experts, rows, cols = w.shape
            q, scale, zero = quantize_int4_groupwise(w.data.reshape(experts * rows, cols),
                                                     self.group_size)
            scale = scale.half()  # float16 scales, as int4 checkpoints and dense layers keep
            replace_param(layer, f"{name}_weight",
                          pack_int4_rows(q).view(experts, rows, cols // 2))
            replace_param(layer, f"{name}_scale", scale.view(experts, rows, -1))
            replace_param(layer, f"{name}_zero", zero.view(experts, rows, -1))


class FusedMoE(nn.Module):
    """forward(x [T, H], router_logits [T, E]) -> [T, H]: sum over the k chosen experts of
    weight * down(silu(gate(x)) * up(x))."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype, *, renormalize: bool,
                 weight_format: str | None = None, local_experts: Sequence[int] | None = None,
                 use_triton: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 fp8_checkpoint: Fp8ExpertCheckpoint | None = None, int4_group_size: int = 0,
                 int4_checkpoint: Int4ExpertCheckpoint | None = None):
        """fp8_checkpoint / int4_checkpoint: the experts come pre-quantized in that layout.
        int4_group_size: the group along K of weight_format "int4" (quantized at load)."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.local_experts = _check_placement(local_experts, num_experts)
        self.holds_all = len(self.local_experts) == num_experts
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # Split experts: this rank's slice of every expert's intermediate dimension.
        self.split = tp_size if self.holds_all else 1
        if intermediate_size % self.split:
            raise ValueError(f"expert intermediate size {intermediate_size} does not split "
                             f"across {tp_size} ranks: enable expert parallelism instead")
        self.full_intermediate = intermediate_size
        intermediate_size //= self.split
        self.intermediate_size = intermediate_size
        self.int4_checkpoint = int4_checkpoint
        if int4_checkpoint is not None:
            weight_format, int4_group_size = "int4", int4_checkpoint.group_size
            self._pending_int4 = PendingInt4Tensors(int4_checkpoint)
        if weight_format == "int4":
            check_int4_sizes(hidden_size, intermediate_size, tp_size if self.split > 1 else 1)
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
        expert_map[list(self.local_experts)] = torch.arange(len(self.local_experts),
                                                            dtype=torch.int32)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.use_triton = use_triton
        self.fp8_checkpoint = fp8_checkpoint
        if fp8_checkpoint is not None:
            weight_format, params_dtype = "fp8", FP8_DTYPE
            self._pending = PendingExpertTensors()
        self.quant_method = ExpertQuantMethod(weight_format, fp8_checkpoint is not None,
                                              int4_group_size)
        count = len(self.local_experts)
        if int4_checkpoint is not None:
            self._create_int4(count, hidden_size, intermediate_size, int4_group_size)
            return
        make = load_time_weight if weight_format is not None and fp8_checkpoint is None \
            else _empty_2d
        self.w13_weight = new_param(make(count * 2 * intermediate_size, hidden_size,
                                         params_dtype).view(count, 2 * intermediate_size,
                                                            hidden_size))
        self.w2_weight = new_param(make(count * hidden_size, intermediate_size, params_dtype)
                                   .view(count, hidden_size, intermediate_size))
        if fp8_checkpoint is None:  # int8 / fp8 at load: [E_local, 2I] float32, made then
            self.register_parameter("w13_scale", None)
            self.register_parameter("w2_scale", None)
            self.register_parameter("w13_zero", None)  # int4: [E_local, N, groups] uint8
            self.register_parameter("w2_zero", None)
        else:
            self.w13_scale = new_param(torch.empty(count, 2 * intermediate_size,
                                                   dtype=torch.float32))
            self.w2_scale = new_param(torch.empty(count, hidden_size, dtype=torch.float32))
            self.register_parameter("w13_zero", None)
            self.register_parameter("w2_zero", None)

    def _create_int4(self, count: int, hidden: int, inter: int, group: int) -> None:
        """Pre-quantized int4: the packed layout itself, filled as each expert's tensors load."""
        for name, rows, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            groups = -(-k // group)
            setattr(self, f"{name}_weight",
                    new_param(torch.zeros(count, rows, k // 2, dtype=torch.uint8)))
            setattr(self, f"{name}_scale",
                    new_param(torch.zeros(count, rows, groups, dtype=torch.float16)))
            setattr(self, f"{name}_zero",
                    new_param(torch.zeros(count, rows, groups, dtype=torch.uint8)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """One expert's gate, up or down tensor; shard = local expert * 3 + GATE / UP / DOWN
        (int4 checkpoints: times 4 plus the index of the tensor in INT4_TENSORS)."""
        if shard is None:
            raise ValueError("expert weights load one expert's tensor at a time")
        if self.int4_checkpoint is not None:
            self._load_int4(loaded, *divmod(shard, 4))
            return
        expert, part = divmod(shard, 3)
        inter = self.intermediate_size
        start = self.tp_rank * inter if self.split > 1 else 0
        if self.fp8_checkpoint is not None:
            self._load_fp8(param, loaded, expert, part, start)
            return
        # Only this rank's slice is read from a memory-mapped checkpoint tensor.
        loaded = loaded.narrow(1 if part == DOWN else 0, start, inter) if self.split > 1 \
            else materialize(loaded)
        dest = param.data[expert]
        if part in (GATE, UP):
            dest = dest.narrow(0, part * inter, inter)
        if dest.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs expert "
                             f"slice {tuple(dest.shape)}")
        dest.copy_(loaded)

    def _load_int4(self, loaded, shard: int, kind: int) -> None:
        """A GPTQ / AWQ expert tensor; all of a projection's in: unpack, cut, pack."""
        ckpt = self.int4_checkpoint
        tensors = self._pending_int4.add(shard, ckpt.tensor_names[kind], loaded)
        if tensors is None:
            return
        expert, part = divmod(shard, 3)
        q, scale, zero = unpack_expert(tensors, ckpt)
        inter = self.intermediate_size
        if self.split > 1:
            q, scale, zero = slice_int4(q, scale, zero, 1 if part == DOWN else 0,
                                        self.tp_rank * inter, inter, ckpt.group_size)
        name = "w2" if part == DOWN else "w13"
        dests = [getattr(self, f"{name}_{t}")[expert] for t in ("weight", "scale", "zero")]
        if part != DOWN:
            dests = [d.narrow(0, part * inter, inter) for d in dests]
        for dest, src in zip(dests, (pack_int4_rows(q), scale, zero), strict=True):
            if dest.shape != src.shape:
                raise ValueError(f"shape mismatch: checkpoint {tuple(src.shape)} vs expert "
                                 f"slice {tuple(dest.shape)} ({name}, expert {expert})")
            dest.copy_(src)

    def _load_fp8(self, param: nn.Parameter, loaded, expert: int, part: int, start: int) -> None:
        """A pre-quantized expert tensor or its scale; both in: the rows and their scales."""
        kind = "scale" if param is self.w13_scale or param is self.w2_scale else "weight"
        both = self._pending.add(expert * 3 + part, kind, loaded)
        if both is None:
            return
        inter = self.intermediate_size
        cut = (1 if part == DOWN else 0, start, inter) if self.split > 1 else None
        q, scale = per_row_fp8(*both, self.fp8_checkpoint, cut)
        weight, scales = (self.w2_weight[expert], self.w2_scale[expert]) if part == DOWN else (
            self.w13_weight[expert].narrow(0, part * inter, inter),
            self.w13_scale[expert].narrow(0, part * inter, inter))
        if weight.shape != q.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(q.shape)} vs expert slice "
                             f"{tuple(weight.shape)}")
        weight.copy_(q)
        scales.copy_(scale)

    def checkpoint_names(self, prefix: str, names: tuple[str, str, str]
                         ) -> dict[str, tuple[str, int]]:
        """Checkpoint tensor -> (parameter, shard) for this rank's experts; names: the
        checkpoint's (gate, up, down) module names, e.g. ("w1", "w3", "w2") for Mixtral."""
        out = {}
        for local, expert in enumerate(self.local_experts):
            for part, name in enumerate(names):
                param = "w2" if part == DOWN else "w13"
                if self.int4_checkpoint is not None:
                    for kind, tensor in enumerate(self.int4_checkpoint.tensor_names):
                        target = {"qzeros": "zero", "scales": "scale"}.get(tensor, "weight")
                        out[f"{prefix}.{expert}.{name}.{tensor}"] = (
                            f"{prefix}.{param}_{target}", (local * 3 + part) * 4 + kind)
                    continue
                out[f"{prefix}.{expert}.{name}.weight"] = (f"{prefix}.{param}_weight",
                                                           local * 3 + part)
                if self.fp8_checkpoint is not None:
                    scale = f"{prefix}.{expert}.{name}.{self.fp8_checkpoint.scale_name}"
                    out[scale] = (f"{prefix}.{param}_scale", local * 3 + part)
        return out

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], global expert ids int32 [T, k])."""
        if self.use_triton and router_logits.is_cuda:
            from slipstream.kernels.moe import fused_moe  # Triton: CUDA only

            return fused_moe.route_topk(router_logits, self.top_k, self.renormalize)
        return reference.route_topk(router_logits, self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits)
        out = self.experts(x, weights, ids)
        return parallel_state.tp_all_reduce(out) if self.tp_size > 1 else out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, global_ids: torch.Tensor
                ) -> torch.Tensor:
        """This rank's share of the routed sum for already-routed tokens."""
        ids = global_ids if self.holds_all else self.expert_map[global_ids.long()]
        args = (x, self.w13_weight, self.w2_weight, weights, ids, self.w13_scale, self.w2_scale)
        int4 = None if self.w13_zero is None else Int4Experts(
            self.w13_zero, self.w2_zero, self.quant_method.group_size)
        if self.use_triton and x.is_cuda:
            from slipstream.kernels.moe import fused_moe  # Triton: CUDA only

            return fused_moe.fused_moe(*args, int4=int4)
        return reference.fused_moe(*args, int4=int4)

    def extra_repr(self) -> str:
        fmt = self.quant_method.weight_format or str(self.w13_weight.dtype).removeprefix("torch.")
        return (f"experts={len(self.local_experts)}/{self.num_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size}"
                f"{f'/{self.full_intermediate}' if self.split > 1 else ''}, {fmt}")


def check_int4_sizes(hidden_size: int, intermediate_size: int, tp_size: int = 1) -> None:
    """int4 experts pack two values a byte along K (hidden for gate/up, this rank's
    intermediate slice for down): both must be even. Quantized at load, a rank groups its own
    slice from its first column, so any slice that packs works."""
    if hidden_size % 2 or intermediate_size % 2:
        raise ValueError(f"int4 experts need even input sizes: hidden {hidden_size}, "
                         f"intermediate per rank {intermediate_size} "
                         f"(tensor_parallel_size={tp_size})")


def _empty_2d(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, k, dtype=dtype)


def experts_of_rank(num_experts: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """Expert parallelism's placement: contiguous ranges, sizes differing by at most one."""
    if num_experts < tp_size:
        raise ValueError(f"expert parallelism needs at least one expert per rank: "
                         f"{num_experts} experts on {tp_size} ranks")
    base, extra = divmod(num_experts, tp_size)
    start = tp_rank * base + min(tp_rank, extra)
    return tuple(range(start, start + base + (1 if tp_rank < extra else 0)))


def _check_placement(local_experts: Sequence[int] | None, num_experts: int) -> tuple[int, ...]:
    if local_experts is None:
        return tuple(range(num_experts))
    placed = tuple(sorted(set(int(e) for e in local_experts)))
    if not placed or placed[0] < 0 or placed[-1] >= num_experts:
        raise ValueError(f"local_experts must be a non-empty subset of 0..{num_experts - 1}, "
                         f"got {list(local_experts)}")
    return placed
