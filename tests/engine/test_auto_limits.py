"""Step limits chosen from the device and the model (engine/auto_limits.py): the pure choice on
fake devices, and the engine's use of it (a user's value always wins)."""

from __future__ import annotations

import pytest

from slipstream.engine import auto_limits
from slipstream.engine.args import EngineArgs
from slipstream.engine.auto_limits import (
    CPU_LIMITS,
    GIB,
    DeviceInfo,
    ModelFootprint,
    StepLimits,
    choose_step_limits,
    fit_resolved_limits,
    fit_to_kv_cache,
    resolve_step_limits,
)

H100 = DeviceInfo("cuda", total_memory=80 * GIB, sm_count=132, name="NVIDIA H100 80GB HBM3")
H200 = DeviceInfo("cuda", total_memory=141 * GIB, sm_count=132, name="NVIDIA H200")
A10 = DeviceInfo("cuda", total_memory=24 * GIB, sm_count=72, name="NVIDIA A10")
T4 = DeviceInfo("cuda", total_memory=16 * GIB, sm_count=40, name="Tesla T4")

# Llama-3.1-8B bf16: 8.03 B parameters, 32 layers x 8 KV heads x 128, hidden 4096, MLP 14336.
LLAMA_8B = ModelFootprint(
    weight_bytes=16_060_000_000,
    kv_bytes_per_token=131_072,
    activation_bytes_per_token=2 * (4 * 4096 + 3 * 14336),
)
# Qwen3-0.6B: 28 layers x 8 KV heads x 128, hidden 1024, MLP 3072.
QWEN3_06B = ModelFootprint(
    weight_bytes=1_500_000_000,
    kv_bytes_per_token=114_688,
    activation_bytes_per_token=2 * (4 * 1024 + 3 * 3072),
)
# Llama-3.1-70B: 80 layers x 8 KV heads x 128, hidden 8192, MLP 28672; fp8 weights.
LLAMA_70B_FP8 = ModelFootprint(
    weight_bytes=70_600_000_000,
    kv_bytes_per_token=327_680,
    activation_bytes_per_token=2 * (4 * 8192 + 3 * 28672),
)
LLAMA_70B_BF16 = ModelFootprint(
    weight_bytes=141_100_000_000,
    kv_bytes_per_token=327_680,
    activation_bytes_per_token=2 * (4 * 8192 + 3 * 28672),
)


@pytest.mark.parametrize(
    "device, model, want",
    [
        (H100, LLAMA_8B, StepLimits(512, 8192)),  # the big-GPU class, the KV cache holds it all
        (H200, LLAMA_8B, StepLimits(512, 8192)),
        (H200, QWEN3_06B, StepLimits(512, 8192)),
        (A10, LLAMA_8B, StepLimits(192, 4096)),  # mid class; 7 GiB left: KV for 192 x 256 tokens
        (A10, QWEN3_06B, StepLimits(256, 4096)),
        (T4, QWEN3_06B, CPU_LIMITS),  # too few SMs for more
        (H200, LLAMA_70B_FP8, StepLimits(512, 8192)),  # 56 GB of KV left: room for all of it
        (H100, LLAMA_70B_FP8, StepLimits(64, 2048)),  # 6.7 GB left: activations and KV shrink it
        (H100, LLAMA_70B_BF16, StepLimits(16, 256)),  # does not fit at all (loading says so)
        (DeviceInfo("cpu"), LLAMA_8B, CPU_LIMITS),
    ],
)
def test_choose_step_limits(device, model, want):
    assert choose_step_limits(device, model) == want


def test_a_lower_memory_utilization_leaves_a_smaller_batch():
    assert choose_step_limits(A10, LLAMA_8B, gpu_memory_utilization=0.8) == StepLimits(128, 2048)


@pytest.mark.parametrize(
    "kv_tokens, want",
    [
        (1_000_000, StepLimits(512, 8192)),  # room for everything: unchanged
        (100_000, StepLimits(384, 8192)),  # 390 sequences of 256 tokens, on the graph grid
        (5_000, StepLimits(16, 4096)),  # a step never larger than the cache
        (1_000, StepLimits(3, 512)),  # below one graph step: as many as fit
    ],
)
def test_fit_to_kv_cache(kv_tokens, want):
    assert fit_to_kv_cache(StepLimits(512, 8192), kv_tokens) == want


