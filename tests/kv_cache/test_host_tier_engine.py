"""The host KV tier end to end on the CPU: a multi-turn workload on a device cache too small for
its prefixes gives the same greedy tokens with the tier (swap preemption, host prefix hits
copied back) as on a cache large enough for everything."""
from __future__ import annotations

import random

import pytest

from slipstream import LLM, SamplingParams

BLOCK_BYTES = 8192  # the tiny Llama's K and V of one 16-token block, float32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _turns(num_conversations: int = 5, num_turns: int = 3) -> list[list[list[int]]]:
    rng = random.Random(3)
    system = [rng.randrange(3, 500) for _ in range(24)]
    return [[system + [rng.randrange(3, 500) for _ in range(6)] for _ in range(num_turns)]
            for _ in range(num_conversations)]


def _run(llm: LLM) -> list[list[int]]:
    """Every conversation's turns, each turn's prompt the history so far plus new user tokens;
    all conversations advance together, one batch a turn."""
    history = [[] for _ in _turns()]
    outputs = []
    for turn in range(3):
        prompts = [h + conv[turn] for h, conv in zip(history, _turns())]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for i, out in enumerate(outs):
            history[i] = prompts[i] + out.outputs[0].token_ids
            outputs.append(out.outputs[0].token_ids)
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return _run(LLM(str(tiny_llama_dir), device="cpu", max_model_len=128))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiered_outputs_equal_a_large_cache(tiny_llama_dir, reference, mode):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128,
              kv_cache_memory=9 * BLOCK_BYTES, kv_cache_host_memory=64 * BLOCK_BYTES,
              preemption_mode=mode, kv_offload_mode="always")
    assert llm.engine_config.cache.num_host_blocks == 64
    assert _run(llm) == reference
    stats = llm.get_stats()
    assert stats["host_blocks_offloaded"] > 0 and stats["host_cache_hits"] > 0
    assert stats["num_preemptions"] > 0
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks and not any(kv.pool.ref_cnt)
    kv.host.check()


def test_host_tier_needs_prefix_caching(tiny_llama_dir):
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_host_memory=1 << 20,
            enable_prefix_caching=False)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(str(tiny_llama_dir), device="cpu", preemption_mode="sometimes")
