"""int4_awq: groupwise INT4 apply, the AWQ scale and clipping search, exact scale folding (GQA
o_proj, bf16 norms), calibration texts, AutoAWQ / GPTQ checkpoint layouts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import QKVParallelLinear
from slipstream.quantization import awq
from slipstream.quantization import utils as qu
from slipstream.quantization.base import get_quant_method_factory
from slipstream.quantization.calibration import stdlib_calib_texts
from slipstream.quantization.int4_awq import awq_search, dequantize_layer
from tests.helpers import rel_err
from tests.quantization.checkpoint_io import write_int4_layout

GROUP = 64
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.usefixtures("int4_reference")
def test_int4_fused_layer_apply_matches_dequantized() -> None:
    hf = {"quantization_config": {}}  # not pre-quantized: RTN after loading
    layer = QKVParallelLinear(128, 16, 4, 2, bias=False, params_dtype=torch.float32,
                              quant_method=get_quant_method_factory("int4_awq", hf)("qkv"))
    w = torch.randn(layer.output_size, 128)
    offset = 0
    for shard, size in enumerate(layer.output_sizes):
        layer.weight_loader(layer.weight, w[offset:offset + size], shard)
        offset += size
    layer.quant_method.process_after_loading(layer)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (128, 64)
    x = torch.randn(3, 128)
    deq = dequantize_layer(layer, torch.float32)
    torch.testing.assert_close(layer(x), F.linear(x, deq))
    # Group 128 RTN: within half a step of the float weight, element by element.
    step = layer.scales.float().repeat_interleave(128, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-3).all()


def test_awq_search_beats_round_to_nearest_with_outlier_channels() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(256, 256, generator=g)
    x[:, :8] *= 30.0  # a few salient input channels, as in real activations
    s = awq_search(w, x, x.abs().mean(0), GROUP)
    want = x @ w.t()

    def err(scale: torch.Tensor) -> float:
        wq = qu.dequantize_int4_groupwise(*qu.quantize_int4_groupwise(w * scale, GROUP)) / scale
        return (x @ wq.t() - want).pow(2).mean().item()

    rtn, awq = err(torch.ones(256)), err(s)
    assert awq < 0.8 * rtn, (awq, rtn)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)


def _write_layout(src: Path, dst: Path, layout: str, group: int = GROUP) -> Path:
    """Re-save src with every projection RTN-quantized (group 64; -1: one group per row, GPTQ's
    "no groups") in the AWQ or GPTQ layout."""
    return write_int4_layout(src, dst, layout, group, lambda name: name.endswith("_proj.weight"))


def _greedy(path: Path, quantization: str | None, prompts) -> list[list[int]]:
    llm = LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_prequantized_layouts_load_like_load_time_rtn(tiny, tmp_path, layout,
                                                     monkeypatch) -> None:
    prompts = [[5, 17, 99, 300], [7, 8, 9, 10, 11]]
    path = _write_layout(tiny, tmp_path / layout, layout)
    got = _greedy(path, qu.detect_quant_method(json.loads((path / "config.json").read_text())),
                  prompts)
    # The same integers dequantized in the model: compare with weights RTN-quantized in memory
    # (unfolded, as the files were written).
    from slipstream.models import norm_fold
    from slipstream.quantization import int4_awq

    monkeypatch.setattr(int4_awq, "DEFAULT_GROUP", GROUP)
    with norm_fold.kept_norms():
        assert got == _greedy(tiny, "int4_awq", prompts)


def test_gptq_without_groups_loads_per_channel(tiny, tmp_path, monkeypatch) -> None:
    """group_size -1 (with desc_act, as such checkpoints often are): one scale and zero per
    output row; the same tokens as per-channel RTN of the float model at load time."""
    from slipstream.models import norm_fold
    from slipstream.quantization import int4_awq

    prompts = [[5, 17, 99, 300], [7, 8, 9, 10, 11]]
    path = _write_layout(tiny, tmp_path / "gptq_per_channel", "gptq", group=-1)
    llm = LLM(str(path), kv_cache_memory=16 << 20)
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.int4_group_size == 256 and down.scales.shape[1] == 1
    assert not down.quant_method.act_order  # one group: nothing to reorder
    got = _greedy(path, None, prompts)
    monkeypatch.setattr(int4_awq, "DEFAULT_GROUP", -1)
    with norm_fold.kept_norms():  # the files hold the unfolded weights
        assert got == _greedy(tiny, "int4_awq", prompts)


# --- AWQ on a decoder layer: block output error, clipping, exact folding ----------------------------

_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tiny_gqa(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM",
                           hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32)


def _layer0(path: Path):
    model = LLM(str(path), kv_cache_memory=16 << 20).engine.runner.model
    return model.model.layers[0], model.model.rotary_emb.cos_sin_cache.float()


def _quantized_output(layer, h, cos_sin) -> torch.Tensor:
    """The layer's output with every projection INT4 round-to-nearest (weights restored after)."""
    saved = {}
    for name in _LINEARS:
        linear = layer.get_submodule(name)
        saved[name] = linear.weight.data.clone()
        linear.weight.data.copy_(awq.fake_quant(linear.weight.data, GROUP))
    out = awq.layer_inputs(layer, h, cos_sin)[1]
    for name, w in saved.items():
        layer.get_submodule(name).weight.data.copy_(w)
    return out


