"""Sampler: greedy = argmax, seeded rows independent of the batch, the shared generator's
reproducibility, the sampled distribution, min_tokens, logprobs, and CPU/CUDA agreement."""
from __future__ import annotations

import pytest
import torch

from slipstream.engine.request import Request
from slipstream.sampling.sampler import Sampler
from slipstream.sampling_params import SamplingParams

V = 64


def req(i=0, prompt=(1, 2, 3), output=(), eos=(), **params) -> Request:
    r = Request(f"r{i}", list(prompt), SamplingParams(**params), eos_token_ids=tuple(eos))
    r.output_token_ids = list(output)
    return r


def logits_rows(n, seed=0, vocab=V, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=g) * 3).to(device)


def test_empty_batch_and_shape_check():
    out = Sampler()(torch.empty(0, V), [])
    assert out.token_ids == [] and out.logprobs == []
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), [req()])


def test_greedy_is_argmax_and_logits_untouched():
    logits = logits_rows(6)
    before = logits.clone()
    reqs = [req(i, temperature=0.0, repetition_penalty=1.5 if i == 0 else 1.0) for i in range(6)]
    out = Sampler(seed=0)(logits, reqs)
    assert out.token_ids[1:] == logits[1:].argmax(-1).tolist()
    assert out.logprobs == [None] * 6
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows():
    logits = logits_rows(8)
    reqs = [req(i, temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    out = Sampler(seed=1)(logits, reqs)
    assert out.token_ids[1::2] == logits[1::2].argmax(-1).tolist()
    assert all(0 <= t < V for t in out.token_ids)


def _seeded_tokens(batch_sizes, steps=12, seed=1234, **params):
    """The seeded request's tokens over `steps` steps, each step in a batch of a given size."""
    target = req(99, seed=seed, temperature=0.8, **params)
    tokens = []
    for step in range(steps):
        size = batch_sizes[step % len(batch_sizes)]
        others = [req(i, temperature=1.3, top_p=0.9) for i in range(size)]
        pos = step % (size + 1)
        batch = others[:pos] + [target] + others[pos:]
        logits = logits_rows(size + 1, seed=1000 + step * 7 + size)
        # The target's own logits: the same in every run, flat enough that the seed matters.
        row = logits_rows(1, seed=step)[0] * 0.3
        logits[pos] = row
        out = Sampler(seed=step + size)(logits, batch)  # the shared generator differs too
        tokens.append(out.token_ids[pos])
        target.output_token_ids.append(out.token_ids[pos])
    return tokens


@pytest.mark.parametrize("params", [{}, {"top_k": 5}, {"top_p": 0.7, "min_p": 0.05}])
def test_seeded_output_independent_of_batch(params):
    alone = _seeded_tokens([0], **params)
    assert _seeded_tokens([3], **params) == alone
    assert _seeded_tokens([7, 1, 4], **params) == alone
    assert _seeded_tokens([0], seed=4321, **params) != alone  # the seed matters


def test_seeded_generator_stored_on_request():
    r = req(seed=7)
    Sampler()(logits_rows(1), [r])
    assert isinstance(r.generator, torch.Generator) and r.generator.initial_seed() == 7


def test_shared_seed_reproducible():
    logits = logits_rows(16)
    reqs = [req(i) for i in range(16)]
    a = [Sampler(seed=5)(logits, reqs).token_ids for _ in range(3)]
    assert a[0] == a[1] == a[2]
    sampler = Sampler(seed=5)
    assert sampler(logits, reqs).token_ids != sampler(logits, reqs).token_ids  # state advances


def test_sample_frequencies_follow_softmax():
    """The exponential race samples softmax(logits / T): check empirical frequencies."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    temperature = 0.7
    n = 20000
    reqs = [req(i, temperature=temperature) for i in range(n)]
    out = Sampler(seed=3)(logits.expand(n, -1).contiguous(), reqs)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=6).float() / n
    expected = torch.softmax(logits / temperature, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)
    assert freq[5] == 0


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, V)
    logits[:, 7] = 100.0  # EOS would always win
    logits[:, 9] = 90.0  # then a stop token id
    reqs = [
        req(0, eos=(7,), min_tokens=2, stop_token_ids=[9], temperature=0.0, output=[1]),
        req(1, eos=(7,), min_tokens=2, stop_token_ids=[9], temperature=0.0, output=[1, 2]),
        req(2, eos=(7,), min_tokens=3, temperature=0.0),
    ]
    assert Sampler()(logits, reqs).token_ids == [logits[0, :7].argmax().item(), 7, 9]
    seeded = [req(i, eos=(7,), min_tokens=1, seed=i, stop_token_ids=[9]) for i in range(50)]
    tokens = Sampler()(logits[:1].expand(50, -1).contiguous(), seeded).token_ids
    assert 7 not in tokens and 9 not in tokens


def test_logprobs_equal_raw_log_softmax():
    logits = logits_rows(4)
    reqs = [
        req(0, logprobs=3, temperature=0.5, top_k=2, repetition_penalty=2.0),
        req(1),
        req(2, logprobs=0, temperature=0.0),
        req(3, logprobs=5, seed=11),
    ]
    out = Sampler(seed=0)(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i, k in ((0, 3), (2, 0), (3, 5)):
        d = out.logprobs[i]
        top = torch.topk(ref[i], k).indices.tolist()
        assert list(d)[:k] == top
        assert set(d) == set(top) | {out.token_ids[i]}
        for tok, lp in d.items():
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-6)


def test_bf16_logits_accepted():
    logits = logits_rows(2).bfloat16()
    out = Sampler()(logits, [req(0, temperature=0.0), req(1)])
    assert out.token_ids[0] == logits[0].float().argmax().item()


@pytest.mark.gpu
def test_cuda_matches_cpu_for_greedy_and_seeded():
    logits = logits_rows(5)
    reqs_cpu = [req(i, temperature=0.0 if i < 2 else 0.9, top_k=10, seed=i) for i in range(5)]
    reqs_gpu = [req(i, temperature=0.0 if i < 2 else 0.9, top_k=10, seed=i) for i in range(5)]
    cpu = Sampler(seed=0)(logits, reqs_cpu)
    gpu = Sampler(seed=0)(logits.cuda(), reqs_gpu)
    assert gpu.token_ids[:2] == cpu.token_ids[:2]
    allowed = torch.topk(logits, 10).indices
    assert all(t in allowed[i].tolist() for i, t in enumerate(gpu.token_ids))
    # Seeded rows on CUDA are batch-independent too.
    alone = Sampler(seed=1)(logits[4:].cuda(), [req(4, temperature=0.9, top_k=10, seed=4)])
    assert alone.token_ids[0] == gpu.token_ids[4]
