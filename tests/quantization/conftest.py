"""Quantization tests: shared prompts (Triton's interpreter and the `gpu` skip are set up in
tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four random 8-token prompts (test modules may define their own)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (8,), generator=g).tolist() for _ in range(4)]
