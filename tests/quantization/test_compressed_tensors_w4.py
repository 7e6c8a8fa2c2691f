"""compressed-tensors W4A16 checkpoints (llm-compressor "W4A16" / GPTQ, format pack-quantized) load
as int4_awq.

The tiny checkpoints here are written by this file's own packer, after the library's
pack_to_int32 (signed 4-bit q stored as q + 8, eight per int32, lowest nibble first; zero points
packed the same way along N). Beside each one, a float checkpoint holds the dequantized weights:
every loaded layer must dequantize to exactly those, and greedy output must match token for token.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import ColumnParallelLinear, QKVParallelLinear
from slipstream.quantization.base import UnquantizedLinearMethod, get_quant_method_factory
from slipstream.quantization.int4_awq import ACT_ORDER_PERM, Int4LinearMethod, dequantize_layer
from slipstream.quantization.utils import detect_quant_method
from tests.quantization.checkpoint_io import (
    compressed_tensors_config,
    llama_hf_config,
    load_llm,
    quantized_layers,
    save_checkpoint,
)

GROUP = 32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 300], [7, 8, 9, 10, 11], [400, 3, 250]]
LINEAR = re.compile(r"(model\.layers\.\d+\.(self_attn|mlp)\.(\w+_proj))\.weight$")
# Fused projections read one input, so GPTQ's activation order (and g_idx) is theirs to share.
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                "up_proj": "gate_up"}

# Weight arguments as llm-compressor writes them (W4A16 preset, GPTQModifier).
W4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
              "group_size": GROUP, "dynamic": False, "actorder": None, "block_structure": None,
              "observer": "minmax", "observer_kwargs": {}}
DYNAMIC_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                 "dynamic": True, "group_size": None, "block_structure": None, "actorder": None}


def w4_config(weights: dict | None = None, activations: dict | None = None,
              ignore: list[str] | None = None, fmt: str = "pack-quantized") -> dict:
    return compressed_tensors_config({**W4_WEIGHTS, **(weights or {})}, activations, ignore, fmt)


# --- the writer: quantize, pack like compressed-tensors -------------------------------------------

def pack_int32(values: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """Signed 4-bit values [R, C] -> int32, eight per word along packed_dim (value + 8, lowest
    nibble first, the last word zero-padded)."""
    u = values.to(torch.int64) + 8
    if packed_dim == 0:
        u = u.t()
    rows, cols = u.shape
    u = F.pad(u, (0, -cols % 8)).reshape(rows, -1, 8)
    word = (u << (4 * torch.arange(8))).sum(dim=-1)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.t().contiguous() if packed_dim == 0 else word


def quantize_w4(w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype,
                g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """RTN in the compressed-tensors convention: q signed in -8..7, w ~= (q - zp) * scale, groups
    of `group` columns (the columns of each g_idx value when given). Returns q, scale (in
    scale_dtype), zp (signed; zeros when symmetric) and the dequantized float32 weight."""
    n, k = w.shape
    order = torch.arange(k) if g_idx is None else torch.argsort(g_idx.long(), stable=True)
    wg = w.float()[:, order].reshape(n, k // group, group)
    if symmetric:
        scale = (wg.abs().amax(dim=2) / 7.5).clamp_min(1e-6).to(scale_dtype).float()
        zp = torch.zeros_like(scale)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-6).to(scale_dtype).float()
        zp = torch.round(-8 - lo / scale).clamp(-8, 7)
    q = torch.round(wg / scale[..., None] + zp[..., None]).clamp(-8, 7)
    deq = ((q - zp[..., None]) * scale[..., None]).reshape(n, k)
    q_cols, deq_cols = torch.empty(n, k), torch.empty(n, k)
    q_cols[:, order], deq_cols[:, order] = q.reshape(n, k), deq
    return {"q": q_cols.to(torch.int8), "scale": scale.to(scale_dtype),
            "zp": zp.to(torch.int8), "deq": deq_cols}


def ct_tensors(module: str, quant: dict, symmetric: bool,
               g_idx: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One linear module's compressed-tensors (pack-quantized) tensors."""
    n, k = quant["q"].shape
    out = {f"{module}.weight_packed": pack_int32(quant["q"]),
           f"{module}.weight_scale": quant["scale"],
           f"{module}.weight_shape": torch.tensor([n, k])}
    if not symmetric:
        out[f"{module}.weight_zero_point"] = pack_int32(quant["zp"], packed_dim=0)
    if g_idx is not None:
        out[f"{module}.weight_g_idx"] = g_idx.clone()
    return out


def random_g_idx(k: int, gen: torch.Generator) -> torch.Tensor:
    """Act-order: the i-th column quantized (random order here) lands in group i // GROUP."""
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // GROUP).to(torch.int32)
    return g_idx


