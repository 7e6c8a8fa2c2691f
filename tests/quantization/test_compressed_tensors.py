"""compressed-tensors FP8 checkpoints (llm-compressor "FP8" / "FP8-dynamic" layout).

Each test writes the same FP8 values (and scales) twice: in the compressed-tensors layout and in
the `quant_method: fp8` layout that slipstream already loads. Both must then compute the same
function: measure of equality, the 16 greedy tokens of 4 prompts and, teacher-forced, the
logprob of every one of those tokens, all bit for bit (same weights, same CPU reference math).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slipstream.quantization.base import UnquantizedLinearMethod
from slipstream.quantization.fp8 import Fp8LinearMethod
from slipstream.quantization.utils import FP8_DTYPE, FP8_MAX, detect_quant_method, quantize_fp8_per_channel
from tests.quantization.checkpoint_io import (
    compressed_tensors_config,
    greedy_and_scores,
    llama_hf_config,
    load_llm,
    quantized_layers,
    save_checkpoint,
)

LINEAR = re.compile(r"(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj)\.weight$")

# Float8 arguments as llm-compressor writes them (FP8_DYNAMIC / FP8 presets).
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
               "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                 "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                 "observer": None, "observer_kwargs": {}}
STATIC_TENSOR = {**DYNAMIC_TOKEN, "strategy": "tensor", "dynamic": False, "observer": "minmax"}
INT4_PACKED = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
               "symmetric": True, "dynamic": False, "actorder": None, "observer": "minmax"}


def ct_config(weights: dict | None = None, activations: dict | None = DYNAMIC_TOKEN,
              ignore: list[str] | None = None, fmt: str = "float-quantized", **extra) -> dict:
    return compressed_tensors_config(weights or FP8_WEIGHTS, activations, ignore, fmt, **extra)


def _quantize(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale [N] or []) with scales representable in scale_dtype."""
    if strategy == "channel":
        _, scale = quantize_fp8_per_channel(w)
    else:
        scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12)
    scale = scale.to(scale_dtype).float()
    per_row = scale[:, None] if scale.dim() else scale
    return (w.float() / per_row).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def write_pair(src: Path, dst: Path, *, strategy: str = "channel", static: bool = False,
               scale_dtype: torch.dtype = torch.float32, ct: dict | None = None,
               keep_float: set[str] = frozenset()) -> tuple[Path, Path]:
    """(compressed-tensors checkpoint, quant_method fp8 checkpoint) holding the same values.

    keep_float: modules (HF names) left float in the compressed-tensors one (the fp8 one has
    every linear layer quantized). Static input scales: one made-up value per layer.
    """
    tensors = load_file(str(src / "model.safetensors"))
    ct_tensors, fp8_tensors = {}, {}
    for name, t in tensors.items():
        m = LINEAR.match(name)
        if m is None:
            ct_tensors[name] = fp8_tensors[name] = t
            continue
        module = m.group(1)
        q, scale = _quantize(t, strategy, scale_dtype)
        fp8_tensors.update({name: q, f"{module}.weight_scale": scale})
        ct_tensors.update({name: q, f"{module}.weight_scale": (scale[:, None] if strategy ==
                           "channel" else scale.reshape(1)).to(scale_dtype)})
        if static:
            input_scale = torch.tensor(0.01 + 0.001 * len(fp8_tensors))
            fp8_tensors[f"{module}.input_scale"] = input_scale
            ct_tensors[f"{module}.input_scale"] = input_scale.reshape(1)
        if module in keep_float:
            for key in ("weight_scale", "input_scale"):
                ct_tensors.pop(f"{module}.{key}", None)
            ct_tensors[name] = t
    activations = STATIC_TENSOR if static else DYNAMIC_TOKEN
    ct = ct or ct_config({**FP8_WEIGHTS, "strategy": strategy}, activations)
    fp8 = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    return (save_checkpoint(src, dst / "ct", ct_tensors, ct),
            save_checkpoint(src, dst / "fp8", fp8_tensors, fp8))


@pytest.mark.parametrize("quantization", [None, "fp8"])  # auto-detected, explicit
@pytest.mark.parametrize("activations", ["dynamic", None])  # W8A8 per token, W8A16
def test_channel_fp8_matches_fp8_checkpoint(tiny_llama_dir, prompts, tmp_path, quantization,
                                            activations) -> None:
    ct = ct_config(activations=DYNAMIC_TOKEN if activations else None)
    ct_dir, fp8_dir = write_pair(tiny_llama_dir, tmp_path, scale_dtype=torch.bfloat16, ct=ct)
    assert detect_quant_method(json.loads((ct_dir / "config.json").read_text())) == "fp8"
    llm = load_llm(ct_dir, quantization)
    qkv = quantized_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv.quant_method, Fp8LinearMethod) and qkv.weight.dtype == FP8_DTYPE
    # [N, 1] bf16 checkpoint scales land as float32 [N], q then k then v.
    ckpt = load_file(str(ct_dir / "model.safetensors"))
    want = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"])
    assert qkv.weight_scale.dtype == torch.float32
    assert torch.equal(qkv.weight_scale, want.float().reshape(-1))
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(fp8_dir), prompts)


