"""Token embedding and LM head; the head may share the embedding's weight (tied)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.parallel import state as parallel_state
from slipstream.parallel.checkpoint_slices import materialize
from slipstream.parallel.sharding import vocab_rows, vocab_shard
from slipstream.quantization import fp8, int8_wo, utils
from slipstream.quantization.base import linear_kernels
from slipstream.quantization.int4_awq import int4_linear_kernel
from slipstream.quantization.lm_head import int4_group


class VocabEmbedding(nn.Module):
    """[vocab, hidden] table, allocated uninitialised (the loader fills it). With tp_size > 1
    each rank holds a slice of the rows (sharding.vocab_shard): ids outside it look up zeros,
    and an all-reduce sums the slices."""

    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype,
                 tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.vocab_size, self.tp_size = vocab_size, tp_size
        self.vocab_start, rows = vocab_shard(vocab_size, tp_size, tp_rank)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        if tp_size > 1:
            self.weight.weight_loader = self.load_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return parallel_state.tp_all_reduce(hidden)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """This rank's rows of the whole [vocab, hidden] checkpoint table."""
        param.data.copy_(vocab_rows(loaded, self.vocab_start, param.shape[0]))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        custom = getattr(param, "weight_loader", None)
        if custom is not None:
            custom(param, loaded, shard)
            return
        loaded = materialize(loaded)  # a distributed rank's lazily read tensor
        if param.shape != loaded.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's "
                             f"{tuple(param.shape)}")
        param.data.copy_(loaded)


# Decode rows up to which a CPU float32 head multiplies by its transposed copy (measured faster
# at 1 row, slower from 4: performance-log.md).
CPU_TRANSPOSED_HEAD_MAX_ROWS = 2


def _version(t: torch.Tensor) -> int:
    """t's in-place write count (an inference-mode tensor has none: it cannot be written)."""
    try:
        return t._version
    except RuntimeError:
        return 0


