"""int4_awq on models whose sizes the group does not divide (as SmolLM2-135M's hidden 576 at 128),
at group sizes 32, 64, 128 and per channel, with output sizes that are not multiples of 8: greedy
output equal to Hugging Face transformers on the dequantized twin; `slipstream quantize
--group-size` checkpoints and AWQ / GPTQ / compressed-tensors checkpoints with short groups load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream import LLM, SamplingParams
from slipstream.models import norm_fold
from slipstream.quantization import int4_awq
from slipstream.quantization import utils as qu
from slipstream.quantization.utils import detect_quant_method
from tests.helpers import greedy_ids, load_hf_model
from tests.quantization.checkpoint_io import run_quantize_cli

PROMPTS = [[5, 17, 99, 300, 41], [7, 8, 9, 10, 11, 12, 13]]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def odd_model(tiny_checkpoint) -> Path:
    """hidden 160 (2.5 groups of 64, 1.25 of 128), intermediate 288, k / v of 2 x 50 = 100 rows
    (not a multiple of 8), o_proj input 200."""
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=160, intermediate_size=288, head_dim=50, seed=3)


@pytest.fixture(scope="module")
def awq_model(tiny_checkpoint) -> Path:
    """The same short groups with every output size a multiple of 8 (the AutoAWQ layout packs
    eight output channels an int32)."""
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=160, intermediate_size=288, head_dim=40, seed=4)


def _quantize_int4(model: Path, out: Path, group: str, *extra: str) -> dict:
    """`slipstream quantize --method int4_awq --group-size GROUP EXTRA...`; the written config."""
    args = ["quantize", "--model", str(model), "--method", "int4_awq", "--output", str(out)]
    assert run_quantize_cli([*args, "--group-size", group, *extra]) == 0
    return json.loads((out / "config.json").read_text())


def _twin(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A float checkpoint: src's files with `tensors` replaced."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({**load_file(str(src / "model.safetensors")), **tensors}, str(dst / "model.safetensors"))
    return dst


def _rtn_twin(src: Path, dst: Path, group: int) -> Path:
    """Every projection rounded to nearest in groups of `group` (0: per channel) and dequantized
    with float16 scales, as int4_awq stores them: what the int4 model computes."""
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            g = group or w.shape[1]
            q, s, z = qu.quantize_int4_groupwise(w, g)
            out[name] = qu.dequantize_int4_groupwise(q, s.half(), z, group_size=g)
    return _twin(src, dst, out)


def _slipstream_greedy(path: Path, quantization: str | None = None) -> tuple[list, LLM]:
    llm = LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.usefixtures("int4_reference")
@pytest.mark.parametrize("group", [32, 64, 128, 0], ids=["g32", "g64", "g128", "per-channel"])
def test_int4_any_group_equals_the_dequantized_twin(odd_model, tmp_path, monkeypatch, group) -> None:
    monkeypatch.setattr(int4_awq, "DEFAULT_GROUP", group or -1)  # -1: per channel
    with norm_fold.kept_norms():  # the twin holds the unfolded weights
        got, llm = _slipstream_greedy(odd_model, "int4_awq")
    layers = llm.engine.runner.model.model.layers[0]
    qkv, o = layers.self_attn.qkv_proj, layers.self_attn.o_proj
    assert qkv.int4_group_size == (group or 160) and o.int4_group_size == (group or 200)
    assert qkv.scales.shape == (400, -(-160 // (group or 160))) and qkv.qweight.shape == (400, 80)
    assert qkv.output_sizes == [200, 100, 100]
    twin = load_hf_model(_rtn_twin(odd_model, tmp_path / "twin", group))
    assert got == greedy_ids(twin, PROMPTS, MAX_NEW)


def _awq_twin(ckpt: Path, dst: Path, group: int) -> Path:
    """The float twin of an AutoAWQ checkpoint: each projection's integers dequantized (group 0:
    per channel)."""
    out = {}
    tensors = load_file(str(ckpt / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".qweight")]:
        base = name.removesuffix(".qweight")
        q = qu.unpack_int32_cols(tensors[name], qu.AWQ_ORDER).t()
        zeros = qu.unpack_int32_cols(tensors[f"{base}.qzeros"], qu.AWQ_ORDER).t()
        scales = tensors[f"{base}.scales"].t()
        out[f"{base}.weight"] = qu.dequantize_int4_groupwise(q, scales, zeros, group_size=group or q.shape[1])
    floats = {n: t for n, t in tensors.items() if not n.endswith((".qweight", ".qzeros", ".scales"))}
    dst.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    save_file({**floats, **out}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.usefixtures("int4_reference")
def test_quantize_group_size_64_writes_and_reloads(awq_model, tmp_path) -> None:
    """`slipstream quantize --method int4_awq --group-size 64` (AWQ on): the group size in the
    checkpoint's config, short last groups of 32 in the files (hidden 160), and the reloaded
    model's greedy output equal to transformers on the checkpoint's dequantized integers."""
    out = tmp_path / "g64"
    config = _quantize_int4(awq_model, out, "64", "--num-calib-samples", "4", "--max-calib-len", "64")
    assert config["quantization_config"]["group_size"] == 64
    scales = load_file(str(out / "model.safetensors"))["model.layers.0.mlp.gate_proj.scales"]
    assert scales.shape == (3, 288)  # ceil(160 / 64) groups
    got, llm = _slipstream_greedy(out, detect_quant_method(config))
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.int4_group_size == 64 and down.scales.shape == (160, 5)  # 288 = 4.5 x 64
    twin = load_hf_model(_awq_twin(out, tmp_path / "twin", 64))
    assert got == greedy_ids(twin, PROMPTS, MAX_NEW)


def _write_prequantized(src: Path, dst: Path, layout: str, group: int) -> Path:
    """src re-saved with every projection RTN-quantized in groups of `group` (short last
    groups), in the AutoAWQ, GPTQ v1 or compressed-tensors pack-quantized layout."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = t
            continue
        q, scales, zeros = qu.quantize_int4_groupwise(t, group)
        base = name.removesuffix(".weight")
        if layout == "awq":
            tensors[f"{base}.qweight"] = qu.pack_int32_cols(q.t().contiguous(), qu.AWQ_ORDER)
            tensors[f"{base}.qzeros"] = qu.pack_int32_cols(zeros.t().contiguous(), qu.AWQ_ORDER)
            tensors[f"{base}.scales"] = scales.t().contiguous().half()
        elif layout == "gptq":
            tensors[f"{base}.qweight"] = qu.pack_int32_cols(q).t().contiguous()
            z = ((zeros.to(torch.int16) - 1) & 0xF).to(torch.uint8)
            tensors[f"{base}.qzeros"] = qu.pack_int32_cols(z.t().contiguous())
            tensors[f"{base}.g_idx"] = (torch.arange(t.shape[1]) // group).to(torch.int32)
            tensors[f"{base}.scales"] = scales.t().contiguous().half()
        else:  # compressed-tensors, asymmetric: signed zero points, [N, groups]
            tensors[f"{base}.weight_packed"] = qu.pack_int32_cols(q)
            tensors[f"{base}.weight_scale"] = scales.half()
            tensors[f"{base}.weight_zero_point"] = zeros.to(torch.int8) - 8
            tensors[f"{base}.weight_shape"] = torch.tensor(list(t.shape))
    qc = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False},
        "compressed": _ct_config(group),
    }[layout]
    return _prequantized_dir(src, dst, tensors, qc)


