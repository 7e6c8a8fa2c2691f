"""Linear layers that delegate storage and matmul to a QuantMethod.

Column-parallel layers split the output dim across tensor-parallel ranks, row-parallel ones the
input dim (then all-reduce). Fused layers (QKV, gate/up) hold several checkpoint tensors in one
weight; `weight_loader(param, tensor, shard)` puts each one in its slice.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.parallel import state as parallel_state
from slipstream.parallel.checkpoint_slices import materialize
from slipstream.parallel.sharding import (
    kv_heads_per_rank,
    kv_shard_position,
    shard_checkpoint_tensor,
    split_fused_checkpoint_tensor,
)
from slipstream.quantization.base import QuantMethod, UnquantizedLinearMethod


class LinearBase(nn.Module):
    """y = x W^T + b with W owned by `quant_method`. tp_size/tp_rank: tensor-parallel hook."""

    # Which dim of a loaded tensor is split across ranks: "output", "input" or None.
    tp_split: str | None = None
    # LoRA hook (slipstream/lora/layers.py): a LoRALinear on the projections of an engine with
    # enable_lora. While a step uses adapters, the fused variants below give way to the plain
    # product plus the adapter delta; otherwise they run exactly as without LoRA.
    lora = None
    # Whether 2-D checkpoint tensors are stored [in, out] (GPT-2's Conv1D), not [out, in].
    checkpoint_transposed = False

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, params_dtype: torch.dtype,
        quant_method: QuantMethod | None = None, tp_size: int = 1, tp_rank: int = 0,
    ) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.input_size = input_size
        self.output_sizes = list(output_sizes)  # this rank's share of each fused shard
        # Each shard's whole-model output size (a fused checkpoint tensor is cut by these).
        self.full_output_sizes = [s * tp_size for s in self.output_sizes]
        self.output_size = sum(self.output_sizes)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            b = nn.Parameter(torch.empty(self.output_size, dtype=params_dtype), requires_grad=False)
            b.output_dim = 0
            self.register_parameter("bias", b)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return self.lora.add_to(x, y) if self.lora_on else y

    @property
    def lora_on(self) -> bool:
        """Whether this step adds adapter deltas to this layer's product."""
        return self.lora is not None and self.lora.state.active

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(x [+ residual])), new residual), letting the quant method fuse its input
        quantization into the norm (see QuantMethod.apply_normed). No communication is involved,
        so tensor-parallel column layers take it as is."""
        if self.lora_on:  # the adapter needs the normalised input itself
            h, new_residual = (norm(x), x) if residual is None else norm(x, residual)
            return self.forward(h), new_residual
        return self.quant_method.apply_normed(self, x, residual, norm, self.bias)

    def forward_rms(self, x: torch.Tensor, eps: float) -> torch.Tensor | None:
        """forward(x / rms(x)) in one kernel for a layer whose input norm's weight is folded into
        its own (models/norm_fold.py), where the quant method has one for x; else None."""
        if self.lora_on:
            return None
        return self.quant_method.apply_rms(self, x, eps, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """Copy one checkpoint tensor (whole-model shape) into `param` (this rank, this shard).
        shard None on a fused layer: the checkpoint holds all its shards in one tensor."""
        if self.tp_size > 1:  # tensor parallel: this rank's slice, in the checkpoint's layout
            if shard is None and len(self.output_sizes) > 1:
                parts = split_fused_checkpoint_tensor(self, param, loaded, self.full_output_sizes)
                if parts is not None:  # each shard's rows apart, as if stored apart
                    for index, part in enumerate(parts):
                        self.weight_loader(param, part, index)
                    return
            loaded = shard_checkpoint_tensor(self, param, loaded, shard)
        loaded = materialize(loaded)  # a distributed rank's lazily read tensor, if not sliced
        if self.checkpoint_transposed and loaded.dim() == 2:
            loaded = loaded.t()
        custom = getattr(param, "weight_loader", None)
        if custom is not None:
            custom(param, loaded, shard)
            return
        dest = param.data
        out_dim = getattr(param, "output_dim", None)
        if shard is not None:
            if out_dim is None:
                raise ValueError("a fused layer's per-shard parameter needs a custom weight_loader")
            offset = sum(self.output_sizes[:shard])
            dest = dest.narrow(out_dim, offset, self.output_sizes[shard])
        if dest.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs "
                             f"parameter slice {tuple(dest.shape)}")
        dest.copy_(loaded)

    def tp_shard_position(self, shard: int | None) -> tuple[int, int]:
        """(index, parts): this rank holds part `index` of a checkpoint tensor cut in `parts`."""
        return self.tp_rank, self.tp_size


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; no communication in forward."""

    tp_split = "output"

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype,
                 quant_method: QuantMethod | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__(input_size, [output_size // tp_size], bias, params_dtype, quant_method,
                         tp_size, tp_rank)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices stacked along the output dim (gate_up, qkv)."""

    tp_split = "output"

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 params_dtype: torch.dtype, quant_method: QuantMethod | None = None,
                 tp_size: int = 1, tp_rank: int = 0):
        super().__init__(input_size, [s // tp_size for s in output_sizes], bias, params_dtype,
                         quant_method, tp_size, tp_rank)


    def forward_gate_out(self, x: torch.Tensor, rms_eps: float = 0.0) -> torch.Tensor | None:
        """A [gate | up] layer: silu_and_mul(forward(x)) in one kernel where the quant method
        has one for x (QuantMethod.apply_gate_out), else None. Each rank holds [gate | up] of its
        own shard, so the activation stays rank-local as in the unfused path. rms_eps > 0: of
        x / rms(x), as forward_rms."""
        if self.lora_on:  # the adapter's delta goes in before the activation
            return None
        return self.quant_method.apply_gate_out(self, x, self.bias, rms_eps)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q, k, v projection: shards 0, 1, 2 of sizes Hq*D, Hkv*D, Hkv*D (this rank's heads;
    with fewer KV heads than ranks each rank holds one KV head, replicated)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, params_dtype: torch.dtype, quant_method: QuantMethod | None = None,
                 tp_size: int = 1, tp_rank: int = 0):
        self.num_kv_heads = num_kv_heads
        kv = kv_heads_per_rank(num_kv_heads, tp_size) * head_dim
        sizes = [num_heads // tp_size * head_dim, kv, kv]
        LinearBase.__init__(self, hidden_size, sizes, bias, params_dtype, quant_method,
                            tp_size, tp_rank)
        self.full_output_sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2

    def tp_shard_position(self, shard: int | None) -> tuple[int, int]:
        if shard in (1, 2):
            return kv_shard_position(self.tp_rank, self.tp_size, self.num_kv_heads)
        return self.tp_rank, self.tp_size


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; partial sums are all-reduced (bias added once, after)."""

    tp_split = "input"

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype,
                 quant_method: QuantMethod | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__(input_size // tp_size, [output_size], bias, params_dtype, quant_method,
                         tp_size, tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        y = parallel_state.tp_all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """forward(x) + residual, the add inside the product's kernel where the quant method
        can (QuantMethod.apply_residual: one row, no bias), after the all-reduce otherwise."""
        if self.tp_size == 1 and not self.lora_on:
            y = self.quant_method.apply_residual(self, x, residual, self.bias)
            if y is not None:
                return y
        return self.forward(x) + residual

    def forward_gated(self, gate_up: torch.Tensor, act) -> torch.Tensor:
        """forward(act(gate_up)), letting the quant method fuse the activation into its kernel."""
        if self.lora_on:
            return self.forward(act(gate_up))
        if self.tp_size == 1:
            return self.quant_method.apply_gated(self, gate_up, self.bias, act)
        y = parallel_state.tp_all_reduce(self.quant_method.apply_gated(self, gate_up, None, act))
        return y if self.bias is None else y + self.bias
