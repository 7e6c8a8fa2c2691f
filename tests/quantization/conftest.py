"""Quantization tests: shared prompts and output poisoning (Triton's interpreter and the `gpu`
skip are set up in tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four random 8-token prompts (test modules may define their own)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (8,), generator=g).tolist() for _ in range(4)]


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh torch.empty tensors hold NaN, so an output element a kernel skips cannot pass."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
