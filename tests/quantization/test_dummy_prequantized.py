"""load_format="dummy" with a pre-quantized checkpoint's config (benchmarking a layout without
its weights): the integer tensors that describe the layout (g_idx, weight_shape, zero points) get
valid values, not random integers, so the model builds and generates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from slipstream import LLM, SamplingParams
from slipstream.quantization.int4_awq import ACT_ORDER_PERM
from tests.quantization.checkpoint_io import quantized_layers, save_checkpoint
from tests.quantization.test_compressed_tensors_int8 import ct_config as int8_config
from tests.quantization.test_compressed_tensors_w4 import w4_config
from tests.quantization.test_gptq_act_order import GPTQ_CONFIG

CONFIGS = {
    "gptq act-order": (GPTQ_CONFIG, True),
    "gptq": ({**GPTQ_CONFIG, "desc_act": False}, False),
    "w4a16 asymmetric actorder group": (w4_config({"symmetric": False, "actorder": "group"}), True),
    "w8a16 pack-quantized": (int8_config(activations=None, fmt="pack-quantized"), False),
}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dummy_weights_with_a_prequantized_config_generate(tiny, tmp_path, name) -> None:
    quant_config, permuted = CONFIGS[name]
    floats = load_file(str(tiny / "model.safetensors"))
    path = save_checkpoint(tiny, tmp_path / "ckpt", floats, quant_config)
    (path / "model.safetensors").unlink()  # dummy weights need only the config
    assert "quantization_config" in json.loads((path / "config.json").read_text())
    llm = LLM(str(path), load_format="dummy", kv_cache_memory=16 << 20)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    proj = [m for n, m in quantized_layers(llm).items() if n.endswith("down_proj")][0]
    # Act-order layouts get a real (non-identity) column order, so the gather runs as it would.
    assert (ACT_ORDER_PERM in proj._buffers) == permuted
