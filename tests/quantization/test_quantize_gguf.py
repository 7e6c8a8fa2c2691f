"""`slipstream quantize` with a GGUF model as its input: the file written out as a float HF
checkpoint (tensors exact for F32, the tokenizer and chat template kept), then quantized as any
checkpoint; the result runs as the GGUF quantized at load does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slipstream import LLM, SamplingParams
from slipstream.models import norm_fold
from slipstream.models.gguf_convert import write_hf_checkpoint
from slipstream.tokenizer.tokenizer import load_tokenizer
from tests.models.tiny_gguf import write_tiny_gguf
from tests.quantization.checkpoint_io import run_quantize_cli
from tests.tokenizer.tiny_tokenizer import CHAT_TEMPLATE

pytest.importorskip("gguf")

PROMPTS = [[5, 17, 300, 42], list(range(3, 30))]
KW = dict(dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def _greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_an_f32_gguf_becomes_its_source_checkpoint(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path, "F32", eot=True)
    out = write_hf_checkpoint(gguf_path, tmp_path / "hf-again", max_shard_bytes=200_000)
    source = load_file(str(tmp_path / "hf" / "tiny-LlamaForCausalLM" / "model.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    written = {}
    for f in sorted(set(index.values())):
        written.update(load_file(str(out / f)))
    assert set(written) == set(source) and len(set(index.values())) > 1
    assert all(torch.equal(written[n], source[n]) for n in source)  # q/k rows unpermuted
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "gguf" not in config
    tok = load_tokenizer(out)
    assert tok.hf.chat_template == CHAT_TEMPLATE and len(tok.eos_token_ids) >= 2


def test_quantize_cli_takes_a_gguf_file(tmp_path):
    gguf_path = write_tiny_gguf(tmp_path, "Q8_0")
    out = tmp_path / "int8"
    argv = ["quantize", "--model", str(gguf_path), "--method", "int8_wo", "--output", str(out)]
    assert run_quantize_cli(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "int8_wo"
    assert [p.name for p in tmp_path.iterdir() if "gguf-" in p.name] == []  # no leftovers
    reloaded = LLM(str(out), quantization="int8_wo", **KW)
    assert reloaded.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    assert reloaded.tokenizer.hf.chat_template == CHAT_TEMPLATE
    with norm_fold.kept_norms():  # the CLI quantizes the weights as stored, norms not folded
        at_load = LLM(str(gguf_path), quantization="int8_wo", **KW)
    assert _greedy(reloaded) == _greedy(at_load)


def test_quantize_takes_a_directory_holding_a_gguf_file(tmp_path):
    from slipstream.quantization.checkpoint import quantize_checkpoint

    write_tiny_gguf(tmp_path / "model", "Q4_0")
    with pytest.raises(ValueError, match="unknown method"):
        quantize_checkpoint(tmp_path / "model", "int3", tmp_path / "out")
    out = quantize_checkpoint(tmp_path / "model", "int8_wo", tmp_path / "out")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
