"""A GPU build: same greedy tokens as the unbuilt engine, and a load that tunes nothing and
finds its kernels compiled (tuning.json, triton_cache/ in the engine)."""
from __future__ import annotations

import json

import pytest

import slipstream
from slipstream import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [17, 3, 250, 11]}]


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "int8_wo", "int4_awq"])
def test_gpu_build_loads_without_tuning(tiny_checkpoint, tmp_path, monkeypatch,
                                        quantization) -> None:
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    src = tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    kwargs = dict(device="cuda", dtype="bfloat16", quantization=quantization, max_model_len=128,
                  max_num_seqs=8)
    unbuilt = LLM(str(src), **kwargs)
    want = [o.outputs[0].token_ids for o in unbuilt.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del unbuilt
    engine = slipstream.build(str(src), tmp_path / "engine", **kwargs)
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["environment"]["gpu_name"] and manifest["cuda_graph_batch_sizes"]
    assert json.loads((engine / "tuning.json").read_text())["tables"]
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", "off")  # only the engine's own tables
    llm = LLM(str(engine))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.engine.startup_phases["tune"] == 0.0
    assert llm.engine.startup_phases["quantize"] == 0.0
