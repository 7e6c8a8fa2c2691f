"""top_logprobs: the given token's logprob plus the top-k, in rank order, exact values."""
from __future__ import annotations

import pytest
import torch

from slipstream.sampling.logprobs import pack_top_logprobs, top_logprobs, unpack_top_logprobs


def test_top_logprobs_values_and_order():
    logprobs = torch.log_softmax(torch.randn(5, 30, generator=torch.Generator().manual_seed(0)), -1)
    tokens = [0, 7, 29, 3, 3]
    rows = top_logprobs(logprobs, tokens, 3)
    for i, d in enumerate(rows):
        top = torch.topk(logprobs[i], 3).indices.tolist()
        assert list(d)[:3] == top
        assert set(d) == set(top) | {tokens[i]}
        for t, v in d.items():
            assert v == logprobs[i, t].item()  # float64 transfer keeps float32 values exactly


def test_k_zero_tensor_ids_and_empty():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), -1)
    assert top_logprobs(logprobs, torch.tensor([1]), 0) == [{1: logprobs[0, 1].item()}]
    assert top_logprobs(logprobs[:0], [], 2) == []
    with pytest.raises(ValueError):
        top_logprobs(logprobs, [1, 2], 1)


def test_unpack_per_row_k():
    logprobs = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2), -1)
    packed = pack_top_logprobs(logprobs, torch.tensor([3, 0]), 3).tolist()
    rows = unpack_top_logprobs(packed, ks=[1, 2])
    assert list(rows[0]) == [0, 3] and list(rows[1]) == [0, 1]
