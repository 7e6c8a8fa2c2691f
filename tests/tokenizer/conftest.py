"""Fixtures: tiny tokenizer directories built once per test session."""
from __future__ import annotations

import pytest

from slipstream.tokenizer.tokenizer import Tokenizer, load_tokenizer
from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok_bos"), add_bos=True, eos_extra=5)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return load_tokenizer(tokenizer_dir)
