"""Prefill CUDA graphs: the padded batch a graph replays gives the logits of the flat batch.

On the CPU nothing is captured and PrefillGraphs runs its padded batch eagerly, so these tests
check the padding itself (token counts rounded up, the padding sequence, empty sequence rows,
fed tokens) against transformers on a tiny random model. The GPU test compares whole greedy
generations with and without the graphs.
"""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.engine.args import EngineArgs
from slipstream.engine.request import Request
from slipstream.runner.prefill_graphs import PrefillGraphs, prefill_sizes
from slipstream.scheduler.output import ScheduledSeq, SchedulerOutput
from tests.helpers import load_hf_model, max_rel_err
from tests.runner.test_model_runner import (
    NUM_BLOCKS,
    REL_TOL,
    hf_logits,
    make_runner,
    prompt_of,
    shuffled_blocks,
)

MAX_SEQS = 8  # the test graphs' sequence limit


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


@pytest.fixture
def runner(tiny_llama_dir):
    """A CPU runner whose prefill steps go through PrefillGraphs (uncaptured: run eagerly)."""
    r = make_runner(tiny_llama_dir)
    sched = r.config.scheduler
    r._prefill_graphs = PrefillGraphs(r.model, r.kv_caches, r.device, max_tokens=64,
                                      max_blocks_per_seq=r._max_blocks_per_seq(),
                                      max_seq_len=sched.max_model_len, max_seqs=MAX_SEQS)
    return r


def test_prefill_sizes(runner):
    assert prefill_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_sizes(100) == [16, 32, 64]
    assert prefill_sizes(8) == []
    for max_tokens, max_seq_len in ((8, 100), (64, 40)):
        with pytest.raises(ValueError, match="prefill graphs"):
            PrefillGraphs(runner.model, runner.kv_caches, runner.device, max_tokens, 16,
                          max_seq_len)


def test_padded_prefill_steps_match_transformers(runner, hf):
    """Step 1 samples nothing (25 tokens, padded to 32), step 2 mixes a decode, a prompt's last
    chunk and a whole prompt (34 tokens, padded to 64); blocks 0-2 belong to no sequence, and
    the padding sequence, which reads block 0, must write nowhere."""
    pool = list(range(3, NUM_BLOCKS))
    p_a, p_b, p_c = prompt_of(30, 2), prompt_of(9, 3), prompt_of(20, 4)
    blocks = {r: shuffled_blocks(10, seed=i, pool=pool) for i, r in enumerate("abc")}
    reqs = {r: Request(r, p, SamplingParams()) for r, p in zip("abc", (p_a, p_b, p_c))}
    logits, requests, eager = runner._step_logits(SchedulerOutput([
        ScheduledSeq(reqs["a"], p_a[:17], 0, blocks["a"], False),
        ScheduledSeq(reqs["b"], p_b[:8], 0, blocks["b"], False),
    ]), None)
    assert logits is None and requests == [] and eager is None
    logits, requests, eager = runner._step_logits(SchedulerOutput([
        ScheduledSeq(reqs["b"], p_b[8:], 8, blocks["b"], True),
        ScheduledSeq(reqs["a"], p_a[17:], 17, blocks["a"], False),
        ScheduledSeq(reqs["c"], p_c, 0, blocks["c"], True),
    ]), None)
    assert eager is None, "the step should have run from the prefill graphs"
    assert [r.request_id for r in requests] == ["b", "c"] and logits.shape == (2, 512)
    assert max_rel_err(logits[0], hf_logits(hf, p_b)[-1]) < REL_TOL
    assert max_rel_err(logits[1], hf_logits(hf, p_c)[-1]) < REL_TOL
    for k_cache, v_cache in runner.kv_caches:
        assert not k_cache[:3].any() and not v_cache[:3].any()


def test_fed_last_token(runner, hf):
    """Async scheduling: the last input token of a seq still on the device (rows -1: keep)."""
    p_a, p_b = prompt_of(12, 5), prompt_of(7, 6)
    a = Request("a", p_a, SamplingParams())
    b = Request("b", p_b, SamplingParams())
    runner._step_logits(SchedulerOutput([ScheduledSeq(a, p_a[:11], 0, [4, 9, 7, 30], False)]),
                        None)
    fed = torch.tensor([0, p_a[11]])
    logits, _, eager = runner._step_logits(SchedulerOutput([
        ScheduledSeq(a, [0], 11, [4, 9, 7, 30], True),  # placeholder token
        ScheduledSeq(b, p_b, 0, [11, 12], True),
    ]), (fed, [1, -1]))
    assert eager is None
    assert max_rel_err(logits[0], hf_logits(hf, p_a)[-1]) < REL_TOL
    assert max_rel_err(logits[1], hf_logits(hf, p_b)[-1]) < REL_TOL


def test_steps_the_graphs_cannot_take_run_eagerly(runner):
    graphs = runner._prefill_graphs
    many = [ScheduledSeq(Request(f"r{i}", [1, 2], SamplingParams()), [1, 2], 0, [i], True)
            for i in range(MAX_SEQS + 1)]
    long = [ScheduledSeq(Request("l", [1] * 65, SamplingParams()), [1] * 65, 0,
                         list(range(20, 40)), True)]
    logprobs = [ScheduledSeq(Request("p", [1] * 5, SamplingParams(prompt_logprobs=1)), [1] * 5,
                             0, [50, 51], True)]
    for seqs in (many, long, logprobs):
        logits, requests, eager = runner._step_logits(SchedulerOutput(seqs), None)
        assert eager is not None and len(requests) == len(seqs)
    assert graphs.accepts(_host_batch(many[:MAX_SEQS], runner))


def _host_batch(seqs, runner):
    from slipstream.runner.input_batch import build_host_batch

    return build_host_batch(seqs, runner.block_size)


def test_bad_limit_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        EngineArgs(model=str(tiny_llama_dir), device="cpu",
                   max_prefill_graph_tokens=-1).create_engine_config()


@pytest.mark.gpu
def test_greedy_generation_same_with_and_without_prefill_graphs(tiny_llama_dir):
    """Prompts of 1-600 tokens (the longest chunked, so steps above 256 tokens run eagerly),
    batched and alone, and a repeat of a prompt (a prefix-cache hit: a prefill after cached
    context); float32 so the two paths' greedy tokens must agree exactly."""
    prompts = [prompt_of(n, seed=n) for n in (1, 15, 16, 17, 100, 255, 600)]
    prompts.append(prompts[4])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for limit in (0, 512):
        llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_tokens=256,
                  max_model_len=1024, kv_cache_memory=128 << 20, max_prefill_graph_tokens=limit)
        runner = llm.engine.runner
        outs[limit] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        outs[limit] += [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                        for p in prompts[:3]]
        graphs = runner._prefill_graphs
        if limit:
            assert sorted(graphs.graphs) == [16, 32, 64, 128, 256] and graphs.replays > 0
        else:
            assert graphs is None
        del llm
        torch.cuda.empty_cache()
    assert outs[512] == outs[0]
