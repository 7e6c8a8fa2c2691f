"""GPU: one rank through an "mp" worker process gives the in-process engine's tokens; where the
machine has two GPUs, tensor_parallel_size=2 (NCCL) does too."""
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