def write_pair(src: Path, dst: Path, *, symmetric: bool = True, act_order: bool = False,
               channel: bool = False, scale_dtype: torch.dtype = torch.bfloat16,
               keep_float: frozenset[str] = frozenset(), qc: dict) -> tuple[Path, Path]:
    """(compressed-tensors W4A16 checkpoint, float checkpoint of its dequantized weights).

    keep_float: linear modules (HF names, matched by the last name part) left float in both.
    """
    gen = torch.Generator().manual_seed(7)
    g_idx_of: dict[str, torch.Tensor] = {}
    ct, floats = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        m = LINEAR.match(name)
        if m is None or m.group(3) in keep_float:
            ct[name] = floats[name] = t
            continue
        module, proj = m.group(1), m.group(3)
        g_idx = None
        if act_order:
            key = f"{module.rpartition('.')[0]}.{SHARED_INPUT.get(proj, proj)}"
            g_idx = g_idx_of.setdefault(key, random_g_idx(t.shape[1], gen))
        quant = quantize_w4(t, t.shape[1] if channel else GROUP, symmetric, scale_dtype, g_idx)
        ct.update(ct_tensors(module, quant, symmetric, g_idx))
        floats[name] = quant["deq"]
    return save_checkpoint(src, dst / "ct", ct, qc), save_checkpoint(src, dst / "float", floats, None)


# --- the engine side -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _float_weights(float_dir: Path) -> dict[str, torch.Tensor]:
    """slipstream layer name -> its [N, K] float weight (fused shards concatenated)."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    out = {}
    for i in range(2):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.qkv_proj"] = torch.cat(
            [tensors[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
        out[f"{p}.mlp.gate_up_proj"] = torch.cat(
            [tensors[f"{p}.mlp.{x}_proj.weight"] for x in ("gate", "up")])
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            out[f"{p}.{name}"] = tensors[f"{p}.{name}.weight"]
    return out


def _assert_layers_match(llm: LLM, float_dir: Path, float_layers: tuple[str, ...] = ()) -> None:
    """Quantized layers dequantize to the float checkpoint's weights exactly; float_layers (name
    endings) are plain float layers holding them."""
    want = _float_weights(float_dir)
    for name, layer in quantized_layers(llm).items():
        if name.endswith(float_layers):
            assert type(layer.quant_method) is UnquantizedLinearMethod, name
            assert torch.equal(layer.weight, want[name]), name
            continue
        assert isinstance(layer.quant_method, Int4LinearMethod), name
        assert layer.qweight.dtype == torch.uint8 and layer.scales.dtype == torch.float16, name
        assert not any(p.startswith("weight") for p in layer._parameters), name
        assert torch.equal(dequantize_layer(layer, torch.float32), want[name]), name


CASES = {  # name -> (write_pair options, weight arguments in the config)
    "group": ({}, {}),
    "group fp16 scales": ({"scale_dtype": torch.float16}, {}),
    "actorder weight": ({}, {"actorder": "weight"}),  # contiguous groups, no g_idx stored
    "actorder group": ({"act_order": True}, {"actorder": "group"}),
    "channel": ({"channel": True}, {"strategy": "channel", "group_size": None}),
    "asymmetric": ({"symmetric": False}, {"symmetric": False}),
    "asymmetric actorder group": ({"symmetric": False, "act_order": True},
                                  {"symmetric": False, "actorder": "group"}),
}


@pytest.mark.usefixtures("int4_reference")
@pytest.mark.parametrize("case", list(CASES))
def test_w4a16_llama_generates_like_its_dequantized_float_model(tiny, tmp_path, case) -> None:
    options, weights = CASES[case]
    ct_dir, float_dir = write_pair(tiny, tmp_path, qc=w4_config(weights), **options)
    assert detect_quant_method(json.loads((ct_dir / "config.json").read_text())) == "int4_awq"
    llm = load_llm(ct_dir)  # auto-detected
    _assert_layers_match(llm, float_dir)
    qkv = quantized_layers(llm)["model.layers.0.self_attn.qkv_proj"]
    groups = 1 if case == "channel" else 128 // GROUP
    assert qkv.scales.shape == (qkv.output_size, groups)
    assert (ACT_ORDER_PERM in dict(qkv.named_buffers())) == options.get("act_order", False)
    if options.get("symmetric", True):
        assert bool((qkv.zeros == 8).all())
    assert _greedy(llm) == _greedy(load_llm(float_dir))


def test_explicit_method_loads_and_another_one_is_the_mismatch_error(tiny, tmp_path) -> None:
    ct_dir, float_dir = write_pair(tiny, tmp_path, qc=w4_config())
    assert _greedy(load_llm(ct_dir, "int4_awq")) == _greedy(load_llm(float_dir))
    with pytest.raises(ValueError, match="already quantized with 'int4_awq'"):
        load_llm(ct_dir, "fp8")


@pytest.mark.usefixtures("int4_reference")
def test_ignored_layers_stay_float(tiny, tmp_path) -> None:
    qc = w4_config(ignore=["lm_head", "re:.*down_proj"])
    ct_dir, float_dir = write_pair(tiny, tmp_path, qc=qc, keep_float=frozenset({"down_proj"}))
    llm = load_llm(ct_dir)
    _assert_layers_match(llm, float_dir, float_layers=("down_proj",))
    original = load_file(str(tiny / "model.safetensors"))
    head = llm.engine.runner.model.lm_head
    assert torch.equal(head.weight, original["lm_head.weight"])
    assert torch.equal(quantized_layers(llm)["model.layers.1.mlp.down_proj"].weight,
                       original["model.layers.1.mlp.down_proj.weight"])
    assert _greedy(llm) == _greedy(load_llm(float_dir))


# --- one layer at a time ---------------------------------------------------------------------------

def _factory(weights: dict | None = None):
    return get_quant_method_factory("int4_awq", llama_hf_config(w4_config(weights)))


def _load(layer, shards: list[dict[str, torch.Tensor]]) -> None:
    for shard, tensors in enumerate(shards):
        for name, t in tensors.items():
            layer.weight_loader(getattr(layer, name), t, shard if len(shards) > 1 else None)
    layer.quant_method.process_after_loading(layer)


def test_hand_packed_words_unpack_lowest_nibble_first() -> None:
    """0x76543210 holds -8..-1 and 0xFEDCBA98 holds 0..7 (value + 8 per nibble, nibble 0 first)."""
    layer = ColumnParallelLinear(16, 8, bias=False, params_dtype=torch.float32,
                                 quant_method=_factory({"group_size": 16})("x"))
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - 2**32]], dtype=torch.int64).to(torch.int32)
    q = torch.arange(-8, 8)
    assert torch.equal(pack_int32(q[None]), words)  # this file's writer agrees
    scale = torch.arange(1, 9, dtype=torch.float16)[:, None] / 4
    _load(layer, [{"weight_packed": words.expand(8, 2), "weight_scale": scale,
                   "weight_shape": torch.tensor([8, 16])}])
    assert torch.equal(dequantize_layer(layer, torch.float32), scale.float() * q.float())


@pytest.mark.usefixtures("int4_reference")
def test_fused_asymmetric_zero_points_packed_and_unpacked() -> None:
    """compressed-tensors >= 0.10 packs zero points along N; older versions saved them as signed
    int8 [N, K/G]. Both land in the shard's rows of one layer."""
    gen = torch.Generator().manual_seed(3)
    layer = QKVParallelLinear(128, 16, 4, 2, bias=False, params_dtype=torch.float32,
                              quant_method=_factory({"symmetric": False})("qkv"))
    shards, deqs = [], []
    for shard, n in enumerate(layer.output_sizes):  # 64, 32, 32 rows
        quant = quantize_w4(torch.randn(n, 128, generator=gen), GROUP, False, torch.bfloat16)
        tensors = ct_tensors("m", quant, False, None)
        if shard == 1:
            tensors["m.weight_zero_point"] = quant["zp"]
        shards.append({k.removeprefix("m."): v for k, v in tensors.items()})
        deqs.append(quant["deq"])
    _load(layer, shards)
    deq = torch.cat(deqs)
    assert torch.equal(dequantize_layer(layer, torch.float32), deq)
    x = torch.randn(3, 128, generator=gen)
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="input size 100 must be a multiple of 8"):
        ColumnParallelLinear(100, 64, bias=False, params_dtype=torch.float32,
                             quant_method=_factory({"group_size": 32})("x"))
    layer = ColumnParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                                 quant_method=_factory()("x"))
    with pytest.raises(ValueError, match=r"weight_shape \[64, 256\] does not match the layer's "
                                         r"\[64, 128\]"):
        layer.weight_loader(layer.weight_shape, torch.tensor([64, 256]), None)
    layer = ColumnParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                                 quant_method=_factory({"symmetric": False})("x"))
    with pytest.raises(ValueError, match="weight_zero_point"):
        layer.weight_loader(layer.weight_zero_point, torch.zeros(4, 4, dtype=torch.int32), None)


