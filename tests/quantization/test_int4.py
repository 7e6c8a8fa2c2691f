"""int4_awq: groupwise INT4 apply, the AWQ scale search, AutoAWQ / GPTQ checkpoint layouts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import QKVParallelLinear
from slipstream.quantization import utils as qu
from slipstream.quantization.base import get_quant_method_factory
from slipstream.quantization.int4_awq import awq_search, dequantize_layer
from tests.helpers import make_tiny_checkpoint

GROUP = 64
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


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
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("int4"), "LlamaForCausalLM",
                                hidden_size=128, intermediate_size=256)


def _write_layout(src: Path, dst: Path, layout: str) -> Path:
    """Re-save src with every projection RTN-quantized (group 64) in the AWQ or GPTQ layout."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = t
            continue
        q, scales, zeros = qu.quantize_int4_groupwise(t, GROUP)
        base = name.removesuffix(".weight")
        if layout == "awq":
            tensors[f"{base}.qweight"] = qu.pack_int32_cols(q.t().contiguous(), qu.AWQ_ORDER)
            tensors[f"{base}.qzeros"] = qu.pack_int32_cols(zeros.t().contiguous(), qu.AWQ_ORDER)
        else:  # GPTQ v1: packed along K, zeros stored minus one (mod 16), trivial g_idx
            tensors[f"{base}.qweight"] = qu.pack_int32_cols(q).t().contiguous()
            z = ((zeros.to(torch.int16) - 1) & 0xF).to(torch.uint8)
            tensors[f"{base}.qzeros"] = qu.pack_int32_cols(z.t().contiguous())
            k = t.shape[1]
            tensors[f"{base}.g_idx"] = (torch.arange(k) // GROUP).to(torch.int32)
        tensors[f"{base}.scales"] = scales.t().contiguous().half()
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"} if layout == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


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
    # The same integers dequantized in the model: compare with weights RTN-quantized in memory.
    from slipstream.quantization import int4_awq

    monkeypatch.setattr(int4_awq, "DEFAULT_GROUP", GROUP)
    assert got == _greedy(tiny, "int4_awq", prompts)
