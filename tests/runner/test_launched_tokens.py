"""LaunchedTokens: a launched step's token ids read back without waiting for later GPU work."""
from __future__ import annotations

import time

import pytest
import torch

from slipstream.runner.launched import LaunchedTokens


def test_cpu_tokens_read_as_lists() -> None:
    tokens = torch.tensor([[1, 2], [3, 4], [5, 6]])  # [steps, seqs]
    launched = LaunchedTokens(tokens)
    assert launched.on_device is tokens
    assert launched.host().tolist() == [[1, 2], [3, 4], [5, 6]]
    assert launched.host().T.tolist() == [[1, 3, 5], [2, 4, 6]]  # per sequence, as collected


@pytest.mark.gpu
def test_gpu_read_does_not_wait_for_work_queued_after() -> None:
    tokens = torch.arange(6, device="cuda").view(3, 2)
    launched = LaunchedTokens(tokens)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued behind the copy
    tokens.zero_()  # later work that overwrites the device tensor: the copy came before it
    start = time.perf_counter()
    values = launched.host().tolist()
    waited = time.perf_counter() - start
    assert values == [[0, 1], [2, 3], [4, 5]]
    assert waited < 0.3, f"the read waited {waited:.2f} s: it synchronised the whole stream"
    plain_start = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)
    assert tokens.tolist() == [[0, 0]] * 3  # a plain read waits for everything queued
    assert time.perf_counter() - plain_start > 0.3
