"""Quantization tests: the Triton kernels run in Triton's interpreter when there is no GPU
(TRITON_INTERPRET must be set before triton loads); `-m gpu` tests need CUDA."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


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
