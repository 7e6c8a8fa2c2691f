"""Tensor and pipeline parallelism on gloo worker processes: greedy tokens equal to one rank's.

One pool of 4 worker processes serves every engine of this module (workers.keep_pools): each
case loads its model on a tp x pp layout of ranks 0 .. tp*pp-1 and the rest stay idle, so the
processes and their process group start once.
"""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from slipstream import LLM, SamplingParams
from slipstream.engine.request import Request
from slipstream.parallel import workers
from tests.helpers import finish_after_abort
from tests.quantization.test_int4 import _write_layout

PROMPTS = [[1, 5, 9, 33, 7, 250, 11], [1, 100, 200, 300, 400, 17, 3, 64, 90]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_memory=8 << 20, max_model_len=128, max_num_seqs=4)
# Quantized models: shapes whose row-parallel inputs still hold whole int4 groups of 128 at
# tensor_parallel_size 2.
QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2)


@pytest.fixture(scope="module")
def pool():
    """Four gloo worker ranks for the module's engines, launched first so that their start-up
    overlaps the single-rank reference runs."""
    with workers.keep_pools():
        launched = workers.new_pool(4, "cpu", "mp")
        launched.launch()
        workers.keep(launched)
        # A second pair of ranks for the last fault case, after the first took the four down.
        spare = workers.new_pool(2, "cpu", "mp")
        spare.launch()
        workers.keep(spare)
        yield launched


def _generate(path: Path, params=GREEDY, **kwargs):
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


LAYOUTS = [
    ("LlamaForCausalLM", {}, 2, 1),
    ("LlamaForCausalLM", {}, 1, 2),
    ("LlamaForCausalLM", {}, 2, 2),
    # 2 KV heads on 4 ranks: each rank holds one, replicated; a vocabulary of 510 leaves the
    # last rank's slice of the embedding and head padded.
    ("LlamaForCausalLM", {"vocab_size": 510}, 4, 1),
    ("MistralForCausalLM", {}, 2, 2),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, 2, 2),  # tied head on the last stage
    ("Qwen3ForCausalLM", {}, 2, 2),
]


@pytest.mark.parametrize("arch,overrides,tp,pp", LAYOUTS,
                         ids=[f"{a[:-11]}-tp{t}pp{p}" for a, _, t, p in LAYOUTS])
def test_greedy_equals_one_rank(pool, tiny_checkpoint, arch, overrides, tp, pp) -> None:
    path = tiny_checkpoint(arch, **overrides)
    want = _tokens(_generate(path))
    assert _tokens(_generate(path, tensor_parallel_size=tp, pipeline_parallel_size=pp)) == want


MOE_LAYOUTS = [
    ("MixtralForCausalLM", False, 2, 1),  # each expert's intermediate split across the ranks
    ("Qwen2MoeForCausalLM", True, 2, 1),  # whole experts per rank, and a shared expert
    ("Qwen3MoeForCausalLM", True, 2, 2),
]


@pytest.mark.parametrize("arch,ep,tp,pp", MOE_LAYOUTS,
                         ids=[f"{a[:-11]}-{'ep' if e else 'split'}-tp{t}pp{p}"
                              for a, e, t, p in MOE_LAYOUTS])
def test_moe_greedy_equals_one_rank(pool, tmp_path, arch, ep, tp, pp) -> None:
    """Every rank sees every token and computes its share of the routed sum (its slice of
    each expert, or its whole experts); the all-reduce adds the shares."""
    from tests.models.moe_checkpoints import make_tiny_moe_checkpoint

    path = make_tiny_moe_checkpoint(tmp_path, arch)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    want = _generate(path, params)
    got = _generate(path, params, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                    enable_expert_parallel=ep)
    assert _tokens(got) == _tokens(want)
    for a, b in zip(want, got, strict=True):
        steps = zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
        assert max(abs(_lp(x[t]) - _lp(y[t])) for (x, y), t in
                   zip(steps, a.outputs[0].token_ids, strict=True)) < 1e-4


