"""GPU: one rank through an "mp" worker process gives the in-process engine's tokens; where the
machine has two GPUs, tensor_parallel_size=2 and pipeline_parallel_size=2 (NCCL, micro-batches
in flight) do too, and multi-step decode on worker ranks gives single steps' tokens."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 33, 7, 250, 11], [1, 100, 200, 300, 400, 17, 3, 64, 90]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_model_len=128)


def _tokens(path, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.gpu
def test_gpu_one_rank_on_a_worker_process_equals_in_process(tiny_checkpoint) -> None:
    path = tiny_checkpoint("LlamaForCausalLM")
    assert _tokens(path, distributed_executor_backend="mp") == _tokens(path)


@pytest.mark.gpu
def test_gpu_tensor_parallel_nccl_equals_one_rank(tiny_checkpoint) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = tiny_checkpoint("LlamaForCausalLM")
    assert _tokens(path, tensor_parallel_size=2) == _tokens(path)


@pytest.mark.gpu
def test_gpu_pipeline_micro_batches_nccl_equal_one_rank_and_overlap(tiny_checkpoint) -> None:
    """PP=2 over NCCL with two micro-batches in flight: one rank's tokens, and stage 0 starts
    micro-batch n + 1 before stage 1 has finished n (the ranks' clocks)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = tiny_checkpoint("LlamaForCausalLM")
    want = _tokens(path)
    llm = LLM(str(path), **ENGINE, pipeline_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 4], GREEDY,
                            use_tqdm=False)
        timeline = llm.engine.runner.timelines()
        in_flight = llm.engine.micro_batches.max_in_flight
    finally:
        llm.engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want * 4
    assert in_flight == 2
    stage0 = {mb: start for mb, start, _ in timeline[0]}
    stage1 = {mb: end for mb, _, end in timeline[1]}
    assert any(stage0[mb + 1] < stage1[mb] for mb in stage1 if mb + 1 in stage0)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_multi_step_decode_on_workers_equals_single_steps(tiny_checkpoint, tp) -> None:
    """decode_steps 8 on worker ranks (the decode graphs replayed 8 times a message; TP=2: the
    first rank's sampled tokens broadcast each step) gives one process's single-step tokens,
    greedy and seeded sampled."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    path = tiny_checkpoint("LlamaForCausalLM")
    cases = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]

    def run(**kwargs):
        llm = LLM(str(path), **ENGINE, **kwargs)
        try:
            return [[list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
                for params in cases], llm.engine.runner
        finally:
            llm.engine.shutdown()

    want, _ = run(decode_steps=1)
    got, runner = run(decode_steps=8, tensor_parallel_size=tp, distributed_executor_backend="mp")
    assert got == want
    assert runner.max_decode_batch >= len(PROMPTS)
    assert runner._encoder.num_sent <= 2 * 4  # per case: a prefill and 8 + 8 + 3 steps
