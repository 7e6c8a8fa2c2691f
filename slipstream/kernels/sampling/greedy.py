"""Greedy token choice on the device: row argmax, and the multi-step decode advance fused in.

torch.argmax over a 128k vocabulary row runs as one slow reduction (tens of microseconds per
decode step); here each program reduces a chunk and a second launch reduces the chunks. The
second launch can also feed the token back as the next step's input and advance position,
sequence length and KV slot, which otherwise take half a dozen small launches per step.
Ties resolve to the smallest index, as in torch.argmax. Twin: reference.argmax_and_advance.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

_CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, stride_x, vals_ptr, idx_ptr, V, CHUNKS, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, offs, V), 0)
    tl.store(vals_ptr + row * CHUNKS + c, m)
    tl.store(idx_ptr + row * CHUNKS + c, first)


@triton.jit
def _final_argmax_kernel(vals_ptr, idx_ptr, out_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr,
                         bt_ptr, stride_bt, V, CHUNKS, CHUNKS_P: tl.constexpr,
                         ADVANCE: tl.constexpr, PAGE: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_P)
    ok = offs < CHUNKS
    v = tl.load(vals_ptr + row * CHUNKS + offs, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * CHUNKS + offs, mask=ok, other=V)
    m = tl.max(v, 0)
    # Clamped: a row of NaNs must still give a valid token id (garbage in, no crash out).
    tok = tl.minimum(tl.min(tl.where(v == m, i, V), 0), V - 1).to(tl.int64)
    tl.store(out_ptr + row, tok)
    if ADVANCE:  # the chosen token becomes the next step's input, one position further on
        tl.store(ids_ptr + row, tok)
        pos = tl.load(pos_ptr + row) + 1
        tl.store(pos_ptr + row, pos)
        tl.store(lens_ptr + row, tl.load(lens_ptr + row) + 1)
        block = tl.load(bt_ptr + row * stride_bt + pos // PAGE).to(tl.int64)
        tl.store(slot_ptr + row, block * PAGE + pos % PAGE)


def _partials(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    rows, vocab = x.shape
    chunks = triton.cdiv(vocab, _CHUNK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, x.stride(0), vals, idx, vocab, chunks, BLOCK=_CHUNK,
                                         num_warps=8, **pdl.launch_kwargs(x.device))
    return vals, idx, chunks


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [rows, vocab] (int64 result, optionally into out)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, vocab = x.shape
    out = out if out is not None else torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    vals, idx, chunks = _partials(x)
    _final_argmax_kernel[(rows,)](vals, idx, out, out, out, out, out, out, 0, vocab, chunks,
                                  CHUNKS_P=triton.next_power_of_2(chunks), ADVANCE=False, PAGE=1,
                                  **pdl.launch_kwargs(x.device))
    return out


def argmax_and_advance(logits: torch.Tensor, out: torch.Tensor, input_ids: torch.Tensor,
                       positions: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, block_size: int) -> None:
    """out = argmax rows; then input_ids = out, positions += 1, seq_lens += 1 and slot_mapping
    = the slot of the new position in block_tables (first len(out) rows of each buffer)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    if rows == 0:
        return
    vals, idx, chunks = _partials(logits)
    _final_argmax_kernel[(rows,)](vals, idx, out, input_ids, positions, seq_lens, slot_mapping,
                                  block_tables, block_tables.stride(0), vocab, chunks,
                                  CHUNKS_P=triton.next_power_of_2(chunks), ADVANCE=True,
                                  PAGE=block_size, **pdl.launch_kwargs(logits.device))

