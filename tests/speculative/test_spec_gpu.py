"""On a GPU (CUDA graphs, the Triton kernels, verification through the prefill graphs): the
same greedy tokens with and without speculation."""

from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams
from slipstream.speculative import oracle
from tests.speculative.heads import write_eagle, write_medusa


@pytest.mark.gpu
@pytest.mark.parametrize(
    "method",
    ["ngram", "lookahead", "oracle", "oracle_tree", "draft_model", "medusa", "eagle", "eagle3", "eagle_tree"],
)
def test_gpu_greedy_equal_with_speculation(tiny_checkpoint, tmp_path, method):
    path = tiny_checkpoint("LlamaForCausalLM")
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11, 12, 13], list(range(20, 60))]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", max_num_seqs=8, max_model_len=256, kv_cache_memory=64 << 20)
    base = LLM(str(path), **kw)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    del base
    oracle.set_reference_outputs({tuple(p): w for p, w in zip(prompts, want)})
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(path)
    if method == "oracle_tree":  # tree verification through the compiled tree mask
        spec |= {"method": "oracle", "speculative_token_tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}
    if method == "medusa":
        spec["model"] = str(write_medusa(tmp_path / "m", path))
    if method == "eagle_tree":  # the top-1 chain and next-ranked leaves
        spec |= {"method": "eagle", "speculative_token_tree": [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]]}
    if spec["method"] in ("eagle", "eagle3"):
        spec["model"] = str(write_eagle(tmp_path / "e", path, eagle3=method == "eagle3"))
    llm = LLM(str(path), speculative_config=spec, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    if not method.startswith(("medusa", "eagle")):  # random heads may never be right
        assert llm.get_stats()["spec_num_accepted_tokens"] > 0
