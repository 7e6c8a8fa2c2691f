"""compressed-tensors INT8 checkpoints: llm-compressor "W8A8" (int8 weights per channel, int8 dynamic
per-token activations) loads as w8a8_sq, "W8A16" (int8 weights only; int-/naive-quantized or
pack-quantized) as int8_wo.

Each test writes the same int8 values and scales twice: in the compressed-tensors layout and in
slipstream's own `quant_method: w8a8_sq` / `int8_wo` layout (`weight` int8, `weight_scale` float32
[N]). Both must compute the same function: the greedy tokens and their teacher-forced logprobs,
bit for bit. Pack-quantized words are written by this file's packer, after compressed-tensors'
pack_to_int32 (num_bits 8: value + 128 per byte, four per int32, lowest byte first).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from slipstream.quantization import int8_wo, w8a8_sq
from slipstream.quantization.base import UnquantizedLinearMethod
from slipstream.quantization.int8_wo import Int8WeightOnlyMethod, unpack_int8_cols
from slipstream.quantization.utils import detect_quant_method, quantize_int8_per_channel
from slipstream.quantization.w8a8_sq import W8A8SmoothQuantMethod
from tests.quantization.checkpoint_io import (
    compressed_tensors_config,
    greedy_and_scores,
    llama_hf_config,
    load_llm,
    quantized_layers,
    save_checkpoint,
)
from tests.quantization.test_compressed_tensors import DYNAMIC_TOKEN, FP8_WEIGHTS

LINEAR = re.compile(r"(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj)\.weight$")

# Arguments as llm-compressor writes them (W8A8 / W8A16 presets): the FP8 ones with int type.
INT8_WEIGHTS = {**FP8_WEIGHTS, "type": "int"}
INT8_TOKEN = {**DYNAMIC_TOKEN, "type": "int"}
INT8_STATIC_TENSOR = {**INT8_TOKEN, "strategy": "tensor", "dynamic": False, "observer": "minmax"}


def ct_config(weights: dict | None = None, activations: dict | None = INT8_TOKEN,
              ignore: list[str] | None = None, fmt: str = "int-quantized") -> dict:
    return compressed_tensors_config({**INT8_WEIGHTS, **(weights or {})}, activations, ignore, fmt)


def pack_int8_cols(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int32 [N, ceil(K/4)]: value + 128 per byte, lowest byte first, the last
    word zero-padded (compressed-tensors pack_to_int32 with num_bits 8)."""
    u = F.pad(q.to(torch.int64) + 128, (0, -q.shape[1] % 4))
    word = (u.reshape(q.shape[0], -1, 4) << (8 * torch.arange(4))).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _ct_module_tensors(module: str, q: torch.Tensor, scale: torch.Tensor, fmt: str,
                       scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One linear module in the compressed-tensors layout (scale [N, 1] in scale_dtype)."""
    out = {f"{module}.weight_scale": scale[:, None].to(scale_dtype)}
    if fmt == "pack-quantized":
        out[f"{module}.weight_packed"] = pack_int8_cols(q)
        out[f"{module}.weight_shape"] = torch.tensor(list(q.shape))
    else:
        out[f"{module}.weight"] = q
    return out


def write_pair(src: Path, dst: Path, ct: dict, reference: dict, *,
               scale_dtype: torch.dtype = torch.bfloat16,
               keep_float: frozenset[str] = frozenset()) -> tuple[Path, Path]:
    """(compressed-tensors checkpoint, slipstream `reference` checkpoint) of the same int8 values.

    keep_float: modules (HF names) left float in the compressed-tensors one (the reference has
    every linear layer quantized). Static input activations: one made-up input_scale per module.
    """
    fmt = ct["config_groups"]["group_0"].get("format") or ct["format"]
    acts = ct["config_groups"]["group_0"]["input_activations"]
    static = acts is not None and acts.get("dynamic") is False
    ct_tensors, ref_tensors = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        m = LINEAR.match(name)
        if m is None:
            ct_tensors[name] = ref_tensors[name] = t
            continue
        module = m.group(1)
        q, scale = quantize_int8_per_channel(t)
        scale = scale.to(scale_dtype).float()  # representable in the checkpoint's dtype
        ref_tensors.update({name: q, f"{module}.weight_scale": scale})
        if module in keep_float:
            ct_tensors[name] = t
            continue
        ct_tensors.update(_ct_module_tensors(module, q, scale, fmt, scale_dtype))
        if static:
            ct_tensors[f"{module}.input_scale"] = torch.tensor([0.01 + 0.001 * len(ct_tensors)])
    return (save_checkpoint(src, dst / "ct", ct_tensors, ct),
            save_checkpoint(src, dst / "ref", ref_tensors, reference))


def _config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _check_qkv(llm, ct_dir: Path, method_type: type) -> None:
    """qkv_proj is `method_type` with the int8 values and float32 [N] scales, q then k then v."""
    qkv = quantized_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    assert type(qkv.quant_method) is method_type
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.dtype == torch.float32
    assert "weight_packed" not in qkv._parameters and "weight_shape" not in qkv._parameters
    ckpt = load_file(str(ct_dir / "model.safetensors"))
    scales = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"])
    assert torch.equal(qkv.weight_scale, scales.float().reshape(-1))
    original = load_file(str(ct_dir.parent / "ref" / "model.safetensors"))
    want = torch.cat([original[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight, want)


@pytest.mark.parametrize("quantization", [None, "w8a8_sq"])  # auto-detected, explicit
@pytest.mark.parametrize("fmt", ["int-quantized", "naive-quantized"])
def test_w8a8_matches_w8a8_sq_checkpoint(tiny_llama_dir, prompts, tmp_path, quantization, fmt) -> None:
    ct_dir, ref_dir = write_pair(tiny_llama_dir, tmp_path, ct_config(fmt=fmt), w8a8_sq.checkpoint_config())
    assert detect_quant_method(_config_of(ct_dir)) == "w8a8_sq"
    llm = load_llm(ct_dir, quantization)
    _check_qkv(llm, ct_dir, W8A8SmoothQuantMethod)
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(ref_dir), prompts)


def test_w8a8_static_input_scales_load_unused(tiny_llama_dir, prompts, tmp_path, caplog) -> None:
    """Static per-tensor activations: the input_scale tensors land (one per fused shard) and the
    layers still quantize their inputs per token, like the w8a8_sq checkpoint."""
    ct = ct_config(activations=INT8_STATIC_TENSOR)
    ct_dir, ref_dir = write_pair(tiny_llama_dir, tmp_path, ct, w8a8_sq.checkpoint_config(),
                                 scale_dtype=torch.float16)
    with caplog.at_level("INFO", logger="slipstream.quantization.compressed_tensors"):
        llm = load_llm(ct_dir)
    assert "unused" in caplog.text
    gate_up = quantized_layers(llm)["model.layers.1.mlp.gate_up_proj"]
    ckpt = load_file(str(ct_dir / "model.safetensors"))
    for shard, name in enumerate(("gate_proj", "up_proj")):
        assert gate_up.input_scale[shard] == ckpt[f"model.layers.1.mlp.{name}.input_scale"]
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(ref_dir), prompts)


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized", "naive-quantized"])
def test_w8a16_matches_int8_wo_checkpoint(tiny_llama_dir, prompts, tmp_path, fmt) -> None:
    ct_dir, ref_dir = write_pair(tiny_llama_dir, tmp_path, ct_config(activations=None, fmt=fmt),
                                 int8_wo.checkpoint_config(), scale_dtype=torch.float32)
    assert detect_quant_method(_config_of(ct_dir)) == "int8_wo"
    llm = load_llm(ct_dir)
    _check_qkv(llm, ct_dir, Int8WeightOnlyMethod)
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(ref_dir), prompts)


def test_hand_packed_words_unpack_lowest_byte_first() -> None:
    """0xFF807F00 holds -128, -1, 0, 127 (value + 128 per byte, byte 0 first); K = 6 pads the
    second word, whose padding is dropped."""
    q = torch.tensor([[-128, -1, 0, 127, 5, -7]], dtype=torch.int8)
    words = torch.tensor([[0xFF807F00 - 2**32, 0x7985]], dtype=torch.int32)
    assert torch.equal(pack_int8_cols(q), words)
    assert torch.equal(unpack_int8_cols(words, 6), q)


def _as_float(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """Turn a loaded int8 layer into the float one the ignore list asks for."""
    layer.quant_method = UnquantizedLinearMethod()
    layer._parameters.pop("weight_scale", None)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16 packed"])
def test_ignored_layers_stay_float(tiny_llama_dir, prompts, tmp_path, scheme) -> None:
    ignore = ["lm_head", r"re:model\.layers\.0\.self_attn\.[qkv]_proj$",
              "model.layers.1.mlp.down_proj"]
    float_modules = frozenset({"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                               "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"})
    if scheme == "w8a8":
        ct, ref, method = ct_config(ignore=ignore), w8a8_sq.checkpoint_config(), W8A8SmoothQuantMethod
    else:
        ct = ct_config(activations=None, ignore=ignore, fmt="pack-quantized")
        ref, method = int8_wo.checkpoint_config(), Int8WeightOnlyMethod
    ct_dir, ref_dir = write_pair(tiny_llama_dir, tmp_path, ct, ref, keep_float=float_modules)
    llm = load_llm(ct_dir)
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    floats = {"model.layers.0.self_attn.qkv_proj": torch.cat(
                  [original[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
              "model.layers.1.mlp.down_proj": original["model.layers.1.mlp.down_proj.weight"]}
    for name, layer in quantized_layers(llm).items():
        if name in floats:
            assert type(layer.quant_method) is UnquantizedLinearMethod, name
            assert torch.equal(layer.weight, floats[name]), name
        else:
            assert type(layer.quant_method) is method and layer.weight.dtype == torch.int8, name
    want = load_llm(ref_dir)  # the all-int8 model with those layers made float by hand
    for name, layer in quantized_layers(want).items():
        if name in floats:
            _as_float(layer, floats[name])
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(want, prompts)


UNSUPPORTED = {
    "int8 group": (ct_config({"strategy": "group", "group_size": 128}),
                   r"int8 group\(128\) static.*weights strategy 'group'"),
    "int8 per-tensor weights": (ct_config({"strategy": "tensor"}), "weights strategy 'tensor'"),
    "asymmetric weights": (ct_config({"symmetric": False}, None), "weights are asymmetric"),
    "asymmetric activations": (ct_config(activations={**INT8_TOKEN, "symmetric": False}),
                               "input activations are asymmetric"),
    "dynamic per-tensor activations": (ct_config(activations={**INT8_TOKEN, "strategy": "tensor"}),
                                       "input activations strategy 'tensor' with dynamic=True"),
    "W4A8": (ct_config({"num_bits": 4}), r"int4 channel static.*weights are int4, not int8"),
    "W8A8 pack-quantized": (ct_config(fmt="pack-quantized"),
                            r"'pack-quantized'.*int8_wo: activations are quantized"),
    "W8A16 marlin-24": (ct_config(activations=None, fmt="marlin-24"), "format 'marlin-24'"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_int8_schemes_are_clear_errors(case) -> None:
    qc, what = UNSUPPORTED[case]
    with pytest.raises(ValueError, match=what) as err:
        detect_quant_method(llama_hf_config(qc))
    assert "supported: " in str(err.value) and "INT8 W8A8" in str(err.value)


def test_explicit_other_method_is_the_mismatch_error(tiny_llama_dir, tmp_path) -> None:
    w8a8_dir, _ = write_pair(tiny_llama_dir, tmp_path / "a", ct_config(), w8a8_sq.checkpoint_config())
    w8a16_dir, _ = write_pair(tiny_llama_dir, tmp_path / "b",
                              ct_config(activations=None, fmt="pack-quantized"),
                              int8_wo.checkpoint_config())
    for path, found, other in ((w8a8_dir, "w8a8_sq", "int8_wo"), (w8a8_dir, "w8a8_sq", "fp8"),
                               (w8a16_dir, "int8_wo", "w8a8_sq")):
        with pytest.raises(ValueError, match=f"already quantized with '{found}'"):
            load_llm(path, other)
