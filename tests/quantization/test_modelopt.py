"""NVIDIA ModelOpt FP8 checkpoints (nvidia/*-FP8, TensorRT-LLM's usual input): per-tensor weight
scales, static input scales, `ignore` / `exclude_modules` lists, FP8 KV-cache scales on k_proj /
v_proj, and the older exports whose settings live only in hf_quant_config.json.

Measure of equality: the 16 greedy tokens of 4 prompts and the teacher-forced logprob of each,
bit for bit against a `quant_method: fp8` per-channel checkpoint holding the same values (CPU
reference math).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.quantization.base import UnquantizedLinearMethod
from slipstream.quantization.fp8 import Fp8LinearMethod
from slipstream.quantization.kv_cache import attention_layers
from slipstream.quantization.utils import (
    FP8_DTYPE,
    FP8_MAX,
    check_checkpoint_method,
    detect_quant_method,
)
from tests.quantization.checkpoint_io import greedy_and_scores, llama_hf_config, load_llm, quantized_layers
from tests.quantization.test_fp8_checkpoints import per_channel, write_checkpoint

# Layer 1's MLP stays float, named by a wildcard as ModelOpt lists writes them.
IGNORE = ["lm_head", "model.layers.1.mlp*"]
FLOAT_MODULES = frozenset({"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
                           "model.layers.1.mlp.down_proj"})
FLAT = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
        "ignore": IGNORE, "producer": {"name": "modelopt", "version": "0.31.0"}}


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, 0-d float32 scale) as ModelOpt's max calibration writes them."""
    scale = (w.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())


def modelopt_layer(module: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    if module in FLOAT_MODULES:
        return None
    q, scale = _per_tensor(w)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(0.0123)}


