"""The Ray backend on a local Ray instance (CPU, gloo): the same tokens as one rank.

Marked slow (about 17 s on two busy cores: a local Ray start, two actors importing torch);
skipped where Ray is not installed (`pip install 'slipstream[ray]'`).
"""
from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 200, 300, 400, 17, 3]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", kv_cache_memory=8 << 20, max_model_len=128)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
def test_ray_tensor_parallel_equals_one_rank(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("LlamaForCausalLM"))
    want = _tokens(LLM(path, **ENGINE))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(path, **ENGINE, tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            assert _tokens(llm) == want
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()
