"""The offline API: logprobs against transformers, sampling controls, n > 1, bad input."""
from __future__ import annotations

import math
import time

import pytest
import torch

from slipstream import LLM, SamplingParams
from tests.helpers import make_tiny_checkpoint

LOGPROB_ATOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=256, max_num_tokens=256)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


def test_logprobs_match_transformers(llm, hf_model):
    prompt = [3, 17, 99, 250, 8, 41]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprobs=5, prompt_logprobs=3), use_tqdm=False)[0]
    gen = out.outputs[0]
    ref = hf_log_softmax(hf_model, prompt + gen.token_ids)
    assert len(gen.logprobs) == len(gen.token_ids)
    for i, (tok, lp) in enumerate(zip(gen.token_ids, gen.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top5 = torch.topk(row, 5).indices.tolist()
        assert set(top5) <= set(lp) and tok in lp
        for t, value in lp.items():
            assert math.isclose(value, row[t].item(), abs_tol=LOGPROB_ATOL)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert math.isclose(entry[prompt[pos]], ref[pos - 1, prompt[pos]].item(), abs_tol=LOGPROB_ATOL)


def test_seeded_samples_reproducible_and_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True, n=3)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    others = [[9] * 30, [1, 2], [400, 401, 402, 403]]
    mixed = llm.generate(others[:1] + [[5, 6, 7]] + others[1:],
                         [SamplingParams(temperature=0.8, max_tokens=5)] + [params]
                         + [SamplingParams(max_tokens=3)] * 2, use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # n samples differ


def test_max_and_min_tokens(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    assert out.metrics.time_to_first_token is not None and out.metrics.queue_time is not None


def test_stop_token_ids_end_the_output(llm):
    first = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    stop_at = first[2]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)[0]
    cut = first.index(stop_at) + 1
    assert out.outputs[0].token_ids == first[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


@pytest.mark.parametrize("prompt, match", [
    ([], "empty"),
    ([1] * 300, "max_model_len"),
    ([1, 2, 10**6], "outside the vocabulary"),
    ([1, -3], "outside the vocabulary"),
])
def test_bad_prompts_are_clear_errors_and_engine_keeps_serving(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.get_stats()["num_running"] == 0 and llm.get_stats()["num_waiting"] == 0
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("max_tokens", -5), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1),
    ("prompt_logprobs", 100), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", "x"),
    ("ignore_eos", "yes"),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import json

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(str(path), device="cpu")


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_multi_step_decode_equals_single_step(tiny_llama_dir):
    prompts = [[1, 2, 3], [7] * 40, [400, 9]]
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    single = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", decode_steps=1)
    multi = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", decode_steps=8)
    calls = []
    launch = multi.engine.runner.launch_decode_steps
    multi.engine.runner.launch_decode_steps = (
        lambda s, k, *rest: calls.append(k) or launch(s, k, *rest))
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in multi.generate(prompts, params, use_tqdm=False)]
    assert got == expected and all(len(t) == 21 for t in got)
    assert calls == [8, 8, 4]  # 1 prefill token + 8 + 8 + 4 = 21, never past max_tokens
    stats = multi.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_first_token_is_recorded_before_the_decode_that_follows(llm):
    """On a CPU nothing overlaps a step, so each step's outputs are processed right after it:
    the prefill's token is timed before the multi-step decode after it runs, not after."""
    launches = []
    launch = llm.engine.runner.launch_decode_steps
    llm.engine.runner.launch_decode_steps = (
        lambda *args: launches.append(time.monotonic()) or launch(*args))
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    finally:
        llm.engine.runner.launch_decode_steps = launch
    assert launches and out.metrics.first_token_time < launches[0]


def test_n_samples_share_the_prompt_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", block_size=16)
    prompt = list(range(10, 74))  # 64 tokens: 3 full blocks shareable (the last is recomputed)
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 4 for c in out.outputs)
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] == 3 * 48  # children 1..3 reuse child 0's three blocks
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