def _config(model_dir, **kwargs):
    return EngineArgs(model=str(model_dir), device="cpu", **kwargs).create_engine_config()


def test_unset_limits_are_auto_until_the_engine_resolves_them(tiny_llama_dir):
    config = _config(tiny_llama_dir)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_tokens) == (None, None)
    resolved = resolve_step_limits(config).scheduler
    assert (resolved.max_num_seqs, resolved.max_num_tokens) == (128, 2048)  # a CPU


def _as_h100(monkeypatch, config):
    monkeypatch.setattr(auto_limits, "device_info", lambda device: H100)
    return config.replace(device="cuda")


def test_a_value_the_user_set_wins(tiny_llama_dir, monkeypatch):
    config = _as_h100(monkeypatch, _config(tiny_llama_dir, max_num_seqs=64))
    resolved = resolve_step_limits(config)
    assert (resolved.scheduler.max_num_seqs, resolved.scheduler.max_num_tokens) == (64, 8192)
    # Fitting to a small cache lowers only the chosen one.
    fitted = fit_resolved_limits(resolved, config.scheduler, num_blocks=64).scheduler
    assert (fitted.max_num_seqs, fitted.max_num_tokens) == (64, 1024)
    both = _as_h100(monkeypatch, _config(tiny_llama_dir, max_num_seqs=8, max_num_tokens=300))
    assert resolve_step_limits(both) is both
    assert fit_resolved_limits(both, both.scheduler, num_blocks=1) is both


def test_chosen_limits_fit_the_kv_cache_the_engine_got(tiny_llama_dir, monkeypatch):
    config = _as_h100(monkeypatch, _config(tiny_llama_dir))
    resolved = resolve_step_limits(config)
    assert (resolved.scheduler.max_num_seqs, resolved.scheduler.max_num_tokens) == (512, 8192)
    fitted = fit_resolved_limits(resolved, config.scheduler, num_blocks=2000).scheduler
    assert (fitted.max_num_seqs, fitted.max_num_tokens) == (112, 8192)  # 32,000 tokens
    # A pooling engine sizes its cache from the limits: nothing to fit.
    pooling = resolved.replace(runner="pooling")
    assert fit_resolved_limits(pooling, config.scheduler, num_blocks=2000) is pooling


def test_footprint_of_a_real_config(tiny_llama_dir):
    config = _config(tiny_llama_dir, kv_cache_dtype="bfloat16")
    m = config.model
    fp = auto_limits.model_footprint(config)
    assert fp.kv_bytes_per_token == 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 2
    assert fp.activation_bytes_per_token == 4 * (4 * m.hidden_size + 3 * m.intermediate_size)
    assert fp.weight_bytes > 0


def test_engine_runs_with_its_chosen_limits(tiny_llama_dir):
    from slipstream import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=8 << 20)
    sched = llm.engine_config.scheduler
    assert (sched.max_num_seqs, sched.max_num_tokens) == (128, 2048)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.gpu
def test_limits_chosen_on_this_gpu(tiny_llama_dir):
    """On a real GPU: the class's limits for this device (a tiny model leaves all memory), then
    fitted to the KV cache the engine got; a user's value still wins."""
    import torch

    from slipstream import LLM, SamplingParams

    device = auto_limits.device_info("cuda")
    assert device.total_memory == torch.cuda.get_device_properties(0).total_memory
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=64 << 20)
    sched, cache = llm.engine_config.scheduler, llm.engine_config.cache
    footprint = auto_limits.model_footprint(llm.engine_config)
    want = fit_to_kv_cache(choose_step_limits(device, footprint), cache.num_blocks * cache.block_size)
    assert (sched.max_num_seqs, sched.max_num_tokens) == (want.max_num_seqs, want.max_num_tokens)
    print(
        f"{device.name}: chosen {sched.max_num_seqs} / {sched.max_num_tokens} for a "
        f"{cache.num_blocks * cache.block_size}-token cache; "
        f"{choose_step_limits(device, footprint)} before it"
    )
    out = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    mine = LLM(str(tiny_llama_dir), kv_cache_memory=64 << 20, max_num_seqs=8)
    assert mine.engine_config.scheduler.max_num_seqs == 8