def same_values_per_channel(module: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The reference: the per-tensor values, the scale repeated for every output channel."""
    if module in FLOAT_MODULES:
        return None
    q, scale = _per_tensor(w)
    return {"weight": q, "weight_scale": scale.expand(w.shape[0]).clone()}


def _reference(tiny_llama_dir: Path, out: Path) -> Path:
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
          "modules_to_not_convert": sorted(FLOAT_MODULES)}
    return write_checkpoint(tiny_llama_dir, out, qc, same_values_per_channel)


def test_modelopt_fp8_matches_per_channel_checkpoint(tiny_llama_dir, prompts, tmp_path) -> None:
    path = write_checkpoint(tiny_llama_dir, tmp_path / "modelopt", FLAT, modelopt_layer)
    assert detect_quant_method(json.loads((path / "config.json").read_text())) == "fp8"
    llm = load_llm(path)
    for name, layer in quantized_layers(llm).items():
        if name.startswith("model.layers.1.mlp."):
            assert type(layer.quant_method) is UnquantizedLinearMethod, name
        else:
            assert isinstance(layer.quant_method, Fp8LinearMethod), name
            assert layer.quant_method.static_input_scale  # read, unused (dynamic per token)
            assert layer.weight.dtype == FP8_DTYPE
    qkv = quantized_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    ckpt = load_file(str(path / "model.safetensors"))
    want = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.weight_scale"].expand(n)
                      for p, n in zip("qkv", qkv.output_sizes)])
    assert torch.equal(qkv.weight_scale.cpu(), want)  # each shard's scalar over its own rows
    reference = load_llm(_reference(tiny_llama_dir, tmp_path / "reference"))
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(reference, prompts)


def _legacy_export(tiny_llama_dir: Path, out: Path, kv_scales: dict[str, float]) -> Path:
    """An older ModelOpt export: no quantization_config in config.json, the settings in
    hf_quant_config.json, FP8 KV-cache scales on k_proj / v_proj."""
    path = write_checkpoint(tiny_llama_dir, out, None, modelopt_layer)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({name: torch.tensor(v) for name, v in kv_scales.items()})
    save_file(tensors, str(path / "model.safetensors"))
    settings = {"producer": {"name": "modelopt", "version": "0.19.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                 "exclude_modules": IGNORE}}
    (path / "hf_quant_config.json").write_text(json.dumps(settings))
    return path


def test_legacy_hf_quant_config_with_fp8_kv_cache(tiny_llama_dir, prompts, tmp_path) -> None:
    scales = {}
    for layer in range(2):
        scales[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = 0.05 + 0.01 * layer
        scales[f"model.layers.{layer}.self_attn.v_proj.v_scale"] = 0.02 + 0.01 * layer
    llm = load_llm(_legacy_export(tiny_llama_dir, tmp_path / "legacy", scales))
    assert llm.engine.runner.kv_cache_dtype == torch.float8_e4m3fn  # "auto" follows the checkpoint
    for i, (_, attn) in enumerate(attention_layers(llm.engine.runner.model)):
        assert attn.k_scale.item() == pytest.approx(0.05 + 0.01 * i)
        assert attn.v_scale.item() == pytest.approx(0.02 + 0.01 * i)
        assert attn.kv_scales_from_checkpoint == {"k_scale", "v_scale"}
    assert isinstance(quantized_layers(llm)["model.layers.0.mlp.gate_up_proj"].quant_method,
                      Fp8LinearMethod)
    # The same as slipstream's own layout of those values: the flat config, the scales under
    # self_attn, kv_cache_dtype recorded in config.json.
    ours = write_checkpoint(tiny_llama_dir, tmp_path / "ours", FLAT, modelopt_layer)
    tensors = load_file(str(ours / "model.safetensors"))
    tensors.update({name.replace("k_proj.", "").replace("v_proj.", ""): torch.tensor(v)
                    for name, v in scales.items()})
    save_file(tensors, str(ours / "model.safetensors"))
    config = json.loads((ours / "config.json").read_text())
    (ours / "config.json").write_text(json.dumps({**config, "kv_cache_dtype": "fp8"}))
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(ours), prompts)


@pytest.mark.parametrize("algo", ["NVFP4", "W4A8_AWQ", "INT4_AWQ", "MIXED_PRECISION", "FP8_PB_WO",
                                  None])
def test_other_modelopt_algorithms_are_clear_errors(algo) -> None:
    qc = {"quant_method": "modelopt", "quant_algo": algo}
    with pytest.raises(ValueError, match=f"ModelOpt checkpoint with quant_algo={algo!r} is not "
                                         "supported; supported: FP8"):
        detect_quant_method(llama_hf_config(qc))


def test_modelopt_fp8_is_not_another_method() -> None:
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": "fp8"}}  # any case
    assert check_checkpoint_method("fp8", llama_hf_config(nested))
    with pytest.raises(ValueError, match="already quantized with 'fp8'"):
        check_checkpoint_method("int8_wo", llama_hf_config(FLAT))


@pytest.mark.parametrize(("name", "targets"), [
    ("model.layers.3.self_attn.k_proj.k_scale", ("k_scale",)),
    ("model.layers.3.self_attn.v_proj.v_scale", ("v_scale",)),
    ("model.layers.3.self_attn.qkv_proj.k_scale", ("k_scale",)),  # exports with fused q/k/v
    ("model.layers.3.self_attn.k_scale", ("k_scale",)),
    ("model.layers.3.self_attn.kv_scale", ("k_scale", "v_scale"))])
def test_kv_scale_names(name, targets) -> None:
    from slipstream.quantization.kv_cache import _split_scale_name

    assert _split_scale_name(name) == ("model.layers.3.self_attn", targets)


def test_per_channel_per_token_checkpoint(tiny_llama_dir, prompts, tmp_path) -> None:
    """FP8_PER_CHANNEL_PER_TOKEN: per-channel weight scales, no input scales; the same function
    as a `quant_method: fp8` per-channel checkpoint of the same values."""
    qc = {**FLAT, "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    path = write_checkpoint(tiny_llama_dir, tmp_path / "pcpt", qc, per_channel(FLOAT_MODULES))
    llm = load_llm(path)
    qkv = quantized_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv.quant_method, Fp8LinearMethod)
    assert not qkv.quant_method.static_input_scale and "input_scale" not in qkv._parameters
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic",
           "modules_to_not_convert": sorted(FLOAT_MODULES)}
    reference = load_llm(write_checkpoint(tiny_llama_dir, tmp_path / "fp8", fp8, per_channel(FLOAT_MODULES)))
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(reference, prompts)
