"""Test-wide setup: GPU tests are skipped where no CUDA device exists."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when a kernel module is imported: decide first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