def _ct_config(group: int) -> dict:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": group,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


def _prequantized_dir(src: Path, dst: Path, tensors: dict, qc: dict) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "layout,group", [("awq", 64), ("gptq", 128), ("compressed", 32), ("gptq", 32), ("compressed", 64)]
)
def test_prequantized_short_groups_load(awq_model, tmp_path, monkeypatch, layout, group) -> None:
    """A checkpoint's groups of 32 / 64 / 128 with short last groups (hidden 160, intermediate
    288) load, and generate what round-to-nearest at load with that group size generates."""
    path = _write_prequantized(awq_model, tmp_path / layout, layout, group)
    got, llm = _slipstream_greedy(path, detect_quant_method(json.loads((path / "config.json").read_text())))
    assert llm.engine.runner.model.model.layers[1].mlp.down_proj.int4_group_size == group
    monkeypatch.setattr(int4_awq, "DEFAULT_GROUP", group)
    with norm_fold.kept_norms():
        assert got == _slipstream_greedy(awq_model, "int4_awq")[0]


@pytest.mark.usefixtures("int4_reference")
def test_quantize_per_channel_writes_and_reloads(awq_model, tmp_path) -> None:
    """--group-size -1: one scale and zero per output row, written as GPTQ's -1."""
    out = tmp_path / "per-channel"
    config = _quantize_int4(awq_model, out, "-1", "--no-awq")
    assert config["quantization_config"]["group_size"] == -1
    got, llm = _slipstream_greedy(out, detect_quant_method(config))
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.int4_group_size == 288 and down.scales.shape == (160, 1)
    twin = load_hf_model(_awq_twin(out, tmp_path / "twin", 0))
    assert got == greedy_ids(twin, PROMPTS, MAX_NEW)


def test_norm_folds_into_int4_only_where_it_rounds_no_worse() -> None:
    """A gamma that spreads widely within the groups (a few large channels, as SmolLM2's norms
    have) makes the folded weight round worse: the fold is vetoed. A flat gamma folds."""
    method = int4_awq.Int4LinearMethod(64)
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(0))
    flat = torch.full((160,), 0.7)
    spiky = torch.ones(160)
    spiky[::37] = 40.0
    assert not method.fold_costs_accuracy(w, flat)
    assert method.fold_costs_accuracy(w, spiky)
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(spiky.clone(), requires_grad=False)
    linear = torch.nn.Linear(160, 96, bias=False)
    linear.quant_method = method
    assert not norm_fold.can_fold(linear, norm)
    norm.weight.data = flat.clone()
    assert norm_fold.can_fold(linear, norm)
