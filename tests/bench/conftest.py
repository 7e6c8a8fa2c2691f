"""Fixtures for the bench tests: a tiny Llama config dir and a fake LLM with the engine's API."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from slipstream.engine.args import EngineArgs
from slipstream.outputs import CompletionOutput, RequestMetrics, RequestOutput

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


class FakeLLM:
    """Answers generate() like the engine: exactly max_tokens ids and plausible metrics."""

    step_s = 1e-4

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        names = {"model", "dtype", "max_num_seqs", "max_num_tokens", "max_model_len",
                 "block_size", "gpu_memory_utilization", "seed", "load_format", "device",
                 "enforce_eager", "kv_cache_memory", "enable_prefix_caching", "quantization",
                 "kv_cache_dtype", "tokenizer", "pipeline_decode",
                 "async_scheduling"}
        unknown = set(kwargs) - names
        assert not unknown, f"bench passed unknown LLM kwargs: {unknown}"
        self.engine_config = EngineArgs(**kwargs).create_engine_config()
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts)
        params = sampling_params if isinstance(sampling_params, list) else \
            [sampling_params] * len(prompts)
        assert len(params) == len(prompts)
        self.calls.append(prompts)
        outs, now = [], time.monotonic()
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            assert sp.ignore_eos and sp.temperature == 0.0
            n = sp.max_tokens
            m = RequestMetrics(arrival_time=now, first_scheduled_time=now,
                               first_token_time=now + 0.01, num_generated_tokens=n,
                               finished_time=now + 0.01 + self.step_s * (n - 1))
            comp = CompletionOutput(index=0, text="", token_ids=[7] * n, finish_reason="length")
            outs.append(RequestOutput(str(i), None, prompt, [comp], True, metrics=m))
        time.sleep(0.001)
        return outs

    def get_stats(self):
        return {"num_kv_blocks": 1000, "peak_used_blocks": 250, "num_preemptions": 0}


@pytest.fixture
def fake_llm(monkeypatch):
    """Route the bench's engine construction to FakeLLM; yields the list of built engines."""
    built: list[FakeLLM] = []

    def build(kwargs):
        llm = FakeLLM(**kwargs)
        built.append(llm)
        return llm

    import slipstream.bench.latency as latency
    import slipstream.bench.throughput as throughput

    monkeypatch.setattr(throughput, "build_llm", build)
    monkeypatch.setattr(latency, "build_llm", build)
    return built
