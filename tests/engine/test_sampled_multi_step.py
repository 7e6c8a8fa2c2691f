"""Multi-step decode of requests that sample (temperature > 0): the sampler runs on the device
once a step, each seeded request drawing from its own generator in step order, so its tokens
are the ones single-step decoding gives, whatever else is in the batch."""

from __future__ import annotations

import random

import pytest

from slipstream import LLM, SamplingParams


def _engine(tiny_llama_dir, decode_steps: int, device: str = "cpu") -> tuple[LLM, list[bool]]:
    """An LLM that records, per multi-step launch, whether the batch had a sampled request."""
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device=device,
        decode_steps=decode_steps,
        max_num_seqs=8,
        max_num_tokens=256,
        max_model_len=128,
        kv_cache_memory=64 << 20,
    )
    runner, launches = llm.engine.runner, []
    launch = runner.launch_decode_steps

    def recorded(sched, num_steps, feed=None):
        launches.append(any(not s.request.sampling_params.greedy for s in sched.seqs))
        return launch(sched, num_steps, feed)

    runner.launch_decode_steps = recorded
    return llm, launches


def _workload():
    """Seeded sampling with and without top-k / top-p / min-p, beside greedy rows."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))] for _ in range(12)]
    kinds = [
        dict(temperature=0.8),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.2, min_p=0.05),
        dict(temperature=0),
    ]
    params = [
        SamplingParams(
            seed=None if k["temperature"] == 0 else 7 * i, max_tokens=24, ignore_eos=bool(i % 2), **k
        )
        for i, k in enumerate(kinds[i % len(kinds)] for i in range(12))
    ]
    return prompts, params


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_seeded_sampling_gives_the_same_tokens_in_multi_step_decode(tiny_llama_dir, device: str) -> None:
    """On CUDA the forward of each step is a graph replay and the sampler runs after it."""
    prompts, params = _workload()
    single, _ = _engine(tiny_llama_dir, decode_steps=1, device=device)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    del single
    multi, launches = _engine(tiny_llama_dir, decode_steps=8, device=device)
    got = [o.outputs[0].token_ids for o in multi.generate(prompts, params, use_tqdm=False)]
    assert any(launches), "no multi-step decode ran with a sampled request"
    assert got == want
    assert all(len(t) == 24 for t, p in zip(got, params) if p.ignore_eos)
