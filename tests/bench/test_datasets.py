"""The benchmark request generators: W5 exactly as BENCHMARKS.md defines it, random prompts."""
from __future__ import annotations

import random

import pytest

from slipstream.bench.datasets import (
    make_requests,
    random_requests,
    safe_token_range,
    w5_lengths,
    w5_requests,
)


def _documented_w5() -> list[tuple[int, int]]:
    # BENCHMARKS.md, word for word: random.seed(0), then per request randint(100, 1024) for the
    # input length and again for the output length.
    random.seed(0)
    out = []
    for _ in range(256):
        input_len = random.randint(100, 1024)
        output_len = random.randint(100, 1024)
        out.append((input_len, output_len))
    return out


def test_w5_lengths_reproduce_the_documented_procedure():
    lengths = w5_lengths()
    assert lengths == _documented_w5()
    assert len(lengths) == 256
    assert lengths[:3] == [(964, 494), (876, 1011), (530, 141)]  # pinned: fails if the stream moves
    assert sum(o for _, o in lengths) == 140797
    assert all(100 <= i <= 1024 and 100 <= o <= 1024 for i, o in lengths)


def test_w5_requests_carry_those_lengths_whatever_the_vocab():
    for vocab in (512, 151936):
        reqs = w5_requests(vocab)
        assert [(r.input_len, r.output_len) for r in reqs] == _documented_w5()
        low, high = safe_token_range(vocab)
        assert all(low <= t < high for r in reqs[:8] for t in r.prompt_token_ids)


def test_random_requests_fixed_lengths_safe_ids_and_seeded():
    reqs = random_requests(50, 33, 7, vocab_size=128256, seed=3)
    assert len(reqs) == 50
    assert all(r.input_len == 33 and r.output_len == 7 for r in reqs)
    ids = [t for r in reqs for t in r.prompt_token_ids]
    low, high = safe_token_range(128256)
    assert min(ids) >= low and max(ids) < high < 128000  # Llama-3 specials start at 128000
    assert len(set(ids)) > 1000  # really spread over the range
    again = random_requests(50, 33, 7, vocab_size=128256, seed=3)
    other = random_requests(50, 33, 7, vocab_size=128256, seed=4)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_safe_range_avoids_qwen_specials_and_works_for_tiny_vocabs():
    assert safe_token_range(151936)[1] <= 151643
    low, high = safe_token_range(16)
    assert 0 <= low < high <= 16


def test_make_requests_dispatch_and_errors():
    assert len(make_requests("w5", num_requests=None, input_len=1, output_len=1,
                             vocab_size=512)) == 256
    reqs = make_requests("random", num_requests=3, input_len=4, output_len=2, vocab_size=512)
    assert [(r.input_len, r.output_len) for r in reqs] == [(4, 2)] * 3
    with pytest.raises(ValueError, match="unknown dataset"):
        make_requests("sharegpt", num_requests=1, input_len=1, output_len=1, vocab_size=512)
    with pytest.raises(ValueError):
        random_requests(0, 4, 2, 512)
