"""Top-k, top-p and min-p: the sampler never emits a token outside the allowed set (many
draws), the allowed sets match hand-computed ones, and neutral rows are left untouched."""
from __future__ import annotations

import pytest
import torch

from slipstream.engine.request import Request
from slipstream.sampling.sampler import Sampler
from slipstream.sampling.topk_topp import apply_min_p, apply_top_k, apply_top_k_top_p
from slipstream.sampling_params import SamplingParams

V = 50
DRAWS = 4000


def draw(logits_row: torch.Tensor, **params) -> set[int]:
    """Tokens sampled for DRAWS copies of one row in one batch (unseeded, shared generator)."""
    reqs = [Request(f"r{i}", [0], SamplingParams(**params)) for i in range(DRAWS)]
    out = Sampler(seed=0)(logits_row.expand(DRAWS, -1).contiguous(), reqs)
    return set(out.token_ids)


def row(seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 2


def allowed_top_p(logits: torch.Tensor, p: float, temperature: float = 1.0) -> set[int]:
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return set(kept)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_never_outside(k):
    logits = row(k)
    allowed = set(torch.topk(logits, k).indices.tolist())
    seen = draw(logits, top_k=k, temperature=2.0)
    assert seen <= allowed
    if k > 1:
        assert len(seen) == k  # with 4000 draws at T=2 every allowed token shows up


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_top_p_never_outside(p):
    logits = row(int(p * 10))
    allowed = allowed_top_p(logits, p, temperature=1.5)
    seen = draw(logits, top_p=p, temperature=1.5)
    assert seen <= allowed and len(seen) > 1


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_never_outside(min_p):
    logits = row(int(min_p * 100))
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    seen = draw(logits, min_p=min_p)
    assert seen <= allowed and len(seen) > 1


def test_top_k_then_top_p_combined():
    logits = row(7)
    k, p = 8, 0.5
    top = torch.topk(logits, k).indices
    restricted = torch.full_like(logits, float("-inf"))
    restricted[top] = logits[top]
    allowed = allowed_top_p(restricted, p)
    assert draw(logits, top_k=k, top_p=p) <= allowed


def test_top_p_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(3, -1)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.4, 0.75, 0.85]))
    finite = torch.isfinite(out).tolist()
    # The smallest most-likely set whose mass reaches p: 0.5 | 0.5 + 0.3 | 0.5 + 0.3 + 0.15.
    assert finite == [[True, False, False, False], [True, True, False, False], [True, True, True, False]]


def test_neutral_rows_untouched_and_ties_kept():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 3.0, 0.0]])
    out = apply_top_k(logits, torch.tensor([2, 0]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False], [True] * 4]
    out = apply_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert torch.equal(out, logits)
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0, 0.0])), logits)
    # p == 1 keeps everything even where rounding makes the mass reach 1 early.
    peaked = torch.tensor([[30.0, 0.0, 0.0, 0.0]])
    assert torch.equal(apply_top_k_top_p(peaked, None, torch.tensor([1.0])), peaked)


def test_min_p_hand_computed():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    out = apply_min_p(logits, torch.tensor([0.2]))  # threshold 0.12: drops 0.1
    assert torch.isfinite(out).tolist() == [[True, True, False]]
