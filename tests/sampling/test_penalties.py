"""Penalties and min_tokens change logits exactly as specified (hand-computed values)."""
from __future__ import annotations

import torch

from slipstream.engine.request import Request
from slipstream.sampling.penalties import (
    apply_penalties,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    mask_min_tokens,
    token_counts,
)
from slipstream.sampling.sampler import Sampler
from slipstream.sampling_params import SamplingParams

NEG_INF = float("-inf")


def req(prompt, output, eos=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), eos_token_ids=tuple(eos))
    r.output_token_ids = list(output)
    return r


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0]], 5, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    # Prompt has token 0 and 1, output has token 3 (twice: set semantics, one application).
    r = req(prompt=[0, 1], output=[3, 3], repetition_penalty=2.0)
    apply_penalties(logits, [r])
    assert logits.tolist() == [[1.0, -4.0, 3.0, -2.0, 0.5]]


def test_presence_and_frequency_hand_computed():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    # Prompt tokens do not count for presence / frequency (OpenAI semantics).
    r = req(prompt=[0, 0, 0], output=[1, 2, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [r])
    expected = [1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75, 1.0]
    assert torch.allclose(logits, torch.tensor([expected]))


def test_negative_presence_frequency_encourage():
    logits = torch.zeros(1, 3)
    apply_presence_frequency_penalties(
        logits, torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([-1.0]), torch.tensor([-0.5])
    )
    assert logits.tolist() == [[0.0, 1.5, 2.0]]


def test_all_penalties_together_only_touch_their_rows():
    logits = torch.tensor([[2.0, -1.0, 4.0], [2.0, -1.0, 4.0], [2.0, -1.0, 4.0]])
    reqs = [
        req([0], [2], repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5),
        req([0], [2]),  # no penalties: untouched
        req([1], [], repetition_penalty=0.5),  # < 1 rewards repetition
    ]
    apply_penalties(logits, reqs)
    # Row 0: rep on {0, 2} -> [1, -1, 2]; then token 2 (count 1) -= 1 + 0.5.
    assert logits.tolist() == [[1.0, -1.0, 0.5], [2.0, -1.0, 4.0], [2.0, -0.5, 4.0]]


def test_functional_forms_batched():
    logits = torch.tensor([[1.0, -1.0], [3.0, -3.0]])
    seen = torch.tensor([[True, True], [False, True]])
    apply_repetition_penalty(logits, seen, torch.tensor([2.0, 3.0]))
    assert logits.tolist() == [[0.5, -2.0], [3.0, -9.0]]


def test_min_tokens_mask():
    logits = torch.zeros(3, 6)
    reqs = [
        req([1], [], eos=(2, 3), min_tokens=1, stop_token_ids=[4]),
        req([1], [5], eos=(2,), min_tokens=1),  # already has enough tokens
        req([1], [5], eos=(2, 99), min_tokens=3),  # id 99 is outside this vocab: ignored
    ]
    mask_min_tokens(logits, reqs)
    inf_cols = [[j for j, v in enumerate(row) if v == NEG_INF] for row in logits.tolist()]
    assert inf_cols == [[2, 3, 4], [], [2]]


def test_sampler_applies_penalties_before_greedy_argmax():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    # Token 0 was generated: 5 / 2 = 2.5 < 4, so greedy picks token 1.
    r = req([2], [0], repetition_penalty=2.0, temperature=0.0)
    assert Sampler()(logits, [r]).token_ids == [1]
    r2 = req([2], [0, 0], frequency_penalty=0.6, temperature=0.0)  # 5 - 1.2 = 3.8 < 4
    assert Sampler()(logits, [r2]).token_ids == [1]