UNSUPPORTED = {
    "int8 W8A16 pack-quantized": (w4_config({"num_bits": 8}), r"int8 group\(32\).*not int4"),
    "W4A8 dynamic activations": (w4_config(activations=DYNAMIC_TOKEN), "activations are quantized"),
    "dynamic weights": (w4_config({"dynamic": True}), "dynamic=True"),
    "per tensor": (w4_config({"strategy": "tensor", "group_size": None}), "strategy 'tensor'"),
    "block": (w4_config({"strategy": "block", "block_structure": [128, 128], "group_size": None}),
              r"block\[128, 128\]"),
    "unknown actorder": (w4_config({"actorder": "sideways"}), "actorder 'sideways'"),
    "marlin-24 format": (w4_config(fmt="marlin-24"), "format 'marlin-24'"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_int_schemes_are_clear_errors(case) -> None:
    qc, what = UNSUPPORTED[case]
    with pytest.raises(ValueError, match=what) as err:
        detect_quant_method(llama_hf_config(qc))
    assert "supported: " in str(err.value) and "W4A16" in str(err.value)


def test_actorder_spellings() -> None:
    """Booleans (older configs) and the newer aliases name the same two orders."""
    for value, method_act_order in ((True, True), ("dynamic", True), ("static", False),
                                    (False, False)):
        method = _factory({"actorder": value})("x")
        assert method.layout == "compressed" and method.act_order == method_act_order, value
