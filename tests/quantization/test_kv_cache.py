"""fp8 / int8 KV cache: quantize / dequantize bounds, dtype resolution and errors, scales from
checkpoints and start-up calibration, `slipstream quantize --kv-cache-dtype`, and the embedded
default model end to end on the CPU reference path (GPU twin marked `gpu`).

Closeness measure end to end: the float32-cache model's greedy continuations are fed back as
prompts (teacher forcing); we count positions whose top-1 token is unchanged, and compare the
summed negative log-likelihood of held-out code snippets.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path
from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import reference
from slipstream.quantization import kv_cache
from slipstream.runner.model_runner import ModelRunner
from tests.helpers import rel_err
from tests.quantization.checkpoint_io import run_quantize_cli

KV_MEMORY = 16 << 20
F8, I8 = torch.float8_e4m3fn, torch.int8
# Held-out snippets (not in the calibration set): the NLL comparison runs on these.
SNIPPETS = [
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n"
    "        self.data = {}\n\n    def get(self, key):\n        if key not in self.data:\n"
    "            return None\n        value = self.data.pop(key)\n        self.data[key] = value\n"
    "        return value\n",
    "import json\nimport os\n\n\ndef load_settings(path):\n    \"\"\"Read a JSON settings file, "
    "or return defaults.\"\"\"\n    if not os.path.exists(path):\n        return {}\n"
    "    with open(path) as f:\n        return json.load(f)\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description='Copy files.')\n"
    "    parser.add_argument('src')\n    parser.add_argument('dst')\n"
    "    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args(argv)\n",
]
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):",
           "class Stack:\n    def __init__(self):", "for i in range(10):"]


# ---- quantize / dequantize ---------------------------------------------------------------
def test_int8_round_trip_error_at_most_half_a_step() -> None:
    scale = torch.tensor(0.037)
    x = torch.linspace(-127 * 0.037, 127 * 0.037, 20001) + torch.randn(20001) * 1e-3
    x = x.clamp(-127 * 0.037, 127 * 0.037)
    err = (reference.dequantize_kv(reference.quantize_kv(x, I8, scale), scale) - x).abs()
    assert err.max() <= 0.037 / 2 + 1e-6
    assert err.max() > 0.037 / 2 * 0.9  # the bound is tight: rounding really happens
    big = torch.tensor([10.0, -10.0])  # beyond 127 * scale: clamped, not wrapped
    assert reference.quantize_kv(big, I8, scale).tolist() == [127, -127]


def test_fp8_round_trip_relative_error_of_e4m3() -> None:
    scale = torch.tensor(0.02)
    # Seeded, and inside e4m3's range (448 x scale = 8.96): a tail sample beyond it is clamped,
    # which is checked on its own below, not a rounding error.
    x = (torch.randn(50000, generator=torch.Generator().manual_seed(0)) * 2.0).clamp(-8.9, 8.9)
    deq = reference.dequantize_kv(reference.quantize_kv(x, F8, scale), scale)
    normal = (x / scale).abs() >= 2**-6  # e4m3 normals: 3 mantissa bits, half-ulp 2^-4
    rel = ((deq - x).abs() / x.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-6 and rel.max() > 2**-4 * 0.8
    assert ((deq - x).abs()[~normal] <= 2**-10 * 0.02 + 1e-9).all()  # subnormal spacing / 2
    assert reference.quantize_kv(torch.tensor([1e3]), F8, scale).float().item() == 448.0


@pytest.mark.parametrize("dtype,max_rel", [(I8, 0.02), (F8, 0.05)])
def test_paged_attention_over_quantized_cache_close_to_float(dtype, max_rel) -> None:
    """write_kv_cache then paged_attention with amax scales: close to the float cache."""
    q, kc, vc, meta = make_batch([1, 5, 1], [30, 12, 64], num_kv_heads=2, group=2, head_dim=32,
                                 block_size=16, dtype=torch.float32, seed=4)
    ks = kc.abs().amax() / reference.KV_QMAX[dtype]
    vs = vc.abs().amax() / reference.KV_QMAX[dtype]
    kq, vq = torch.zeros_like(kc, dtype=dtype), torch.zeros_like(vc, dtype=dtype)
    flat = kc.shape[0] * kc.shape[1]
    slots = torch.arange(flat)
    reference.write_kv_cache(kc.view(flat, 2, 32), vc.view(flat, 2, 32), kq, vq, slots,
                             k_scale=ks, v_scale=vs)
    want = reference.paged_attention(q, kc, vc, meta, 0.2)
    got = reference.paged_attention(q, kq, vq, meta, 0.2, k_scale=ks, v_scale=vs)
    assert rel_err(got, want) < max_rel


# ---- names, checks, sizes ----------------------------------------------------------------
def test_resolve_kv_cache_dtype_names_and_checkpoint_default() -> None:
    resolve = kv_cache.resolve_kv_cache_dtype
    assert resolve("auto", "bfloat16") == torch.bfloat16
    assert resolve("fp8", "float32") == F8 and resolve("fp8_e4m3", "float32") == F8
    assert resolve("int8", "bfloat16") == I8
    assert resolve("auto", "bfloat16", {"kv_cache_dtype": "int8"}) == I8
    scheme = {"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}
    assert resolve("auto", "bfloat16", scheme) == F8
    assert resolve("float16", "bfloat16", {"kv_cache_dtype": "int8"}) == torch.float16
    with pytest.raises(ValueError, match="supported: auto, float32, bfloat16, float16, fp8, int8"):
        resolve("fp4", "bfloat16")


def test_engine_rejects_unknown_kv_cache_dtype(engine_config) -> None:
    cfg = engine_config.replace(cache=engine_config.cache.__class__(kv_cache_dtype="int4"))
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int4'.*fp8, int8"):
        ModelRunner(cfg).determine_num_blocks()  # the first thing EngineCore asks after loading


def test_fp8_kv_needs_compute_capability_8_9(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"fp8.*8\.9.*A100 has 8\.0.*int8"):
        kv_cache.check_kv_cache_device(F8, "cuda:0")
    kv_cache.check_kv_cache_device(I8, "cuda:0")  # int8 runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    kv_cache.check_kv_cache_device(F8, "cuda:0")


@pytest.fixture(scope="module")
def engine_config():
    from slipstream.engine.args import EngineArgs

    return EngineArgs(str(default_model_path()), kv_cache_memory=KV_MEMORY,
                      device="cpu").create_engine_config()


def test_one_byte_cache_holds_twice_the_blocks_of_bf16(engine_config) -> None:
    blocks = {}
    for kv in ("float32", "bfloat16", "fp8", "int8"):
        cfg = engine_config.replace(cache=engine_config.cache.__class__(
            kv_cache_memory=KV_MEMORY, kv_cache_dtype=kv))
        runner = ModelRunner(cfg)
        blocks[kv] = runner.determine_num_blocks()
        m = cfg.model
        elem = {"float32": 4, "bfloat16": 2}.get(kv, 1)
        assert runner.kv_cache_bytes_per_block() == (2 * m.num_hidden_layers * 16
                                                     * m.num_key_value_heads * m.head_dim * elem)
    assert blocks["fp8"] == blocks["int8"] == 2 * blocks["bfloat16"] == 4 * blocks["float32"]


# ---- the embedded default model end to end (CPU reference path) --------------------------
@pytest.fixture(scope="module")
def llms() -> dict[str, LLM]:
    """float32 / fp8 / int8 caches; `calibrated` records what the int8 start-up calibration
    measured (the same function, spied on, so the test need not run it again)."""
    seen: list = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs, real(*args, **kwargs)))
        return seen[-1][2]

    real = kv_cache.calibrate_kv_amax
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache, "calibrate_kv_amax", spy)
        out = {kv: LLM(str(default_model_path()), kv_cache_dtype=kv, kv_cache_memory=KV_MEMORY)
               for kv in ("auto", "fp8", "int8")}
    out["calibrated"] = seen
    return out


@pytest.fixture(scope="module")
def baseline(llms):
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llms["auto"].generate(PROMPTS, greedy, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def _nll(llm: LLM, texts: list[str]) -> float:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return -sum(e[t] for o in outs for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]))


def _teacher_forced_agreement(llm: LLM, prompts, continuations) -> float:
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)],
                        SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    hits = total = 0
    for p, c, o in zip(prompts, continuations, outs):
        for i, tok in enumerate(c):
            dist = o.prompt_logprobs[len(p) + i]
            hits += max(dist, key=dist.get) == tok
            total += 1
    return hits / total


# Measured (CPU, float32 compute, 4 x 32 tokens; NLL over 4 snippets, ~660 nats): fp8 NLL
# +0.010%, top-1 agreement 122/128; int8 (start-up calibration) +0.020%, 127/128.
@pytest.mark.parametrize("kv,min_agree", [("fp8", 0.9), ("int8", 0.95)])
def test_default_model_close_to_float_cache(llms, baseline, kv, min_agree) -> None:
    llm = llms[kv]
    assert llm.engine.runner.kv_caches[0][0].dtype == {"fp8": F8, "int8": I8}[kv]
    base_nll, nll = _nll(llms["auto"], SNIPPETS), _nll(llm, SNIPPETS)
    assert abs(nll / base_nll - 1) < 0.005, f"{kv}: NLL {nll:.2f} vs {base_nll:.2f}"
    agree = _teacher_forced_agreement(llm, *baseline)
    assert agree >= min_agree, f"{kv}: teacher-forced top-1 agreement {agree:.3f}"


def test_default_model_cache_holds_twice_the_blocks(llms, engine_config) -> None:
    bf16 = ModelRunner(engine_config.replace(cache=engine_config.cache.__class__(
        kv_cache_memory=KV_MEMORY, kv_cache_dtype="bfloat16"))).determine_num_blocks()
    assert llms["fp8"].engine.runner.num_blocks == 2 * bf16
    assert llms["int8"].engine.runner.num_blocks == 2 * bf16
    assert llms["auto"].engine.runner.num_blocks == bf16 // 2  # float32 on the CPU


def test_startup_scales_fp8_default_int8_calibrated(llms) -> None:
    layers = [a for _, a in kv_cache.attention_layers(llms["fp8"].engine.runner.model)]
    assert all(a.k_scale.item() == 1.0 and a.v_scale.item() == 1.0 for a in layers)
    assert len(llms["calibrated"]) == 1  # int8 only, once
    (model, prompts), kwargs, amax = llms["calibrated"][0]
    assert model is llms["int8"].engine.runner.model
    assert prompts == kv_cache.startup_calibration_prompts(llms["int8"].engine_config)
    assert kwargs["dtype"] == torch.float32  # a float scratch cache, not the int8 one
    layers = [a for _, a in kv_cache.attention_layers(model)]
    for a, (k_max, v_max) in zip(layers, amax, strict=True):
        assert a.k_scale.item() == pytest.approx(k_max * kv_cache.KV_SCALE_HEADROOM / 127)
        assert a.v_scale.item() == pytest.approx(v_max * kv_cache.KV_SCALE_HEADROOM / 127)
    assert len({round(a.k_scale.item(), 6) for a in layers}) > 1  # per layer, not one global


def test_prefix_cache_reuse_with_int8_cache(llms) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = SNIPPETS[0]
    first = llms["int8"].generate([prompt], greedy, use_tqdm=False)[0]
    again = llms["int8"].generate([prompt], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


# ---- checkpoints: loading scales, `slipstream quantize --kv-cache-dtype` ---------------
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)


def _layers(llm: LLM):
    return [a for _, a in kv_cache.attention_layers(llm.engine.runner.model)]


def test_loader_accepts_vllm_style_scale_names(tiny, tmp_path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in tiny.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.25),  # scalar
               "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),  # 1-element
               "model.layers.1.self_attn.kv_scale": torch.tensor([0.125, 0.75])},  # per head
              str(d / "scales.safetensors"))
    layers = _layers(LLM(str(d), kv_cache_dtype="fp8", kv_cache_memory=KV_MEMORY))
    assert (layers[0].k_scale.item(), layers[0].v_scale.item()) == (0.25, 0.5)
    assert (layers[1].k_scale.item(), layers[1].v_scale.item()) == (0.75, 0.75)  # max
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)},
              str(d / "scales.safetensors"))
    with pytest.raises(ValueError, match="k_scale.*finite and positive"):
        LLM(str(d), kv_cache_dtype="fp8", kv_cache_memory=KV_MEMORY)


def _file_scales(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.endswith(("k_scale", "v_scale"))}


def _no_startup_calibration(monkeypatch) -> None:
    def fail(*a, **kw):
        raise AssertionError("scales must come from the checkpoint, not a start-up calibration")

    monkeypatch.setattr(kv_cache, "calibrate_kv_amax", fail)


def test_quantize_int8_kv_writes_scales_and_reload_uses_them(tiny, tmp_path,
                                                            monkeypatch) -> None:
    out = tmp_path / "int8kv"
    assert run_quantize_cli(["quantize", "--model", str(tiny), "--method", "int8_wo", "--output",
                     str(out), "--kv-cache-dtype", "int8", "--num-calib-samples", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["kv_cache_dtype"] == "int8"
    assert config["quantization_config"]["quant_method"] == "int8_wo"
    scales = _file_scales(out / "model.safetensors")
    n = config["num_hidden_layers"]
    assert len(scales) == 2 * n and all(t.dtype == torch.float32 for t in scales.values())
    _no_startup_calibration(monkeypatch)
    llm = LLM(str(out), kv_cache_memory=KV_MEMORY)  # int8 KV by default now
    assert llm.engine.runner.kv_caches[0][0].dtype == I8
    for i, a in enumerate(_layers(llm)):
        assert a.k_scale.item() == scales[f"model.layers.{i}.self_attn.k_scale"].item()
        assert a.v_scale.item() == scales[f"model.layers.{i}.self_attn.v_scale"].item()
    out_tokens = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                              SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out_tokens[0].outputs[0].token_ids) == 4
    # Asked for fp8 instead: the int8 scales cover the same range at 448 / 127 the resolution.
    fp8 = _layers(LLM(str(out), kv_cache_dtype="fp8", kv_cache_memory=KV_MEMORY))
    want = scales["model.layers.0.self_attn.k_scale"].item() * 127 / 448
    assert fp8[0].k_scale.item() == pytest.approx(want, rel=1e-6)


def test_quantize_method_none_adds_fp8_scales_beside_unchanged_weights(tiny, tmp_path,
                                                                      monkeypatch) -> None:
    out = tmp_path / "fp8kv"
    assert run_quantize_cli(["quantize", "--model", str(tiny), "--method", "none", "--output", str(out),
                     "--kv-cache-dtype", "fp8", "--num-calib-samples", "2"]) == 0
    assert (out / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    scales = _file_scales(out / "kv_cache_scales.safetensors")
    assert all(t.item() != 1.0 for t in scales.values())  # calibrated, not the default
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # fp8 scales would clip an int8 cache (|x| / scale up to 448): int8 recalibrates instead.
    int8 = _layers(LLM(str(out), kv_cache_dtype="int8", kv_cache_memory=KV_MEMORY))
    assert int8[0].k_scale.item() > 2 * scales["model.layers.0.self_attn.k_scale"].item()
    _no_startup_calibration(monkeypatch)
    llm = LLM(str(out), kv_cache_memory=KV_MEMORY)
    assert llm.engine.runner.kv_caches[0][0].dtype == F8
    assert _layers(llm)[0].k_scale.item() == scales["model.layers.0.self_attn.k_scale"].item()


def test_quantize_cli_kv_errors(tiny, tmp_path) -> None:
    with pytest.raises(SystemExit, match="--method none quantizes only the KV cache"):
        run_quantize_cli(["quantize", "--model", str(tiny), "--method", "none",
                  "--output", str(tmp_path / "x")])
    with pytest.raises(SystemExit):  # argparse: not one of auto, fp8, int8
        run_quantize_cli(["quantize", "--model", str(tiny), "--method", "int8_wo",
                  "--output", str(tmp_path / "y"), "--kv-cache-dtype", "int4"])


# ---- GPU: the Triton kernels inside the engine, CUDA graphs on --------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_gpu_default_model_quantized_cache_close_to_bf16(kv) -> None:
    base = LLM(str(default_model_path()), device="cuda", kv_cache_memory=256 << 20)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = base.generate(PROMPTS, greedy, use_tqdm=False)
    prompts = [list(o.prompt_token_ids) for o in outs]
    conts = [list(o.outputs[0].token_ids) for o in outs]
    base_nll = _nll(base, SNIPPETS)
    del base
    llm = LLM(str(default_model_path()), device="cuda", kv_cache_dtype=kv,
              kv_cache_memory=256 << 20)
    assert llm.engine.runner.kv_caches[0][0].dtype == {"fp8": F8, "int8": I8}[kv]
    assert abs(_nll(llm, SNIPPETS) / base_nll - 1) < 0.01
    assert _teacher_forced_agreement(llm, prompts, conts) >= 0.95
    # Free-running greedy through the captured decode graphs stays sane (no NaN / garbage).
    again = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in again)