class LMHead(nn.Module):
    """hidden -> float32 logits. With `tied`, reuses the embedding's weight (no copy). With
    tp_size > 1 each rank multiplies its vocabulary slice and the slices are gathered, so every
    rank of the group ends with the whole logits (the padding rows cut off)."""

    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype,
                 tied: VocabEmbedding | None = None, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.full_vocab_size, self.tp_size = vocab_size, tp_size
        self.vocab_start, rows = vocab_shard(vocab_size, tp_size, tp_rank)
        self.vocab_size = rows if tp_size > 1 else vocab_size  # this rank's logits columns
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype),
                                       requires_grad=False)
            if tp_size > 1:
                self.weight.weight_loader = self.load_rows
        self.quantized_linear = None  # set by quantize()
        self.weight_zero = None  # the int4 head's zero points
        self.large_m_rows = 0  # quantized head: vocabulary rows per call above 16 tokens (0: all)
        # CPU float32 decode: the weight transposed ([hidden, vocab]), made on first use, and the
        # (version, address) of the weight it was made from.
        self._cpu_weight_t: torch.Tensor | None = None
        self._cpu_weight_t_of: tuple[int, int] | None = None

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """This rank's rows of the whole [vocab, hidden] checkpoint head."""
        param.data.copy_(vocab_rows(loaded, self.vocab_start, param.shape[0]))

    weight_loader = VocabEmbedding.weight_loader

    def forward(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """float32=False: logits in the model dtype, for a caller that converts them itself
        (the decode graphs copy them into a float32 buffer: one pass over the logits, not two)."""
        if self.quantized_linear is not None:
            logits = self._quantized_logits(hidden)
        elif hidden.is_cuda:  # decode batches: a Triton GEMV where it measured faster than cuBLAS
            logits = linear_kernels().linear(hidden, self.weight)
        else:
            logits = self._cpu_logits(hidden)
        if self.tp_size > 1:
            logits = parallel_state.tp_all_gather_last_dim(logits)[..., :self.full_vocab_size]
        return logits.float() if float32 else logits

    def _cpu_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """F.linear, or for a decode of a few float32 rows hidden @ W^T from a [hidden, vocab]
        copy of the weight: CPU BLAS reads the tall [vocab, hidden] head about half as fast in a
        GEMV as the same bytes laid out by input channel (performance-log.md), and the head is
        a fifth of the default model's bytes. The copy costs the head's size in memory once."""
        w = self.weight
        if hidden.shape[0] > CPU_TRANSPOSED_HEAD_MAX_ROWS or w.dtype != torch.float32 \
                or hidden.dtype != torch.float32:
            return F.linear(hidden, w)
        made_from = (_version(w), w.data_ptr())
        if self._cpu_weight_t is None or self._cpu_weight_t_of != made_from:
            self._cpu_weight_t = w.detach().t().contiguous()
            self._cpu_weight_t_of = made_from
        return hidden @ self._cpu_weight_t

    def _quantized_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        step = rows if hidden.numel() <= 16 * hidden.shape[-1] else self.large_m_rows or rows
        parts = [self.quantized_linear(hidden, *(t[i:i + step] for t in self.quantized_tensors()))
                 for i in range(0, rows, step)]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if logits.shape[-1] != self.vocab_size:  # rows past the vocabulary are padding
            logits = logits[..., :self.vocab_size].contiguous()
        return logits

    def quantized_tensors(self) -> list[torch.Tensor]:
        """What quantized_linear takes after x, row by row: weight, scale (and int4's zeros)."""
        return [self.weight, self.weight_scale] + (
            [self.weight_zero] if self.weight_zero is not None else [])

    @torch.no_grad()
    def quantize(self, method: str, chunk_rows: int = 16384) -> None:
        """Store the head quantized (quantization/lm_head.py's formats) and multiply through
        that format's kernels (the head is ~13% of Llama-3.1-8B's bf16 bytes: what a decode step
        reads). `fp8` / `int8_wo`: one byte per weight with a float32 scale per vocabulary row,
        as those methods store a linear layer; `int4`: int4_awq's layout (groups of 128,
        round-to-nearest). A tied head gets its own quantized copy; the embedding keeps the
        float table. Rows are padded with zeros to a multiple of 16 (what torch._scaled_mm
        takes). Above 16 tokens the int8 and int4 heads run chunk_rows rows at a time (their
        large-batch paths may dequantize the weight for cuBLAS), not the whole head."""
        w = self.weight.data
        w = torch.cat([w, w.new_zeros(-w.shape[0] % 16, w.shape[1])])
        if method == "int4":
            q, scale, zero = utils.quantize_int4_groupwise(w, int4_group(w.shape[1]))
            self.weight = nn.Parameter(utils.pack_int4_rows(q), requires_grad=False)
            self.weight_scale = nn.Parameter(scale.half(), requires_grad=False)
            self.weight_zero = nn.Parameter(zero, requires_grad=False)
        else:
            quantize = {"fp8": utils.quantize_fp8_per_channel,
                        "int8_wo": utils.quantize_int8_per_channel}[method]
            q, scale = quantize(w)  # row by row in bounded chunks (utils.ROW_CHUNK_ELEMENTS)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bind_quantized(method, chunk_rows)

    def bind_quantized(self, method: str, chunk_rows: int = 16384) -> None:
        """Multiply through `method`'s kernels; the quantized tensors are in place already
        (quantize(), or a built engine's weights: build/weights.py)."""
        if method == "int4":
            group = int4_group(2 * self.weight.shape[1])  # two nibbles a byte
            linear = int4_linear_kernel() or _int4_dequantized_linear  # the latter: no Triton
            self.quantized_linear = lambda x, q_, s_, z_: linear(x, q_, s_, z_, group, None)
        else:
            linear = {"fp8": fp8.fp8_linear, "int8_wo": int8_wo.int8_linear}[method]
            self.quantized_linear = lambda x, q_, s_: linear(x, q_, s_, None)
        self.large_m_rows = chunk_rows if method in ("int8_wo", "int4") else 0


def _int4_dequantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                             zeros: torch.Tensor, group: int, bias: None) -> torch.Tensor:
    """The int4 head without Triton: its rows dequantized (in the chunks the head passes), then
    F.linear in float32, in x's dtype."""
    w = utils.dequantize_int4_groupwise(utils.unpack_int4_rows(qweight), scales, zeros,
                                        group_size=group)
    return F.linear(x.float(), w).to(x.dtype)