@pytest.mark.parametrize("method", ["int8_wo", "int4_awq"])
def test_quantized_greedy_equals_one_rank(pool, tiny_checkpoint, method) -> None:
    """Weight-only methods: weights and their per-channel / per-group scales split with the
    layer give the same products, so the same tokens. int4 on a CPU runs torch's bf16 int4
    GEMM, which rounds each rank's partial sum to bf16: there the split model's prompt scores
    must stay within a tenth of int4's own distance from the float model (a wrongly split
    layer moves them further than int4 does)."""
    path = tiny_checkpoint("LlamaForCausalLM", **QUANT_SHAPE)
    if method == "int4_awq":
        exact = _prompt_logprobs(_generate(path, SCORE))
        want = _prompt_logprobs(_generate(path, SCORE, quantization=method))
        got = _prompt_logprobs(_generate(path, SCORE, quantization=method, tensor_parallel_size=2))
        assert _distance(got, want) < 0.1 * _distance(want, exact)
        return
    want = _tokens(_generate(path, quantization=method))
    got = _generate(path, quantization=method, tensor_parallel_size=2)
    assert _tokens(got) == want


SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)


def test_int4_short_groups_split(pool, tiny_checkpoint) -> None:
    """int4 at load with groups that do not divide the row-parallel inputs (hidden 160, o_proj
    and down inputs of 80 and 144 a rank at group 128): each rank quantizes its own slice, a
    short last group per rank, so its rounding differs from one rank's. Split right, it is as
    close to the float model as the one-rank int4 model (a wrong slice is many times further)."""
    path = tiny_checkpoint("LlamaForCausalLM", hidden_size=160, intermediate_size=288,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=40)
    exact = _prompt_logprobs(_generate(path, SCORE))
    one_rank = _distance(_prompt_logprobs(_generate(path, SCORE, quantization="int4_awq")), exact)
    split = _distance(_prompt_logprobs(_generate(path, SCORE, quantization="int4_awq",
                                                 tensor_parallel_size=2)), exact)
    assert split < 1.5 * one_rank, f"{split:.3f} vs one rank's {one_rank:.3f}"


@pytest.mark.parametrize("method", ["fp8", "w8a8_sq"])
def test_activation_quantized_logprobs_near_one_rank(pool, tiny_checkpoint, method) -> None:
    """fp8 and w8a8_sq also quantize activations per token; a row-parallel layer scales each
    rank's slice of its input by that slice's maximum, so its rounding differs from one rank's
    (vLLM's choice too). Split right, the split model is as close to the float model as the
    one-rank quantized model is: mean |prompt log-prob - float's| within 1.5x of it (a wrong
    slice of a weight or scale is many times further)."""
    path = tiny_checkpoint("LlamaForCausalLM", **QUANT_SHAPE)
    exact = _prompt_logprobs(_generate(path, SCORE))
    one_rank = _distance(_prompt_logprobs(_generate(path, SCORE, quantization=method)), exact)
    split = _distance(_prompt_logprobs(_generate(path, SCORE, quantization=method,
                                                 tensor_parallel_size=2)), exact)
    assert split < 1.5 * one_rank, f"{method}: {split:.3f} vs one rank's {one_rank:.3f}"


def _prompt_logprobs(outputs) -> list[float]:
    return [_lp(entry[t]) for o, prompt in zip(outputs, PROMPTS, strict=True)
            for entry, t in zip(o.prompt_logprobs[1:], prompt[1:], strict=True)]


