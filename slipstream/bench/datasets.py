"""Synthetic benchmark requests: fixed-length random prompts and the W5 mixed workload.

Prompts are token ids drawn uniformly from a range that avoids the low ids and the top of the
vocabulary, where special tokens live. Lengths and token ids come from separate seeded streams,
so the W5 lengths are exactly BENCHMARKS.md's sequence whatever the vocabulary.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

W5_NUM_REQUESTS = 256
W5_MIN_LEN = 100
W5_MAX_LEN = 1024
DATASETS = ("random", "w5")


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def safe_token_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of ids to draw: skip the first ids and the top tenth (special tokens)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    low = min(100, vocab_size // 8)
    high = max(low + 1, int(vocab_size * 0.9))
    return low, high


def w5_lengths(num_requests: int = W5_NUM_REQUESTS, seed: int = 0) -> list[tuple[int, int]]:
    """(input_len, output_len) per request: `random.seed(seed)`, then for each request
    `randint(100, 1024)` for the input and again for the output (BENCHMARKS.md, W5)."""
    rng = random.Random(seed)  # same stream as the global random after random.seed(seed)
    lengths = []
    for _ in range(num_requests):
        input_len = rng.randint(W5_MIN_LEN, W5_MAX_LEN)
        output_len = rng.randint(W5_MIN_LEN, W5_MAX_LEN)
        lengths.append((input_len, output_len))
    return lengths


def _prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    low, high = safe_token_range(vocab_size)
    rng = np.random.default_rng(seed)
    ids = rng.integers(low, high, size=sum(lengths), dtype=np.int64)
    prompts, start = [], 0
    for n in lengths:
        prompts.append(ids[start:start + n].tolist())
        start += n
    return prompts


def random_requests(num_requests: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:
    """`num_requests` prompts of exactly `input_len` random ids, each asking `output_len`."""
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_requests, input_len and output_len must be positive")
    prompts = _prompts([input_len] * num_requests, vocab_size, seed)
    return [BenchRequest(p, output_len) for p in prompts]


def w5_requests(vocab_size: int, num_requests: int = W5_NUM_REQUESTS,
                seed: int = 0) -> list[BenchRequest]:
    """The W5 mixed workload (lengths from `w5_lengths`, random prompt ids)."""
    lengths = w5_lengths(num_requests, seed)
    prompts = _prompts([i for i, _ in lengths], vocab_size, seed + 1)
    return [BenchRequest(p, o) for p, (_, o) in zip(prompts, lengths)]


def make_requests(dataset: str, *, num_requests: int | None, input_len: int, output_len: int,
                  vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """Dispatch on `--dataset`; W5 defaults to its documented 256 requests."""
    if dataset == "random":
        return random_requests(num_requests or 1000, input_len, output_len, vocab_size, seed)
    if dataset == "w5":
        return w5_requests(vocab_size, num_requests or W5_NUM_REQUESTS, seed)
    raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
