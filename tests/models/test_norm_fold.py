"""RMSNorm weights folded into the projections they feed (SLIPSTREAM_FOLD_NORMS): the network
computes the same function; a batch-1 decode then runs its layers without norm kernels
(LlamaDecoderLayer._forward_folded_row); methods that quantize at load quantize the folded
weight; calibrated and pre-quantized methods keep their norms."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM
from slipstream.engine.args import EngineArgs
from slipstream.models import llama, norm_fold
from slipstream.models.loader import load_model
from tests.engine.test_hf_parity import greedy, hf_greedy, random_prompts
from tests.helpers import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # The factory randomises the norm weights: a fold that drops them changes the logits.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fold"), "Qwen2ForCausalLM",
                                num_hidden_layers=2, hidden_size=128, intermediate_size=256)


def _load(path, fold: bool, monkeypatch, **kw):
    monkeypatch.setattr(norm_fold, "FOLD_NORMS", fold)
    kw.setdefault("dtype", "float32")
    return load_model(EngineArgs(model=str(path), device="cpu", **kw).create_engine_config())


def _norms(model) -> list:
    return [m for name, m in model.named_modules() if name.endswith("layernorm")]


def test_fold_moves_each_norm_weight_into_its_projection(checkpoint, monkeypatch):
    plain = _load(checkpoint, False, monkeypatch)
    folded = _load(checkpoint, True, monkeypatch)
    assert not any(n.folded for n in _norms(plain))
    assert all(n.folded and torch.equal(n.weight, torch.ones_like(n.weight))
               for n in _norms(folded))
    for i in range(2):
        p, f = plain.model.layers[i], folded.model.layers[i]
        gamma = p.input_layernorm.weight
        assert not torch.equal(gamma, torch.ones_like(gamma))
        assert torch.allclose(f.self_attn.qkv_proj.weight, p.self_attn.qkv_proj.weight * gamma)
        gamma = p.post_attention_layernorm.weight
        assert torch.allclose(f.mlp.gate_up_proj.weight, p.mlp.gate_up_proj.weight * gamma)
        assert torch.equal(f.self_attn.o_proj.weight, p.self_attn.o_proj.weight)  # not fed by a norm
    assert not folded.model.norm.folded  # the final norm feeds the LM head: kept


def test_batch1_decode_with_folded_norms_matches_transformers(checkpoint, monkeypatch):
    """Greedy tokens equal HF's, one prompt at a time (each decode step is one row: the folded
    path, with the reference ops' fallbacks on the CPU); the path is checked to have run."""
    monkeypatch.setattr(norm_fold, "FOLD_NORMS", True)
    calls = []
    folded_row = llama.LlamaDecoderLayer._forward_folded_row

    def spy(self, *args):
        calls.append(1)
        return folded_row(self, *args)

    monkeypatch.setattr(llama.LlamaDecoderLayer, "_forward_folded_row", spy)
    prompts = random_prompts(2, 500, seed=3, lengths=(5, 33))
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", max_num_seqs=1)
    outs = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(checkpoint, prompts, 10)
    assert len(calls) >= 2 * 2 * 9  # layers x prompts x decode steps


@pytest.mark.parametrize("method", ["int8_wo", "fp8"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_load_time_quantization_quantizes_the_folded_weight(checkpoint, monkeypatch, method,
                                                            load_format):
    """The projection waits for its norm (which may arrive after it), folds, then quantizes:
    the dequantized weight is W * gamma, within the format's rounding."""
    plain = _load(checkpoint, False, monkeypatch, load_format=load_format)
    quant = _load(checkpoint, True, monkeypatch, load_format=load_format, quantization=method)
    for i in range(2):
        p, q = plain.model.layers[i], quant.model.layers[i]
        assert q.input_layernorm.folded and q.post_attention_layernorm.folded
        for proj, norm in [("self_attn.qkv_proj", "input_layernorm"),
                           ("mlp.gate_up_proj", "post_attention_layernorm")]:
            want = p.get_submodule(proj).weight * p.get_submodule(norm).weight
            got_mod = q.get_submodule(proj)
            got = got_mod.weight.float() * got_mod.weight_scale.float()[:, None]
            assert ((got - want).norm() / want.norm()).item() < 0.05, (method, proj)


@pytest.mark.parametrize("method", ["int4_awq", "w8a8_sq"])
def test_calibrated_methods_keep_their_norms(checkpoint, monkeypatch, method):
    model = _load(checkpoint, True, monkeypatch, quantization=method, load_format="dummy")
    assert not any(n.folded for n in _norms(model))