def test_tensor_fp8_static_matches_fp8_static_checkpoint(tiny_llama_dir, prompts, tmp_path) -> None:
    ct_dir, fp8_dir = write_pair(tiny_llama_dir, tmp_path, strategy="tensor", static=True)
    llm = load_llm(ct_dir)
    layers = quantized_layers(llm)
    gate_up = layers["model.layers.1.mlp.gate_up_proj"]
    assert gate_up.quant_method.static_input_scale
    ckpt = load_file(str(ct_dir / "model.safetensors"))
    # One per-tensor scale per fused shard, spread over its rows; one input scale per shard.
    for shard, (name, rows) in enumerate(zip(("gate_proj", "up_proj"), gate_up.output_sizes)):
        scale = ckpt[f"model.layers.1.mlp.{name}.weight_scale"]
        block = gate_up.weight_scale[shard * rows:(shard + 1) * rows]
        assert torch.equal(block, scale.expand(rows))
        assert gate_up.input_scale[shard] == ckpt[f"model.layers.1.mlp.{name}.input_scale"]
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(fp8_dir), prompts)


def _as_float(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """Turn a loaded fp8 layer into the float one the ignore list asks for."""
    layer.quant_method = UnquantizedLinearMethod()
    for name in ("weight_scale", "input_scale"):
        layer._parameters.pop(name, None)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)


