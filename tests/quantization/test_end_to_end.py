"""Quantized tiny models through LLM, and `slipstream quantize` checkpoints that reload.

Measure of closeness: teacher forcing. The unquantized model's 16 greedy tokens are fed back as a
prompt to the quantized model; we count the positions where the quantized top-1 token equals the
unquantized one, and the mean |difference| of those tokens' logprobs. (Free-running greedy
agreement is a poor measure on random tiny models: near-tied logits make one flip cascade.)
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.quantization.utils import detect_quant_method
from tests.helpers import skip_without_fp8
from tests.quantization.checkpoint_io import run_quantize_cli

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SCORE = SamplingParams(max_tokens=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    # K = 128 and 256: whole INT4 groups of 128.
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (8,), generator=g).tolist() for _ in range(4)]


def _llm(path: Path, quantization: str | None = None) -> LLM:
    return LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _score(llm: LLM, prompts, continuations) -> tuple[list[int], list[float]]:
    """Per continuation position: top-1 token and the logprob of the continuation token."""
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)],
                        SCORE, use_tqdm=False)
    tops, lps = [], []
    for p, c, o in zip(prompts, continuations, outs):
        for i, tok in enumerate(c):
            dist = o.prompt_logprobs[len(p) + i]
            tops.append(max(dist, key=dist.get))
            lps.append(dist[tok])
    return tops, lps


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    llm = _llm(tiny)
    base = _greedy(llm, prompts)
    return base, _score(llm, prompts, base)[1]


# Measured on this tiny model (seed 0): int8_wo 94% / 0.04, fp8 72% / 0.29.
@pytest.mark.parametrize("method,min_agree,max_dlogp", [("int8_wo", 0.85, 0.1),
                                                        ("fp8", 0.6, 0.5)])
def test_quantized_llm_close_to_unquantized(tiny, prompts, reference, method, min_agree,
                                            max_dlogp) -> None:
    base, base_lps = reference
    tops, lps = _score(_llm(tiny, method), prompts, base)
    flat = [t for c in base for t in c]
    agree = sum(a == b for a, b in zip(tops, flat)) / len(flat)
    dlogp = sum(abs(a - b) for a, b in zip(lps, base_lps)) / len(lps)
    assert agree >= min_agree, f"{method}: teacher-forced top-1 agreement {agree:.2f}"
    assert dlogp <= max_dlogp, f"{method}: mean |logprob difference| {dlogp:.3f}"


@pytest.mark.parametrize("method", ["int8_wo", "fp8"])
def test_quantize_cli_output_reloads(tiny, prompts, tmp_path, method, monkeypatch) -> None:
    from slipstream.models import norm_fold

    out = tmp_path / method
    assert run_quantize_cli(["quantize", "--model", str(tiny), "--method", method,
                     "--output", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert detect_quant_method(config) == method
    reloaded = _llm(out, detect_quant_method(config))
    layer = reloaded.engine.runner.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype in (torch.int8, torch.float8_e4m3fn)
    from safetensors.torch import load_file

    name = "model.layers.0.input_layernorm.weight"
    written, source = (load_file(str(d / "model.safetensors"))[name] for d in (out, tiny))
    assert torch.equal(written, source)  # the norms as they were: nothing folded into the file
    # Same quantized numbers as quantizing at load time with the norms kept (the CLI writes the
    # source's norms; a load-time fold quantizes W * gamma instead): the same greedy tokens.
    with norm_fold.kept_norms():
        unfolded = _llm(tiny, method)
    assert _greedy(reloaded, prompts) == _greedy(unfolded, prompts)


def test_quantize_cli_rejects_kv_cache_dtype(tiny, tmp_path) -> None:
    # fp8 / int8 KV quantization is covered by tests/quantization/test_kv_cache.py.
    with pytest.raises(SystemExit):
        run_quantize_cli(["quantize", "--model", str(tiny), "--method", "int8_wo",
                  "--output", str(tmp_path / "x"), "--kv-cache-dtype", "int4"])


def test_quantize_int4_awq_reloads_and_is_not_worse_than_rtn(tiny, prompts, reference,
                                                             tmp_path) -> None:
    base, base_lps = reference
    dlogp = {}
    for flag in ("--awq", "--no-awq"):
        out = tmp_path / flag
        argv = ["quantize", "--model", str(tiny), "--method", "int4_awq", "--output", str(out),
                "--num-calib-samples", "4"]
        assert run_quantize_cli(argv + ["--no-gptq"] + ([flag] if flag == "--no-awq" else [])) == 0
        config = json.loads((out / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "awq"
        lps = _score(_llm(out, detect_quant_method(config)), prompts, base)[1]
        dlogp[flag] = sum(abs(a - b) for a, b in zip(lps, base_lps)) / len(lps)
    # Measured mean |logprob diff| (seed 0): AWQ 0.875, RTN 0.860 (random model, random ids).
    assert dlogp["--awq"] <= dlogp["--no-awq"] * 1.05, dlogp
    assert dlogp["--awq"] < 1.5, dlogp


@pytest.mark.parametrize("method,options", [("fp8", None), ("int8_wo", None),
                                            ("int4_awq", {"group_size": 128, "awq": False,
                                                          "gptq": False})])
def test_quantize_at_load_writes_the_same_checkpoint(monkeypatch, tiny, tmp_path, method,
                                                     options):
    """Methods without calibration (and int4 round-to-nearest, `--no-awq`) quantize while the
    engine loads (one layer at a time, so a model whose 16-bit weights do not fit the device
    can be quantized); the files are byte for byte those of quantizing the whole loaded float
    model."""
    import importlib

    from safetensors.torch import load_file

    from slipstream.quantization import checkpoint

    module = importlib.import_module(f"slipstream.quantization.{method}")
    assert checkpoint.quantizes_at_load(method, module, options, "cpu")
    streamed = checkpoint.quantize_checkpoint(tiny, method, tmp_path / "streamed", options=options)
    monkeypatch.setattr(checkpoint, "quantizes_at_load", lambda *a: False)
    whole = checkpoint.quantize_checkpoint(tiny, method, tmp_path / "whole", options=options,
                                           stream_layers=False)
    a, b = load_file(str(streamed / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert json.loads((streamed / "config.json").read_text()) == json.loads(
        (whole / "config.json").read_text())


def test_calibrated_or_configured_methods_quantize_after_loading() -> None:
    from slipstream.quantization import checkpoint, int4_awq, int8_wo, w8a8_sq

    assert not checkpoint.quantizes_at_load("int4_awq", int4_awq, None, "cpu")  # AWQ search
    assert not checkpoint.quantizes_at_load("w8a8_sq", w8a8_sq, None, "cpu")  # smoothing
    assert not checkpoint.quantizes_at_load("int8_wo", int8_wo, {"x": 1}, "cpu")
    assert not checkpoint.quantizes_at_load("int4_awq", int4_awq, {"group_size": 64, "awq": False},
                                            "cpu")  # the load-time method has group 128
    assert not checkpoint.quantizes_at_load("none", None, None, "cpu")


def test_a_big_checkpoint_is_written_in_shards_that_reload(tiny, tmp_path, prompts):
    """Past max_shard_bytes the weights go to model-0000i-of-0000n.safetensors with an index
    (one shard on the host at a time); the sharded checkpoint loads and generates exactly as
    the single-file one, and a rerun into the same directory leaves no stale shard behind."""
    from safetensors.torch import load_file

    from slipstream.quantization.checkpoint import INDEX_FILE, quantize_checkpoint

    one = quantize_checkpoint(tiny, "int8_wo", tmp_path / "one")
    sharded = quantize_checkpoint(tiny, "int8_wo", tmp_path / "sharded", max_shard_bytes=40_000)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / INDEX_FILE).read_text())
    whole = load_file(str(one / "model.safetensors"))
    assert set(index["weight_map"]) == set(whole) and set(index["weight_map"].values()) == set(files)
    parts = {}
    for f in files:
        part = load_file(str(sharded / f))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 40_000 or len(part) == 1
        parts.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    assert all(torch.equal(parts[k], whole[k]) for k in whole)
    a = [o.outputs[0].token_ids for o in _llm(one).generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in _llm(sharded).generate(prompts, GREEDY, use_tqdm=False)]
    assert a == b
    again = quantize_checkpoint(tiny, "int8_wo", tmp_path / "sharded")  # now one file
    assert sorted(p.name for p in again.glob("*.safetensors")) == ["model.safetensors"]
    assert not (again / INDEX_FILE).exists()


def test_quantize_refuses_to_write_over_its_source(tiny):
    from slipstream.quantization.checkpoint import quantize_checkpoint

    with pytest.raises(ValueError, match="must differ from the source"):
        quantize_checkpoint(tiny, "int8_wo", tiny)


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6),
                                       ("2GiB", 2 * 2**30), ("1000", 1000), ("0.5 gb", 5 * 10**8)])
def test_max_shard_size_parses_like_transformers(text, size):
    from slipstream.quantization.cli import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5XB", "-1GB", "0", "GB", ""])
def test_max_shard_size_rejects_nonsense(text):
    from slipstream.quantization.cli import parse_size

    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


def _interleaved_shards(src: Path, dst: Path) -> Path:
    """`src` re-saved as three shards that split every decoder layer across files, in an order
    that is not the layers' (the embedding last): what a streamed load must put in order."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors, key=lambda n: (n.startswith("model.embed"), n[::-1]))
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    weight_map = {}
    for i in range(3):
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, str(dst / f"model-0000{i + 1}-of-00003.safetensors"))
        weight_map.update({n: f"model-0000{i + 1}-of-00003.safetensors" for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_streamed_awq_writes_the_same_checkpoint(tiny, tmp_path):
    """`slipstream quantize --method int4_awq` runs AWQ on each decoder layer while it loads
    (the float model never has to fit): the files are byte for byte those of the whole-model
    path, also from shards that scatter the layers."""
    from safetensors.torch import load_file

    from slipstream.quantization import checkpoint

    kw = dict(num_calib_samples=4)
    whole = checkpoint.quantize_checkpoint(tiny, "int4_awq", tmp_path / "whole",
                                           stream_layers=False, **kw)
    want = load_file(str(whole / "model.safetensors"))
    shards = _interleaved_shards(tiny, tmp_path / "shards")
    for src, name in ((tiny, "streamed"), (shards, "streamed-shards")):
        out = checkpoint.quantize_checkpoint(src, "int4_awq", tmp_path / name, **kw)
        got = load_file(str(out / "model.safetensors"))
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)
        assert json.loads((out / "config.json").read_text()) == json.loads(
            (whole / "config.json").read_text())


def test_streamed_awq_holds_one_float_layer(monkeypatch, tiny, tmp_path):
    """When AWQ runs on decoder layer i, layer i is whole and float (norms included), the
    layers before it are already INT4 and the ones after it have no weights yet."""
    from slipstream.quantization import awq, checkpoint

    seen = []
    real_call = awq.LayerByLayerAwq.__call__

    def spy(self, model, index, layer):
        layers = model.model.layers
        assert not layer.self_attn.qkv_proj.weight.is_meta
        assert layer.self_attn.qkv_proj.weight.is_floating_point()
        assert torch.isfinite(layer.input_layernorm.weight).all()
        for lay in layers[:index]:  # packed INT4, no float weight left
            params = dict(lay.mlp.down_proj.named_parameters(recurse=False))
            assert "weight" not in params and params["qweight"].dtype == torch.uint8
        assert all(lay.mlp.down_proj.weight.is_meta for lay in layers[index + 1:])
        seen.append(index)
        return real_call(self, model, index, layer)

    monkeypatch.setattr(awq.LayerByLayerAwq, "__call__", spy)
    checkpoint.quantize_checkpoint(tiny, "int4_awq", tmp_path / "out", num_calib_samples=2)
    assert seen == [0, 1]


def test_layer_by_layer_awq_refuses_layers_out_of_order(tiny):
    """The residual stream it carries belongs to the next layer in order: any other is a clear
    error, not a silently wrong search."""
    from slipstream.quantization.awq import LayerByLayerAwq

    model = _llm(tiny).engine.runner.model
    awq = LayerByLayerAwq([[5, 6, 7, 8]], group_size=128)
    with pytest.raises(RuntimeError, match="layer 1 arrived before layer 0"):
        awq(model, 1, model.model.layers[1])


@pytest.mark.gpu
def test_gpu_streamed_awq_writes_the_same_checkpoint(tiny, tmp_path):
    """On CUDA (bf16, the engine's GPU load path), streamed AWQ equals the whole-model path."""
    from safetensors.torch import load_file

    from slipstream.quantization import checkpoint

    kw = dict(num_calib_samples=4, device="cuda")
    whole = checkpoint.quantize_checkpoint(tiny, "int4_awq", tmp_path / "whole",
                                           stream_layers=False, **kw)
    streamed = checkpoint.quantize_checkpoint(tiny, "int4_awq", tmp_path / "streamed", **kw)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(streamed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8", "int8_wo"])
def test_gpu_gate_up_act_decodes_the_same_tokens(monkeypatch, tiny, prompts, quantization):
    """At batch 1 the gate/up GEMV writes SiLU(gate)·up and the down projection reads it
    plainly; greedy tokens (CUDA graphs, bf16) equal the two-step path's. Norms
    unfolded: with them folded the two paths also differ in where x is normalised (bf16
    rounding); test_norm_fold.py / test_gpu_e2e.py check the folded paths in float32."""
    from slipstream.layers.linear import MergedColumnParallelLinear
    from slipstream.models import norm_fold

    gate_out = MergedColumnParallelLinear.forward_gate_out

    if quantization == "fp8":
        skip_without_fp8()

    def tokens(flag: bool) -> list[list[int]]:
        monkeypatch.setattr(MergedColumnParallelLinear, "forward_gate_out",
                            gate_out if flag else lambda *a, **k: None)
        with norm_fold.kept_norms():
            llm = LLM(str(tiny), device="cuda", dtype="bfloat16", quantization=quantization,
                      kv_cache_memory=64 << 20, max_num_seqs=1)
        return [list(o.outputs[0].token_ids) for o in
                llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]

    assert tokens(True) == tokens(False)


@pytest.mark.gpu
def test_gpu_w4_gate_out_decodes_the_same_tokens(monkeypatch, tiny, prompts):
    """int4_awq: at batch 1 the W4 gate/up GEMV
    writes SiLU(gate)·up; greedy tokens (CUDA graphs, bf16) equal those of the two-step path
    (norms unfolded, as in the test above)."""
    from slipstream.models import norm_fold
    from slipstream.quantization import int4_awq

    gate_out = int4_awq.Int4LinearMethod.apply_gate_out

    def tokens(flag: bool) -> list[list[int]]:
        monkeypatch.setattr(int4_awq.Int4LinearMethod, "apply_gate_out",
                            gate_out if flag else lambda *a, **k: None)
        with norm_fold.kept_norms():
            llm = LLM(str(tiny), device="cuda", dtype="bfloat16", quantization="int4_awq",
                      kv_cache_memory=64 << 20, max_num_seqs=1)
        return [list(o.outputs[0].token_ids) for o in
                llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]

    assert tokens(True) == tokens(False)
