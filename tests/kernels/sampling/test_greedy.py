"""Device greedy choice (kernels/sampling/greedy.py) against torch.argmax and the torch advance twin."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.sampling import greedy
from slipstream.runner.cuda_graphs import argmax_and_advance_reference


def _logits(rows: int, vocab: int, device: str = "cpu") -> torch.Tensor:
    x = torch.randn(rows, vocab, device=device)
    x[0, vocab // 3] = x[0, vocab - 1] = 50.0  # a tie: the first index must win
    return x


@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 9000), (2, 4096)])
def test_argmax_rows_matches_torch(rows: int, vocab: int) -> None:
    x = _logits(rows, vocab)
    got = greedy.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x, dim=-1))
    assert got[0].item() == vocab // 3


def _buffers(n: int, blocks: int, page: int, device: str = "cpu"):
    ids = torch.zeros(n + 2, dtype=torch.int64, device=device)  # padded like the graph buffers
    pos = torch.tensor([5, page - 1, 3 * page + 2][:n] + [0, 0], dtype=torch.int64, device=device)
    lens = pos[: n + 2].to(torch.int32) + 1
    slots = torch.full((n + 2,), -1, dtype=torch.int64, device=device)
    tables = torch.randperm((n + 2) * blocks, device=device)
    tables = tables.reshape(n + 2, blocks).to(torch.int32)
    return ids, pos, lens, slots, tables


@pytest.mark.parametrize("n", [1, 3])
def test_argmax_and_advance_matches_twin(n: int) -> None:
    page, vocab = 16, 6000
    logits = _logits(n, vocab)
    want_bufs = _buffers(n, 8, page)
    got_bufs = tuple(b.clone() for b in want_bufs)
    want_out = torch.empty(n, dtype=torch.int64)
    got_out = torch.empty(n, dtype=torch.int64)
    argmax_and_advance_reference(logits, want_out, *want_bufs, page)
    greedy.argmax_and_advance(logits, got_out, *got_bufs, page)
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_bufs, want_bufs, strict=True):
        assert torch.equal(got, want)
    assert got_bufs[3][n:].eq(-1).all()  # padding rows untouched


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 512])
def test_gpu_argmax_rows(rows: int) -> None:
    x = _logits(rows, 128256, "cuda").to(torch.bfloat16).float()
    assert torch.equal(greedy.argmax_rows(x), torch.argmax(x, dim=-1))
