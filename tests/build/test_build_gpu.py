"""A GPU build: same greedy tokens as the unbuilt engine, and a load in a fresh process (empty
caches) that tunes nothing and compiles nothing (tuning.json, triton_cache/ in the engine)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

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
    # A small share of the GPU: the build below runs in another process, which sizes its KV
    # cache from what this one leaves free.
    unbuilt = LLM(str(src), gpu_memory_utilization=0.2, **kwargs)
    want = [o.outputs[0].token_ids for o in unbuilt.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del unbuilt
    gc.collect()
    torch.cuda.empty_cache()
    # Built by the CLI in a fresh process, as users do: kernels this process already compiled
    # would not be written into the engine again.
    engine = tmp_path / "engine"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items() if v is not None]
    build = subprocess.run([sys.executable, "-m", "slipstream", "build", "--model", str(src),
                            "--output", str(engine), *flags], capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["environment"]["gpu_name"] and manifest["cuda_graph_batch_sizes"]
    assert json.loads((engine / "tuning.json").read_text())["tables"]
    # A fresh process: in this one the tuners' tables and compiled kernels are still in memory.
    env = {**os.environ, "SLIPSTREAM_CACHE_DIR": "off", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(engine), json.dumps(PROMPTS)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == want
    assert result["phases"]["tune"] == 0.0
    assert result["phases"]["quantize"] == 0.0
    shipped = {p.name for p in (engine / "triton_cache").iterdir()}
    compiled_now = {p.name for p in (tmp_path / "triton").iterdir()} - shipped
    fresh = _kernel_metadata(tmp_path / "triton", compiled_now)
    shipped_meta = _kernel_metadata(engine / "triton_cache", shipped)
    diffs = {name: _differences(meta, [m for n, m in shipped_meta if n == name])
             for name, meta in fresh}
    assert not compiled_now, f"{len(compiled_now)} Triton kernels compiled again at load: {diffs}"


def _kernel_metadata(cache, dirs) -> list[tuple[str, dict]]:
    """(kernel name, its metadata JSON) for each compiled kernel in those cache directories."""
    return [(f.stem, json.loads(f.read_text())) for d in sorted(dirs)
            for f in (cache / d).glob("*.json") if not f.name.startswith("__grp__")]


def _differences(meta: dict, shipped: list[dict]) -> list[dict]:
    """Per shipped variant of the same kernel, the metadata fields this variant differs in."""
    return [{k: (meta.get(k), old.get(k)) for k in meta.keys() | old.keys()
             if k != "hash" and meta.get(k) != old.get(k)} for old in shipped]


_LOAD = """
import json, sys
from slipstream import LLM, SamplingParams
llm = LLM(sys.argv[1])
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "phases": llm.engine.startup_phases}))
"""