def _distance(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_prequantized_checkpoint_splits(pool, tiny_checkpoint, tmp_path, layout) -> None:
    """Packed int4 weights, zeros and group scales read in the checkpoint's own layout: each
    rank slices the packed columns (column-parallel) or rows of groups (row-parallel)."""
    path = _write_layout(tiny_checkpoint("LlamaForCausalLM", hidden_size=128,
                                         intermediate_size=256), tmp_path / layout, layout)
    want = _tokens(_generate(path))
    assert _tokens(_generate(path, tensor_parallel_size=2, pipeline_parallel_size=2)) == want


def test_logprobs_match_one_rank(pool, tiny_checkpoint) -> None:
    """Sampled-token and prompt log-probs within 1e-4 (float32; only the order of the sums in
    the all-reduces differs)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    path = tiny_checkpoint("LlamaForCausalLM")
    want = _generate(path, params)
    got = _generate(path, params, tensor_parallel_size=2, pipeline_parallel_size=2)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for wa, wb in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:],
                          b.outputs[0].logprobs + b.prompt_logprobs[1:], strict=True):
            assert wa.keys() == wb.keys()
            assert max(abs(_lp(wa[k]) - _lp(wb[k])) for k in wa) < 1e-4


def _lp(entry) -> float:
    return getattr(entry, "logprob", entry)


# ---- pipeline micro-batches: two in flight on two stages ----------------------------------

MIXED = [[1, 5, 9, 33, 7, 250, 11], [1, 100, 200, 300, 400, 17, 3, 64, 90], [1, 2, 3],
         [7, 8, 9, 10, 11, 12], [40, 41, 42, 43]]


def test_micro_batches_give_one_ranks_text(pool, tiny_chat_model_dir) -> None:
    """PP=2 keeps two micro-batches in flight; requests of different lengths, some ending
    early (max_tokens) and one on a stop string, give one rank's tokens, text and ends."""
    lengths = [9, 2, 12, 5, 7]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    prompts = [{"prompt_token_ids": p} for p in MIXED]
    one = LLM(str(tiny_chat_model_dir), **ENGINE)
    free = one.generate(prompts, plain, use_tqdm=False)
    stop = free[2].outputs[0].text[3:6]  # a string request 2 prints mid-way
    params = [*plain[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                         stop=[stop]), *plain[3:]]
    want = one.generate(prompts, params, use_tqdm=False)
    assert want[2].outputs[0].finish_reason == "stop"
    pp = LLM(str(tiny_chat_model_dir), **ENGINE, pipeline_parallel_size=2)
    try:
        got = pp.generate(prompts, params, use_tqdm=False)
        assert pp.engine.micro_batches.max_in_flight == 2
    finally:
        pp.engine.shutdown()
    for a, b in zip(want, got, strict=True):
        assert (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason) == \
            (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason)


def test_structured_outputs_on_worker_ranks(pool, tiny_chat_model_dir) -> None:
    """The sampling ranks mask with their own copy of each request's grammar (advanced over
    the tokens each step brings): one rank's constrained text, with PP=2 micro-batches."""
    from slipstream.structured.params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(regex="[ab]+")),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(
                  choice=["yes", "no"]))]
    prompts = ["hello", "write json", "say"]
    one = LLM(str(tiny_chat_model_dir), **ENGINE)
    want = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
    assert re.fullmatch("[ab]+", want[0]) and want[2] in ("yes", "no")
    pp = LLM(str(tiny_chat_model_dir), **ENGINE, pipeline_parallel_size=2)
    try:
        got = [o.outputs[0].text for o in pp.generate(prompts, params, use_tqdm=False)]
    finally:
        pp.engine.shutdown()
    assert got == want


