"""Tensor and pipeline parallelism on gloo worker processes: greedy tokens equal to one rank's.

One pool of 4 worker processes serves every engine of this module (workers.keep_pools): each
case loads its model on a tp x pp layout of ranks 0 .. tp*pp-1 and the rest stay idle, so the
processes and their process group start once.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from slipstream import LLM, SamplingParams
from slipstream.parallel import workers
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
    layer give the same products, so the same tokens."""
    path = tiny_checkpoint("LlamaForCausalLM", **QUANT_SHAPE)
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


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_worker_fails_the_engine_within_seconds(pool, tiny_checkpoint, how,
                                                               monkeypatch) -> None:
    """SIGKILL (the process exits) or SIGSTOP (alive, silent: no heartbeat) of one rank: the
    caller gets an error naming it within seconds, and no process is left behind. Runs last:
    the pool is lost."""
    monkeypatch.setenv("SLIPSTREAM_WORKER_TIMEOUT_S", "2")
    llm = LLM(str(tiny_checkpoint("LlamaForCausalLM")), **ENGINE, tensor_parallel_size=2)
    victim = llm.engine.runner.pool.procs[1]
    os.kill(victim.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(workers.WorkerError, match="rank 1"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
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
