"""w8a8_sq: SmoothQuant folding is an identity of the float model, INT8 x INT8 matmul is exact,
the quantized tiny model stays close to float (teacher-forced top-1, see test_end_to_end), and
`slipstream quantize --method w8a8_sq` writes a checkpoint that reloads deterministically."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import ColumnParallelLinear
from slipstream.quantization import utils
from slipstream.quantization import w8a8_sq as sq
from slipstream.quantization.base import get_quant_method_factory
from slipstream.quantization.calibration import collect_linear_stats, stdlib_calib_texts
from slipstream.quantization.utils import detect_quant_method
from tests.helpers import make_tiny_checkpoint, rel_err
from tests.quantization.checkpoint_io import run_quantize_cli
from tests.quantization.test_end_to_end import _greedy, _score

PROMPT_LP = SamplingParams(max_tokens=1, prompt_logprobs=0)


def _llm(path: Path, quantization: str | None = None) -> LLM:
    return LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20,
               enable_prefix_caching=False)


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PROMPT_LP, use_tqdm=False)
    return torch.tensor([e[t] for p, o in zip(prompts, outs)
                         for t, e in zip(p[1:], o.prompt_logprobs[1:])], dtype=torch.float64)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (8,), generator=g).tolist() for _ in range(4)]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)


# --- the migration is exact before quantization ---------------------------------------------------

# GQA Llama (o_proj not smoothed) and Qwen2 without GQA (v rows with bias fold into o_proj).
@pytest.mark.parametrize("arch,kv_heads", [("LlamaForCausalLM", 2), ("Qwen2ForCausalLM", 4)])
def test_smoothing_is_identity_in_float(tmp_path, prompts, arch, kv_heads) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, hidden_size=128, intermediate_size=256,
                                num_key_value_heads=kv_heads)
    llm = _llm(path)
    before = _prompt_logprobs(llm, prompts)
    stats = collect_linear_stats(llm, ["a", "b", "c"], max_len=32)
    model = llm.engine.runner.model
    layer0 = model.model.layers[0]
    norm_before = layer0.input_layernorm.weight.detach().clone()
    o_before = layer0.self_attn.o_proj.weight.detach().clone()
    sq.prepare_for_quantization(model, stats, alpha=0.5)
    # The scales really moved weights (else the identity below would be vacuous).
    assert (layer0.input_layernorm.weight / norm_before - 1).abs().max() > 0.1
    assert torch.equal(layer0.self_attn.o_proj.weight, o_before) == (kv_heads != 4)
    after = _prompt_logprobs(llm, prompts)
    assert (after - before).abs().max().item() < 1e-4


def test_smooth_scales_formula_and_dead_channels() -> None:
    w = torch.tensor([[1.0, -4.0, 0.0, 2.0], [0.5, 1.0, 0.0, -8.0]])
    x_max = torch.tensor([4.0, 1.0, 3.0, 0.0])
    s = sq.smooth_scales(x_max, w, alpha=0.5)
    # s_j = sqrt(x_j) / sqrt(w_j); a channel with no weight or no activation keeps 1.
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))
    assert torch.allclose(sq.smooth_scales(x_max, w, alpha=1.0)[:2], x_max[:2])
    with pytest.raises(ValueError, match="alpha"):
        sq.prepare_for_quantization(None, {}, alpha=1.5)


# --- reference apply --------------------------------------------------------------------------------

def test_int8_matmul_reference_is_exact_across_chunks() -> None:
    g = torch.Generator().manual_seed(0)
    k = 3000  # three K-chunks; the worst case sum is far beyond float32's exact range
    xq = torch.full((5, k), 127, dtype=torch.int8)
    xq[1:] = torch.randint(-127, 128, (4, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (24, k), generator=g, dtype=torch.int8)
    wq[0] = 127
    got = sq.int8_matmul_reference(xq, wq)
    want = xq.long() @ wq.long().t()
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert got[0, 0].item() == 127 * 127 * k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_matches_dequantized_float_math(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 96, generator=g)
    x[..., 5] *= 30.0  # an outlier channel, as SmoothQuant expects
    x[1, 2] = 0.0  # an all-zero token
    w = torch.randn(40, 96, generator=g)
    bias = torch.randn(40, generator=g)
    layer = ColumnParallelLinear(96, 40, True, dtype, get_quant_method_factory("w8a8_sq")("p"))
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(bias)
    layer.quant_method.process_after_loading(layer)
    assert layer.weight.dtype == torch.int8
    y = layer(x.to(dtype))
    xq, xs = utils.quantize_per_token(x.to(dtype).reshape(-1, 96), torch.int8)
    want = F.linear(xq.float() * xs, utils.dequantize_per_channel(layer.weight, layer.weight_scale))
    want = (want.to(dtype) + bias.to(dtype)).reshape(3, 7, 40)
    assert y.shape == want.shape and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.float(), want.float(), atol=tol, rtol=tol)
    # ... and W8A8 is a close approximation of the float layer.
    exact = F.linear(x, w, bias)
    assert rel_err(y.float(), exact) < 0.05


# --- through LLM ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny, prompts):
    llm = _llm(tiny)
    base = _greedy(llm, prompts)
    return base, _score(llm, prompts, base)[1]


def _closeness(llm: LLM, prompts, reference) -> tuple[float, float]:
    base, base_lps = reference
    tops, lps = _score(llm, prompts, base)
    flat = [t for c in base for t in c]
    agree = sum(a == b for a, b in zip(tops, flat)) / len(flat)
    return agree, sum(abs(a - b) for a, b in zip(lps, base_lps)) / len(lps)


def test_load_time_w8a8_close_to_unquantized(tiny, prompts, reference, caplog) -> None:
    with caplog.at_level("WARNING", logger="slipstream.quantization.w8a8_sq"):
        llm = _llm(tiny, "w8a8_sq")
    assert "no SmoothQuant" in caplog.text
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    agree, dlogp = _closeness(llm, prompts, reference)
    # Measured (seed 0): 0.94 / 0.064 (int8_wo: 0.94 / 0.042).
    assert agree >= 0.85 and dlogp <= 0.15, (agree, dlogp)


def test_quantize_cli_smoothquant_round_trip(tiny, prompts, reference, tmp_path) -> None:
    out = tmp_path / "sq"
    assert run_quantize_cli(["quantize", "--model", str(tiny), "--method", "w8a8_sq", "--output",
                     str(out), "--alpha", "0.6", "--num-calib-samples", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "w8a8_sq"
    assert config["quantization_config"]["smoothquant_alpha"] == 0.6
    assert detect_quant_method(config) == "w8a8_sq"
    first = _llm(out)  # the config alone selects the method
    model = first.engine.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, sq.W8A8SmoothQuantMethod)
    agree, dlogp = _closeness(first, prompts, reference)
    # Measured (seed 0, 4 random-id calibration prompts): 0.92 / 0.083.
    assert agree >= 0.85 and dlogp <= 0.15, (agree, dlogp)
    # Smoothing was folded into the saved norms: they differ from the source checkpoint's.
    src = load_file(str(tiny / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, src)
    assert _greedy(first, prompts) == _greedy(_llm(out, "w8a8_sq"), prompts)


def test_default_calibration_texts_are_stdlib_excerpts() -> None:
    texts = stdlib_calib_texts(8, 500)
    assert len(texts) == 8 and all(len(t) <= 500 for t in texts)
    assert len(set(texts)) == 8
    assert texts == stdlib_calib_texts(8, 500)  # deterministic


# --- GPU: torch._int_mm against the reference --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1, 256, 512), (16, 4096, 1024), (17, 4096, 4096),
                                   (128, 14336, 4096), (33, 100, 64), (40, 64, 36)])
def test_int_mm_path_matches_reference(m, k, n) -> None:
    g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    xq = torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
    assert torch.equal(sq.int8_matmul(xq, wq), sq.int8_matmul_reference(xq, wq))
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(n, generator=g, device="cuda") * 0.01 + 1e-3
    got = sq.w8a8_linear(x, wq, scale, None)
    xr, xs = utils.quantize_per_token(x, torch.int8)
    want = (sq.int8_matmul_reference(xr, wq).double() * xs.double() * scale.double()).bfloat16()
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_streamed_smoothquant_matches_the_whole_model_path(tiny, tmp_path) -> None:
    """`slipstream quantize --method w8a8_sq` takes each layer's activation maxima from the
    calibration prompts' float residual stream while loading (the float model never has to
    fit): the same statistics as running the loaded float model, up to float rounding, so the
    smoothed norms agree to 1e-5 and at most a rare INT8 weight sits one step apart."""
    from slipstream.quantization import checkpoint

    kw = dict(num_calib_samples=4, options={"alpha": 0.6})
    whole = load_file(str(checkpoint.quantize_checkpoint(
        tiny, "w8a8_sq", tmp_path / "whole", stream_layers=False, **kw) / "model.safetensors"))
    streamed = load_file(str(checkpoint.quantize_checkpoint(
        tiny, "w8a8_sq", tmp_path / "streamed", **kw) / "model.safetensors"))
    assert whole.keys() == streamed.keys()
    smoothed = 0
    for name, want in whole.items():
        got = streamed[name]
        if want.dtype == torch.int8:
            steps = (got.int() - want.int()).abs()
            assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3, name
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        smoothed += name.endswith("layernorm.weight")
    assert smoothed == 4  # two norms per layer, both carrying folded scales


def test_layer_by_layer_smoothquant_checks_alpha_and_order(tiny) -> None:
    with pytest.raises(ValueError, match="alpha"):
        sq.LayerByLayerSmoothQuant([[1, 2]], alpha=1.5)
    model = _llm(tiny).engine.runner.model
    with pytest.raises(RuntimeError, match="layer 1 arrived before layer 0"):
        sq.LayerByLayerSmoothQuant([[1, 2]])(model, 1, model.model.layers[1])
