"""RMSNorm weights folded into the projections they feed (models/norm_fold.py): the network
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
from slipstream.models.quantize_as_loaded import before_each_layer
from slipstream.quantization import int4_awq
from slipstream.quantization.base import UnquantizedLinearMethod
from tests.engine.test_hf_parity import greedy, hf_greedy, random_prompts
from tests.helpers import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # The factory randomises the norm weights: a fold that drops them changes the logits.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fold"), "Qwen2ForCausalLM",
                                num_hidden_layers=2, hidden_size=128, intermediate_size=256)


def _load(path, fold: bool | str, monkeypatch, **kw):
    """fold True: unquantized layers fold too; False: nothing folds; "auto": the default."""
    monkeypatch.setattr(UnquantizedLinearMethod, "folds_norm", fold is True)
    kw.setdefault("dtype", "float32")
    config = EngineArgs(model=str(path), device="cpu", **kw).create_engine_config()
    if fold is False:
        with norm_fold.kept_norms():
            return load_model(config)
    return load_model(config)


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


def test_auto_folds_only_weights_that_are_rounded_at_load(checkpoint, monkeypatch):
    """The default: an unquantized model keeps its checkpoint weights bit for bit;
    a method that quantizes at load gets the fold."""
    plain = _load(checkpoint, False, monkeypatch)
    auto = _load(checkpoint, "auto", monkeypatch)
    assert not any(n.folded for n in _norms(auto))
    for (name, a), (_, p) in zip(auto.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, p), name
    quant = _load(checkpoint, "auto", monkeypatch, quantization="fp8", load_format="dummy")
    assert all(n.folded for n in _norms(quant))


def test_batch1_decode_with_folded_norms_matches_transformers(checkpoint, monkeypatch):
    """Greedy tokens equal HF's, one prompt at a time (each decode step is one row: the folded
    path, with the reference ops' fallbacks on the CPU); the path is checked to have run."""
    monkeypatch.setattr(UnquantizedLinearMethod, "folds_norm", True)
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


def _dequantized(layer, method: str) -> torch.Tensor:
    if method == "int4_awq":
        return int4_awq.dequantize_layer(layer, torch.float32)
    return layer.weight.float() * layer.weight_scale.float()[:, None]


@pytest.mark.parametrize("method,tol", [("int8_wo", 0.05), ("fp8", 0.05), ("int4_awq", 0.15)])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_load_time_quantization_quantizes_the_folded_weight(checkpoint, monkeypatch, method, tol,
                                                            load_format):
    """The projection waits for its norm (which may arrive after it), folds, then quantizes
    (int4_awq from a float checkpoint: round-to-nearest at load): the dequantized weight is
    W * gamma, within the format's rounding."""
    plain = _load(checkpoint, False, monkeypatch, load_format=load_format)
    quant = _load(checkpoint, True, monkeypatch, load_format=load_format, quantization=method)
    vetoes = 0
    for i in range(2):
        p, q = plain.model.layers[i], quant.model.layers[i]
        for proj, norm in [("self_attn.qkv_proj", "input_layernorm"),
                           ("mlp.gate_up_proj", "post_attention_layernorm")]:
            weight, gamma = p.get_submodule(proj).weight, p.get_submodule(norm).weight
            # int4 keeps a norm whose fold would round the weight worse (these random norms
            # spread by 0.2: some do); the other formats always fold.
            veto = method == "int4_awq" and int4_awq.Int4LinearMethod().fold_costs_accuracy(
                weight, gamma)
            vetoes += veto
            assert q.get_submodule(norm).folded == (not veto), (method, proj)
            want = weight if veto else weight * gamma
            got = _dequantized(q.get_submodule(proj), method)
            assert ((got - want).norm() / want.norm()).item() < tol, (method, proj)
    assert vetoes == 0 or (method, load_format) == ("int4_awq", "auto")  # dummy norms are ~1


def test_calibrations_that_rescale_the_norms_keep_them(checkpoint, monkeypatch):
    """SmoothQuant's migration scales and AWQ's search (a layer hook: `slipstream quantize`)
    live in the norms: nothing is folded under them."""
    model = _load(checkpoint, True, monkeypatch, quantization="w8a8_sq", load_format="dummy")
    assert not any(n.folded for n in _norms(model))
    seen = []
    with before_each_layer(lambda model, i, layer: seen.append(i)):
        model = _load(checkpoint, True, monkeypatch, quantization="int4_awq")
    assert seen == [0, 1] and not any(n.folded for n in _norms(model))


_IN_GEMV_NORM = {  # method -> (kernel module, its one-row RMS entry point, its gate-out one)
    "int4_awq": ("gemv.int4", "w4_linear_small_rms", "w4_linear_small_gate_out"),
    "int8_wo": ("gemv.int8", "qlinear_small_rms", "qlinear_small_gate_out"),
    "fp8": ("gemv.int8", "qlinear_small_rms", "qlinear_small_gate_out"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(_IN_GEMV_NORM))
def test_gpu_quantized_folded_rows_normalise_in_the_gemv(checkpoint, monkeypatch, method):
    """Load-time quantization with folded norms (the default; int4_awq: round-to-
    nearest), batch 1, float32 on the GPU: the GEMVs that normalise their own input (QKV, and
    gate/up writing SiLU(gate)·up) give the tokens the same folded model gives through the norm
    kernels (the entry points refusing rms_eps)."""
    import importlib

    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    # Every norm folded: int4's accuracy veto (fold_costs_accuracy) off, the kernels are the point.
    monkeypatch.setattr(int4_awq, "FOLD_TOLERANCE", float("inf"))
    module_name, rms_name, gate_out_name = _IN_GEMV_NORM[method]
    kernels = importlib.import_module(f"slipstream.kernels.{module_name}")
    rms, gate_out = getattr(kernels, rms_name), getattr(kernels, gate_out_name)
    normalised = []

    def spy_rms(*args):
        y = rms(*args)
        normalised.append(y is not None)
        return y

    prompts = random_prompts(2, 500, seed=5, lengths=(5, 20))
    runs = []
    for in_gemv in (True, False):
        if in_gemv:
            monkeypatch.setattr(kernels, rms_name, spy_rms)
        else:
            monkeypatch.setattr(kernels, rms_name, lambda *a: None)
            monkeypatch.setattr(kernels, gate_out_name,
                                lambda *a: None if a[-1] else gate_out(*a))
        llm = LLM(str(checkpoint), dtype="float32", device="cuda", quantization=method,
                  max_num_seqs=1, max_model_len=256, kv_cache_memory=64 << 20)
        assert all(n.folded for n in _norms(llm.engine.runner.model))
        runs.append([o.outputs[0].token_ids
                     for o in llm.generate(prompts, greedy(12), use_tqdm=False)])
        del llm
    assert any(normalised) and runs[0] == runs[1]
