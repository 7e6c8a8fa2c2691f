"""The host tier's cost model (copy or recompute) and its batched copies (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.kv_cache.tier_cost import TierCost
from slipstream.runner.host_copies import HostKVCopies, _runs


def _cost(block_bytes: int, copy_rate: float, flops_rate: float, linear: float) -> TierCost:
    return TierCost(
        block_size=16,
        block_bytes=block_bytes,
        copy_bytes_per_s=copy_rate,
        flops_per_s=flops_rate,
        linear_flops_per_token=linear,
        attention_flops_per_position=4.0 * 8 * 8 * 32,
    )


def test_tiny_model_recomputes_and_a_large_one_copies():
    # A 6.6 M-parameter model (64 KiB a block) on an H100-like device: 16 tokens are 0.2
    # GFLOP, about 1 us, while the copy takes about 3 us: recompute, and never offload.
    tiny = _cost(64 << 10, 20e9, 200e12, 2 * 5.5e6)
    assert tiny.recompute_seconds(1, 0) < tiny.copy_seconds(1)
    assert not tiny.restore_pays(4, 0) and not tiny.swap_pays(4096)
    assert not tiny.ever_pays(1024)
    # An 8 B Llama (2 MiB a block, 16 GFLOP a token): copies win from the first block on.
    big = TierCost(
        block_size=16,
        block_bytes=2 << 20,
        copy_bytes_per_s=20e9,
        flops_per_s=400e12,
        linear_flops_per_token=2 * 7e9,
        attention_flops_per_position=4.0 * 32 * 32 * 128,
    )
    assert big.restore_pays(1, 0) and big.swap_pays(16) and big.ever_pays(1024)
    assert not big.restore_pays(0, 0) and not big.swap_pays(15)  # no whole block, nothing to copy


def test_deep_positions_tip_the_choice_to_copying():
    """Recomputing a block costs more the more positions its tokens attend to; a copy costs
    the same anywhere. Restoring pays only from some depth on, and swapping (two copies, from
    position 0) needs more depth than restoring at the end."""
    cost = _cost(64 << 10, 20e9, 100e12, 2 * 5.5e6)
    assert cost.restore_pays(1, 2000) and not cost.restore_pays(1, 0)
    crossover = next(p for p in range(0, 4096, 16) if cost.restore_pays(1, p))
    assert (
        cost.recompute_seconds(1, crossover)
        > cost.copy_seconds(1)
        >= cost.recompute_seconds(1, crossover - 16)
    )
    assert cost.ever_pays(crossover + 16) and not cost.ever_pays(crossover)
    assert cost.restore_pays(3, crossover) and not cost.restore_pays(3, 0)
    assert not cost.swap_pays(crossover) and cost.swap_pays(16384)
    with pytest.raises(ValueError, match="positive"):
        _cost(1, 0.0, 1.0, 1.0)


def test_runs_of_consecutive_host_blocks():
    assert _runs([4, 5, 6, 2, 3, 9]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1)]
    assert _runs([]) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batched_copies_equal_one_copy_at_a_time(device):
    """Random transfer lists, conflicts included (an offload of a block a restore just wrote,
    a host block reused after a restore read it): the batched copies leave device and host
    memory exactly as copying each transfer in order does (on CUDA: pinned host memory,
    offloads on the side stream)."""
    rng = random.Random(0)
    layers, dev_blocks, host_blocks, shape = 3, 12, 10, (4, 2, 8)
    kv = [
        (torch.randn(dev_blocks, *shape, device=device), torch.randn(dev_blocks, *shape, device=device))
        for _ in range(layers)
    ]
    copies = HostKVCopies(kv, host_blocks)
    copies.max_batch = 3  # several staging batches per flush
    copies.host.normal_()
    ref_dev = [(k.clone(), v.clone()) for k, v in kv]
    ref_host = copies.host.clone()
    for _ in range(20):
        transfers = [
            ("out", rng.randrange(dev_blocks), rng.randrange(host_blocks))
            if rng.random() < 0.5
            else ("in", rng.randrange(host_blocks), rng.randrange(dev_blocks))
            for _ in range(rng.randrange(1, 9))
        ]
        copies.apply(transfers)
        for kind, src, dst in transfers:
            for layer, (k, v) in enumerate(ref_dev):
                if kind == "out":
                    ref_host[dst, layer, 0] = k[src].cpu()
                    ref_host[dst, layer, 1] = v[src].cpu()
                else:
                    k[dst] = ref_host[src, layer, 0].to(device)
                    v[dst] = ref_host[src, layer, 1].to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(copies.host, ref_host)
        for (k, v), (rk, rv) in zip(kv, ref_dev):
            assert torch.equal(k, rk) and torch.equal(v, rv)