@torch.no_grad()
def test_awq_reduces_block_output_error_vs_rtn_with_activation_outliers(tiny_gqa) -> None:
    layer, cos_sin = _layer0(tiny_gqa)
    g = torch.Generator().manual_seed(0)
    # Synthetic outliers: a few channels of each norm's output (qkv / gate_up inputs) 25x larger.
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data[:4] *= 25.0
    h = torch.randn(4, 64, 128, generator=g)
    want = awq.layer_inputs(layer, h, cos_sin)[1]
    rtn = (_quantized_output(layer, h, cos_sin) - want).pow(2).mean().item()

    inp, _ = awq.layer_inputs(layer, h, cos_sin)
    grams = {"self_attn.qkv_proj": awq.gram(inp.attn_in), "self_attn.o_proj": awq.gram(inp.ctx),
             "mlp.gate_up_proj": awq.gram(inp.mlp_in), "mlp.down_proj": awq.gram(inp.act)}
    scales = awq.search_layer_scales(layer, inp, grams, cos_sin, GROUP)
    assert any(not torch.equal(s, torch.ones_like(s)) for s in scales.values())
    applied = awq.fold_layer(layer, "p", scales, None)
    # Folding alone keeps the float function (GQA o_proj included: v rows absorb its scale).
    assert rel_err(awq.layer_inputs(layer, h, cos_sin)[1], want) < 1e-5
    scaled = (_quantized_output(layer, h, cos_sin) - want).pow(2).mean().item()
    awq.clip_layer(layer, grams, applied, GROUP)
    clipped = (_quantized_output(layer, h, cos_sin) - want).pow(2).mean().item()
    # Measured (seed 0): scaled 0.53x round-to-nearest's error, scaled + clipped 0.91x scaled.
    assert scaled < 0.6 * rtn and clipped < 0.97 * scaled, (rtn, scaled, clipped)


def test_clip_search_shrinks_outlier_groups_and_never_hurts_a_row() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 128, generator=g)
    w[:16, 5] = 12.0  # one huge weight per row in group 0 of the first 16 rows ...
    x = torch.randn(1024, 128, generator=g)
    x[:, 5] *= 0.02  # ... meeting an almost silent input channel: worth clipping
    sigma = awq.gram(x)
    lo, hi = awq.search_clip(w, sigma, GROUP)
    wg = w.reshape(32, 2, GROUP)
    assert (hi <= wg.amax(2, keepdim=True).clamp(min=0)).all()
    assert (lo >= wg.amin(2, keepdim=True).clamp(max=0)).all()
    assert (hi[:16, 0] < 0.8 * 12.0).all()  # the outlier groups were clipped

    def row_err(wq: torch.Tensor) -> torch.Tensor:  # [N] output error of each row
        d = wq - w
        return ((d @ sigma) * d).sum(dim=1)

    clipped = torch.maximum(torch.minimum(wg, hi), lo).reshape(32, 128)
    before, after = row_err(awq.fake_quant(w, GROUP)), row_err(awq.fake_quant(clipped, GROUP))
    assert (after <= before * (1 + 1e-5)).all()  # no row ends up worse than without clipping
    out_err = lambda wq: (x @ (wq - w).t()).pow(2).mean().item()  # noqa: E731
    # Measured (seed 1): 0.48x the output error of plain round-to-nearest.
    assert out_err(awq.fake_quant(clipped, GROUP)) < 0.7 * out_err(awq.fake_quant(w, GROUP))


@torch.no_grad()
def test_fold_with_gqa_o_proj_and_bf16_norms_is_exact(tiny_gqa) -> None:
    layer, cos_sin = _layer0(tiny_gqa)
    h = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(2))
    want = awq.layer_inputs(layer, h, cos_sin)[1]
    g = torch.Generator().manual_seed(3)
    tie = awq.HeadTie(4, 2)
    scales = {name: (0.5 * torch.randn(layer.get_submodule(name).input_size, generator=g)).exp()
              for name in _LINEARS}
    untied = scales["self_attn.o_proj"]
    with pytest.raises(ValueError, match="GQA"):
        qu.kv_tied_scale(untied, 4, 2)
    scales["self_attn.o_proj"] = tie.expand(tie.reduce(untied))
    applied = awq.fold_layer(layer, "p", scales, torch.bfloat16)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        assert torch.equal(norm.weight.data, norm.weight.data.bfloat16().float())
    assert not torch.equal(applied["self_attn.qkv_proj"], scales["self_attn.qkv_proj"])
    assert rel_err(awq.layer_inputs(layer, h, cos_sin)[1], want) < 1e-5


def test_stdlib_calibration_skips_excluded_files_and_takes_the_middle(tmp_path) -> None:
    body = "".join(f"line_{i} = {i}\n" for i in range(400))
    (tmp_path / "keep.py").write_text(body)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "heldout.py").write_text(body)
    texts = stdlib_calib_texts(4, 300, root=tmp_path, exclude=("pkg/heldout.py",))
    assert len(texts) == 1 and len(texts[0]) == 300
    assert texts[0].startswith("line_") and not texts[0].startswith("line_0 ")
    assert len(stdlib_calib_texts(4, 300, root=tmp_path, exclude=())) == 2
