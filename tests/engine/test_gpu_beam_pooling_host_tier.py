"""GPU: beam search, pooling and the host KV tier on the fast path (Triton kernels, CUDA
graphs, async scheduling, pinned host blocks), float32 so results compare with transformers."""
from __future__ import annotations

import random

import pytest
import torch

from slipstream import LLM, PoolingParams, SamplingParams
from slipstream.sampling.beam_search import BeamSearchParams

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 99, 250, 8, 41, 3]


def _cuda_llm(path, **kw):
    return LLM(str(path), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=32,
               max_num_tokens=512, kv_cache_memory=64 << 20, **kw)


@torch.no_grad()
def test_beam_search_matches_transformers_beside_greedy(tiny_llama_dir):
    from tests.engine.test_beam_search import hf_beams
    from tests.helpers import load_hf_model

    llm = _cuda_llm(tiny_llama_dir)
    engine = llm.engine
    engine.add_beam_search("b", PROMPT, BeamSearchParams(beam_width=4, max_tokens=16,
                                                         ignore_eos=True))
    greedy = llm.generate([[9, 8, 7]] * 4, SamplingParams(temperature=0, max_tokens=16,
                                                          ignore_eos=True), use_tqdm=False)
    assert len(greedy) == 4
    settled = []
    while engine.has_unfinished_requests():
        engine.step()
        settled += engine.beams.take_progress().get("b", [])
    (out,) = engine.beams.take_finished().values()
    hf = load_hf_model(tiny_llama_dir)
    ref = hf_beams(hf, PROMPT, 4, 16, 1.0, None)
    assert [s.output_token_ids for s in out.sequences] == [t for t, _ in ref]
    # What a stream sends before the end starts every returned hypothesis.
    assert all(s.output_token_ids[: len(settled)] == settled for s in out.sequences)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks


@torch.no_grad()
def test_embeddings_match_transformers(tiny_llama_dir):
    import transformers

    llm = _cuda_llm(tiny_llama_dir, runner="pooling", pooling_type="mean")
    prompts = [[3, 4, 5, 6, 7], list(range(10, 300))]
    hf = transformers.AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for ids, out in zip(prompts, llm.embed(prompts, PoolingParams(normalize=False))):
        ref = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
        assert torch.allclose(torch.tensor(out.outputs.embedding), ref, atol=2e-3)


def test_host_tier_outputs_equal_a_large_cache(tiny_llama_dir):
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(64)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(40)] for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = _cuda_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)
    block = 8192  # tiny Llama, float32, 16-token blocks
    tiered = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=512,
                 max_num_seqs=32, max_num_tokens=512, kv_cache_memory=40 * block,
                 kv_cache_host_memory=512 * block, preemption_mode="swap",
                 kv_offload_mode="always")
    first = tiered.generate(prompts, params, use_tqdm=False)
    again = tiered.generate(prompts, params, use_tqdm=False)  # prefixes come from the host
    want = [o.outputs[0].token_ids for o in big]
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want
    stats = tiered.get_stats()
    assert stats["host_cache_hits"] > 0 and stats["host_blocks_offloaded"] > 0


def test_host_tier_auto_mode_equals_no_tier(tiny_llama_dir):
    """kv_offload_mode="auto": the measured cost model decides (for this tiny model, likely
    to recompute); whatever it decides, the tokens equal those of a cache large enough for
    everything, and its decision is the one its numbers give."""
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(64)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(40)] for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in _cuda_llm(tiny_llama_dir).generate(prompts, params, use_tqdm=False)]
    block = 8192
    auto = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_model_len=512,
               max_num_seqs=32, max_num_tokens=512, kv_cache_memory=40 * block,
               kv_cache_host_memory=512 * block)
    for _ in range(2):
        got = auto.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    kv = auto.engine.scheduler.kv
    cost = kv.tier_cost
    assert cost is not None and cost.copy_bytes_per_s > 1e9 and cost.flops_per_s > 1e12
    offloads = cost.ever_pays(auto.engine.scheduler.max_seq_len)
    assert (kv.pool.on_evict is not None) == offloads
    if not offloads:
        assert auto.get_stats()["host_blocks_offloaded"] == 0
