"""Kernel tests run Triton's interpreter on the CPU: TRITON_INTERPRET must be set before triton loads.

GPU tests (`-m gpu`) are skipped when CUDA is absent.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill every fresh torch.empty / empty_like with NaN (or 77 for integers), so that an
    output element a kernel forgets to write cannot pass by holding a stale correct value."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def _poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else 77)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _poison(real_empty_like(*a, **kw)))