def test_ignored_layers_stay_float(tiny_llama_dir, prompts, tmp_path) -> None:
    ignore = ["lm_head", r"re:model\.layers\.0\.self_attn\.[qkv]_proj$", r"re:.*\.1\.mlp\.down",
              "model.layers.1.self_attn.o_proj", "model.embed_tokens"]
    float_modules = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                     "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj",
                     "model.layers.1.self_attn.o_proj"}
    ct_dir, fp8_dir = write_pair(tiny_llama_dir, tmp_path, ct=ct_config(ignore=ignore),
                                 keep_float=float_modules)
    llm = load_llm(ct_dir)
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    floats = {"model.layers.0.self_attn.qkv_proj": torch.cat(
                  [original[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
              "model.layers.1.mlp.down_proj": original["model.layers.1.mlp.down_proj.weight"],
              "model.layers.1.self_attn.o_proj": original["model.layers.1.self_attn.o_proj.weight"]}
    for name, layer in quantized_layers(llm).items():
        if name in floats:
            assert type(layer.quant_method) is UnquantizedLinearMethod, name
            assert "weight_scale" not in layer._parameters
            assert torch.equal(layer.weight, floats[name]), name
        else:
            assert isinstance(layer.quant_method, Fp8LinearMethod), name
            assert layer.weight.dtype == FP8_DTYPE, name
    head = llm.engine.runner.model.lm_head
    assert head.weight.dtype == torch.float32 and torch.equal(head.weight, original["lm_head.weight"])
    # The same function as the all-fp8 model with those layers made float by hand.
    want = load_llm(fp8_dir)
    for name, layer in quantized_layers(want).items():
        if name in floats:
            _as_float(layer, floats[name])
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(want, prompts)


def test_partly_ignored_fused_layer_is_an_error(tiny_llama_dir, tmp_path) -> None:
    ct = ct_config(ignore=["lm_head", "model.layers.0.self_attn.k_proj"])
    ct_dir, _ = write_pair(tiny_llama_dir, tmp_path, ct=ct, keep_float={"model.layers.0.self_attn.k_proj"})
    with pytest.raises(ValueError, match=r"only some of the modules fused into "
                                         r"model\.layers\.0\.self_attn\.qkv_proj"):
        load_llm(ct_dir)


def test_quantized_lm_head_is_an_error(tiny_llama_dir, tmp_path) -> None:
    ct_dir, _ = write_pair(tiny_llama_dir, tmp_path, ct=ct_config(ignore=[]))
    with pytest.raises(ValueError, match="quantizes lm_head"):
        load_llm(ct_dir)


UNSUPPORTED = {
    "int4 W4A8 pack-quantized": (ct_config(INT4_PACKED, DYNAMIC_TOKEN, fmt="pack-quantized"),
                                 r"int4 group\(128\).*'pack-quantized'.*activations are quantized"),
    "fp8 group": (ct_config({**FP8_WEIGHTS, "strategy": "group", "group_size": 128}),
                  r"float8 group\(128\)"),
    "fp8 block without its shape": (ct_config({**FP8_WEIGHTS, "strategy": "block"}),
                                    "block_structure None"),
    "int8 w8a8 group": (ct_config({**FP8_WEIGHTS, "type": "int", "strategy": "group",
                                   "group_size": 128}, {**DYNAMIC_TOKEN, "type": "int"},
                                  fmt="int-quantized"), r"int8 group\(128\) static.*'int-quantized'"),
    "asymmetric": (ct_config({**FP8_WEIGHTS, "symmetric": False}), "asymmetric"),
    "static activations per group": (ct_config(activations={
        **DYNAMIC_TOKEN, "strategy": "group", "group_size": 16, "dynamic": False}),
        "input activations"),
    "2:4 sparse": (ct_config(sparsity_config={"format": "sparse-24-bitmask",
                                              "sparsity_structure": "2:4"}), "sparsity"),
    "two schemes": (ct_config(config_groups={
        "group_0": {"targets": [r"re:.*self_attn.*"], "weights": FP8_WEIGHTS,
                    "input_activations": DYNAMIC_TOKEN},
        "group_1": {"targets": [r"re:.*mlp.*"], "weights": INT4_PACKED,
                    "input_activations": None}}), "different schemes per config group"),
    "no groups": (ct_config(config_groups={}), "without config_groups"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_schemes_are_clear_errors(case) -> None:
    qc, what = UNSUPPORTED[case]
    with pytest.raises(ValueError, match=what) as err:
        detect_quant_method(llama_hf_config(qc))
    if case not in ("no groups", "2:4 sparse"):
        assert "supported: " in str(err.value) and "FP8" in str(err.value)


def test_same_scheme_in_two_groups_loads() -> None:
    group = {"weights": FP8_WEIGHTS, "input_activations": DYNAMIC_TOKEN}
    qc = ct_config(config_groups={"group_0": {"targets": [r"re:.*self_attn.*"], **group},
                                  "group_1": {"targets": [r"re:.*mlp.*"], **group}})
    assert detect_quant_method(llama_hf_config(qc)) == "fp8"


def test_int4_config_never_loads_fp8_tensors(tiny_llama_dir, tmp_path) -> None:
    int4 = {**INT4_PACKED, "group_size": 32}  # divides the tiny model's K: the tensors decide
    ct_dir, _ = write_pair(tiny_llama_dir, tmp_path, ct=ct_config(int4, None, fmt="pack-quantized"))
    with pytest.raises(ValueError, match=r"unexpected tensor '.*_proj\.weight'"):
        load_llm(ct_dir)  # int4_awq (W4A16) expects weight_packed, not float8 weights
    with pytest.raises(ValueError, match="already quantized with 'int4_awq'"):
        load_llm(ct_dir, "fp8")


def test_explicit_other_method_is_the_mismatch_error(tiny_llama_dir, tmp_path) -> None:
    ct_dir, _ = write_pair(tiny_llama_dir, tmp_path)
    with pytest.raises(ValueError, match="already quantized with 'fp8'"):
        load_llm(ct_dir, "int8_wo")


# --- FP8_BLOCK (llm-compressor's block preset) -----------------------------------------------------

def test_block_fp8_matches_hf_block_checkpoint(tiny_llama_dir, prompts, tmp_path, caplog) -> None:
    """Block scales stored as `weight_scale` (compressed-tensors) load like the same values as
    `weight_scale_inv` in an HF `weight_block_size` checkpoint: requantized per channel at load.
    Per-token-group activations (group 128) run per token, as every fp8 layer does."""
    from tests.quantization.test_fp8_checkpoints import BLOCK, write_block_checkpoints

    hf_path, _ = write_block_checkpoints(tiny_llama_dir, tmp_path / "hf")
    tensors = {name.replace(".weight_scale_inv", ".weight_scale"): t
               for name, t in load_file(str(hf_path / "model.safetensors")).items()}
    weights = {**FP8_WEIGHTS, "strategy": "block", "block_structure": list(BLOCK)}
    acts = {**DYNAMIC_TOKEN, "strategy": "group", "group_size": 128}
    ct_path = save_checkpoint(tiny_llama_dir, tmp_path / "ct", tensors, ct_config(weights, acts))
    assert detect_quant_method(json.loads((ct_path / "config.json").read_text())) == "fp8"
    with caplog.at_level("WARNING"):
        llm = load_llm(ct_path)
    assert any("requantized per output channel" in r.getMessage() for r in caplog.records)
    for name, layer in quantized_layers(llm).items():
        assert isinstance(layer.quant_method, Fp8LinearMethod), name
        assert layer.weight_scale.shape == (layer.output_size,), name
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(hf_path), prompts)


@pytest.mark.parametrize(("structure", "want"), [([128, 128], (128, 128)), ("64x32", (64, 32)),
                                                 ([128], None), ("128", None), (None, None),
                                                 ([0, 128], None)])
def test_block_structure_forms(structure, want) -> None:
    from slipstream.quantization.compressed_tensors import QuantArgs, block_size_of

    args = QuantArgs.parse({**FP8_WEIGHTS, "strategy": "block", "block_structure": structure})
    assert block_size_of(args) == want