def test_micro_batches_overlap_and_take_late_requests_and_aborts(pool, tiny_checkpoint) -> None:
    """Driven step by step: a prompt of three prefill chunks runs alone, three requests
    arrive late, one is aborted while its token is in flight. No micro-batch holds a request
    whose sampled token is in flight; the long prompt's chunks follow one another through the
    pipe; the tokens are one rank's; and the ranks' clocks show stage 0 running micro-batch
    n + 1 before stage 1 has finished n."""
    path = tiny_checkpoint("LlamaForCausalLM")
    prompts = [list(range(20, 60)), *MIXED[:3]]  # 40 tokens: chunks of 16, 16 and 8
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(str(path), **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    llm = LLM(str(path), **ENGINE, pipeline_parallel_size=2, max_num_tokens=16)
    core = llm.engine
    launched = _record_launches(core)
    tokens = {f"r{i}": [] for i in range(4)}
    try:
        core.add_request(Request("r0", prompts[0], params))
        for step in range(40):
            if step == 2:
                for i in (1, 2, 3):
                    core.add_request(Request(f"r{i}", prompts[i], params))
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
            if len(tokens["r2"]) >= 3 and "r2" in _in_flight(core):
                break
        finish_after_abort(core, tokens, "r2")
        timeline = core.runner.timelines()
    finally:
        core.shutdown()
    assert [tokens["r0"], tokens["r1"], tokens["r3"]] == [want[0], want[1], want[3]]
    assert 3 <= len(tokens["r2"]) < 10 and tokens["r2"] == want[2][:len(tokens["r2"])]
    assert core.micro_batches.max_in_flight == 2
    for seqs, in_flight in launched:
        pending = {rid for rid, _, sample in in_flight if sample}
        assert not {rid for rid, _, _ in seqs} & pending
    # The second chunk went out while the first was in flight.
    assert launched[1] == ([("r0", 16, False)], [("r0", 0, False)])
    stage0 = {mb: start for mb, start, _ in timeline[0]}
    stage1 = {mb: end for mb, _, end in timeline[1]}
    assert any(stage0[mb + 1] < stage1[mb] for mb in stage1 if mb + 1 in stage0)


def _record_launches(core) -> list[tuple[list[tuple[str, int, bool]], list]]:
    """Each micro-batch the engine sends, and those in flight as it goes: (request id,
    start, samples) of each of their seqs."""
    launched, launch = [], core.runner.launch_step

    def seqs(sched_out) -> list[tuple[str, int, bool]]:
        return [(s.request_id, s.start_pos, s.needs_sample) for s in sched_out.seqs]

    def recorded(sched_out):
        in_flight = [seq for batch, _ in core.micro_batches.in_flight for seq in seqs(batch)]
        launched.append((seqs(sched_out), in_flight))
        return launch(sched_out)

    core.runner.launch_step = recorded
    return launched


def _in_flight(core) -> set[str]:
    """Requests with a sampled token in an unread micro-batch."""
    return {s.request_id for batch, _ in core.micro_batches.in_flight for s in batch.seqs
            if s.needs_sample}


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_worker_fails_the_engine_within_seconds(pool, tiny_checkpoint, how,
                                                               monkeypatch) -> None:
    """SIGKILL (the process exits) or SIGSTOP (alive, silent: no heartbeat) of one rank: the
    caller gets an error naming it within seconds, and no process is left behind. The killed
    rank is the last stage of PP=2 with two micro-batches in flight. Runs last: the pool is
    lost."""
    monkeypatch.setenv("SLIPSTREAM_WORKER_TIMEOUT_S", "2")
    layout = {"pipeline_parallel_size" if how == "kill" else "tensor_parallel_size": 2}
    llm = LLM(str(tiny_checkpoint("LlamaForCausalLM")), **ENGINE, **layout)
    core = llm.engine
    victim = core.runner.pool.procs[1]
    start = time.monotonic()
    with pytest.raises(workers.WorkerError, match="rank 1"):
        if how == "stop":
            os.kill(victim.pid, signal.SIGSTOP)
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        for i, p in enumerate(PROMPTS):
            core.add_request(Request(f"r{i}", p, GREEDY))
        core.step()

        def kill() -> None:  # after the second micro-batch is sent, before the first is read
            assert len(core.micro_batches) == 2
            os.kill(victim.pid, signal.SIGKILL)

        core.step(kill)
        while core.has_unfinished_requests():
            core.step()
    assert time.monotonic() - start < 10
    for proc in llm.engine.runner.pool.procs:
        assert proc.poll() is not None  # every rank stopped, none left in a collective


@pytest.mark.parametrize("arch,layout,ep", [("MixtralForCausalLM", "gptq", False),
                                             ("Qwen3MoeForCausalLM", "awq", True)])
def test_prequantized_int4_moe_equals_one_rank(pool, tmp_path, arch, layout, ep) -> None:
    """GPTQ / AWQ MoE checkpoints (group 16) on 2 ranks: Mixtral's experts split (the down
    projection's input cut, 64 of 128 columns, holds whole groups), Qwen3-MoE's whole experts
    per rank (each rank loads only its experts' tensors); the tokens are one rank's."""
    from tests.models.moe_checkpoints import make_tiny_moe_checkpoint
    from tests.models.test_moe_int4 import _write_int4_checkpoint

    src = make_tiny_moe_checkpoint(tmp_path / "float", arch)
    path = _write_int4_checkpoint(src, tmp_path / layout, layout, group=16)
    want = _tokens(_generate(path))
    got = _generate(path, tensor_parallel_size=2, enable_expert_parallel=ep)
    assert _tokens(got) == want
