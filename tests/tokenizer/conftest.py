"""Fixtures: the session's tiny tokenizer (tiny_tokenizer_dir, tests/conftest.py), loaded."""
from __future__ import annotations

import pytest

from slipstream.tokenizer.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return load_tokenizer(tiny_tokenizer_dir)
