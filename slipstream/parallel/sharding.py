"""How a model splits across tensor-parallel ranks and pipeline stages.

Heads, the MLP's intermediate size and the vocabulary split across tensor ranks; KV heads split
too, and are replicated when there are fewer of them than ranks (each rank keeps whole heads:
rank r holds KV head r // (tp / num_kv_heads)). Decoder layers split into contiguous pipeline
stages. Each rank reads only its slice of a checkpoint tensor (`shard_checkpoint_tensor`).
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.config import ModelConfig
from slipstream.parallel.checkpoint_slices import checkpoint_part, materialize


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    if num_kv_heads >= tp_size:
        return num_kv_heads // tp_size
    return 1


def kv_shard_position(tp_rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """(index, parts): this rank holds part `index` of the KV heads cut into `parts` parts."""
    if num_kv_heads >= tp_size:
        return tp_rank, tp_size
    return tp_rank // (tp_size // num_kv_heads), num_kv_heads


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError unless the model's heads and MLP split evenly across tp_size ranks."""
    if tp_size == 1:
        return
    problems = []
    if cfg.num_attention_heads % tp_size:
        problems.append(f"{cfg.num_attention_heads} attention heads")
    hkv = cfg.num_key_value_heads
    if (hkv >= tp_size and hkv % tp_size) or (hkv < tp_size and tp_size % hkv):
        problems.append(f"{hkv} KV heads (a multiple or a divisor of the ranks)")
    if cfg.intermediate_size % tp_size:
        problems.append(f"intermediate size {cfg.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp_size} does not split {cfg.architecture}: "
                         + ", ".join(problems) + " must divide evenly across the ranks")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the decoder layers on stage pp_rank: contiguous, sizes differing by at
    most one (earlier stages take the extra layers; the last also holds the norm and head)."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} "
                         "decoder layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def vocab_shard(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's vocabulary slice; the last rank's slice is
    padded past the vocabulary with zero rows (logits cut back to vocab_size after the gather)."""
    rows = -(-vocab_size // tp_size)
    return tp_rank * rows, rows


def vocab_rows(full: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a [vocab, hidden] table, zero past its end."""
    part = full[start:start + rows]
    if part.shape[0] == rows:
        return part
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


# ---- checkpoint tensors -> this rank's slice ---------------------------------------------

# int4 AWQ / GPTQ checkpoints store [K, N]-shaped tensors (input dim first).
_INPUT_FIRST_LAYOUTS = ("awq", "gptq")
_INPUT_FIRST_TENSORS = ("qweight", "qzeros", "scales")
_COLUMN_ORDER_TENSORS = ("g_idx", "weight_g_idx")  # [K]: the group of each input column


def shard_checkpoint_tensor(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                            shard: int | None) -> torch.Tensor:
    """The part of a whole-model checkpoint tensor that this rank's `param` holds, in the
    checkpoint's own layout, so the parameter's loader (which sees this rank's sizes) takes it
    as at tensor_parallel_size 1. Scales of one element and dims of size 1 are not split."""
    leaf = _param_name(layer, param)
    index, parts = layer.tp_shard_position(shard)
    if leaf == "weight_shape":  # compressed-tensors: the module's [N, K]; this rank's instead
        return _local_weight_shape(layer, materialize(loaded), parts)
    dim = _split_dim(layer, param, leaf, loaded)
    if dim is None:
        return materialize(loaded)
    if loaded.shape[dim] % parts:
        raise ValueError(f"{leaf}: dim {dim} of size {loaded.shape[dim]} does not split "
                         f"across {parts} tensor-parallel ranks")
    size = loaded.shape[dim] // parts
    part = loaded.narrow(dim, index * size, size)
    if leaf in _COLUMN_ORDER_TENSORS:  # contiguous groups (act order refuses K splits)
        part = part - part.min()
    return part


def split_fused_checkpoint_tensor(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                                  shard_sizes: list[int]) -> list[torch.Tensor] | None:
    """A checkpoint tensor that holds a fused layer's shards back to back (Phi-3's qkv_proj
    and gate_up_proj, GPT-2's c_attn) cut into one part per shard, whole-model sized and not
    read yet, so each rank then takes its rows of each shard as from separate tensors.
    shard_sizes: the shards' whole-model output sizes; a packed tensor (int4's eight values
    an int32) is cut in proportion. None: the tensor is not split by output (a scale of one
    element), so it loads as it is."""
    dim = _split_dim(layer, param, _param_name(layer, param), loaded)
    if dim is None or layer.tp_split != "output":
        return None
    total, whole = loaded.shape[dim], sum(shard_sizes)
    if any(total * size % whole for size in shard_sizes):
        raise ValueError(f"dim {dim} of size {total} does not split into fused shards of "
                         f"sizes {shard_sizes}")
    parts, start = [], 0
    for size in shard_sizes:
        length = total * size // whole
        parts.append(checkpoint_part(loaded, dim, start, length))
        start += length
    return parts


def _split_dim(layer: nn.Module, param: nn.Parameter, leaf: str,
               loaded: torch.Tensor) -> int | None:
    split = layer.tp_split
    if split is None or loaded.numel() == 1:
        return None
    transposed = getattr(layer, "checkpoint_transposed", False) and loaded.dim() == 2
    if getattr(param, "weight_loader", None) is None:  # stored as the checkpoint stores it
        dim = getattr(param, f"{split}_dim", None)
        return 1 - dim if transposed and dim is not None else dim  # GPT-2's Conv1D: [in, out]
    if leaf in _COLUMN_ORDER_TENSORS:
        return 0 if split == "input" else None
    dim = 0 if split == "output" else 1
    layout = getattr(layer.quant_method, "layout", None)
    if layout in _INPUT_FIRST_LAYOUTS and leaf in _INPUT_FIRST_TENSORS:
        dim = 1 - dim
    elif transposed:
        dim = 1 - dim
    if loaded.dim() <= dim or loaded.shape[dim] == 1:
        return None
    return dim


def _local_weight_shape(layer: nn.Module, loaded: torch.Tensor, parts: int) -> torch.Tensor:
    n, k = (int(v) for v in loaded.reshape(-1)[:2])
    if layer.tp_split == "output":
        n //= parts
    else:
        k //= parts
    return torch.tensor([n, k], dtype=loaded.dtype).reshape(loaded.shape)


def _param_name(layer: nn.Module, param: nn.Parameter) -> str:
    for name, p in layer.named_parameters(recurse=False):
        if p is param:
            return name
    return ""
