"""fp8 with measured 16-bit exceptions: `slipstream quantize --method fp8 --keep-float N` keeps
the N projections whose FP8 rounding disturbs the float model most, lists them in the
checkpoint's `ignored_layers`, and the reloaded checkpoint computes what a plain torch fake-quant
of the other projections computes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import LinearBase
from slipstream.quantization import fp8_calibration as fc
from slipstream.quantization.base import UnquantizedLinearMethod
from slipstream.quantization.calibration import calibration_prompts
from slipstream.quantization.fp8 import Fp8LinearMethod
from tests.helpers import greedy_ids, load_hf_model, skip_without_fp8
from tests.quantization.checkpoint_io import run_quantize_cli

CALIB = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog.",
         "for i in range(10):\n    print(i * i)\n", "A licence grants rights to use the work."]
PROMPT_LP = SamplingParams(max_tokens=1, prompt_logprobs=0)
LAYERS = 2


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), kv_cache_memory=16 << 20, enable_prefix_caching=False, **kwargs)


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PROMPT_LP, use_tqdm=False)
    return torch.tensor([e[t] for p, o in zip(prompts, outs)
                         for t, e in zip(p[1:], o.prompt_logprobs[1:])], dtype=torch.float64)


class FakeQuantFp8(UnquantizedLinearMethod):
    """The reference: plain torch per-token / per-channel E4M3 fake-quant of a float layer."""

    def apply(self, layer, x, bias):
        w = fc.fake_quant_weight(layer.weight.float())
        return F.linear(fc.fake_quant_tokens(x.float()), w, bias).to(x.dtype)

    def apply_gated(self, layer, gate_up, bias, act):
        return self.apply(layer, act(gate_up), bias)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256,
                           num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in CALIB))
    return path


def _quantize(tiny: Path, calib: Path, out: Path, keep: int) -> dict:
    assert run_quantize_cli(["quantize", "--model", str(tiny), "--method", "fp8", "--output", str(out),
                     "--keep-float", str(keep), "--calib-data", str(calib),
                     "--max-calib-len", "32"]) == 0
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.fixture(scope="module")
def kept_two(tiny, calib_file, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fp8_keep2")
    return out, _quantize(tiny, calib_file, out, 2)


def test_kept_layers_are_the_measured_ones(tiny, kept_two, prompts) -> None:
    out, qc = kept_two
    float_llm = _llm(tiny)
    model = float_llm.engine.runner.model
    calib = calibration_prompts(float_llm.tokenizer, CALIB, 32,
                                float_llm.engine_config.model.vocab_size)
    scores = fc.measure_sensitivity(model, calib)
    assert len(scores) == 4 * LAYERS and all(s > 0 for s in scores.values())
    chosen = fc.most_sensitive(scores, 2)
    assert qc["quant_method"] == "fp8" and qc["ignored_layers"] == fc.checkpoint_module_names(
        chosen, model.packed_modules_mapping)
    # The checkpoint: kept layers float under their HF names, bit for bit; the rest fp8.
    written, source = (load_file(str(d / "model.safetensors")) for d in (out, tiny))
    for name in qc["ignored_layers"]:
        assert torch.equal(written[f"{name}.weight"], source[f"{name}.weight"])
        assert f"{name}.weight_scale" not in written
    fp8_names = [n for n in written if n.endswith("weight_scale")]
    assert len(fp8_names) == 7 * LAYERS - len(qc["ignored_layers"])
    for norm in model.norm_fold_pairs().values():  # the source's norms, nothing folded
        assert torch.equal(written[f"{norm}.weight"], source[f"{norm}.weight"])


def test_reloaded_checkpoint_equals_torch_fake_quant(tiny, kept_two, prompts) -> None:
    out, qc = kept_two
    reloaded = _llm(out)
    kept = {n for n, m in reloaded.engine.runner.model.named_modules()
            if isinstance(m, LinearBase) and isinstance(m.quant_method, UnquantizedLinearMethod)}
    assert kept and all(isinstance(m.quant_method, (Fp8LinearMethod, UnquantizedLinearMethod))
                        for m in reloaded.engine.runner.model.modules()
                        if isinstance(m, LinearBase))
    # The reference: the float model, fake-quantizing every projection but the kept ones.
    ref = _llm(tiny)
    for name, m in ref.engine.runner.model.named_modules():
        if isinstance(m, LinearBase) and name.startswith("model.layers") and name not in kept:
            m.quant_method = FakeQuantFp8()
    got, want = _prompt_logprobs(reloaded, prompts), _prompt_logprobs(ref, prompts)
    assert (got - want).abs().max().item() < 1e-4
    plain = _prompt_logprobs(_llm(tiny), prompts)
    assert (got - plain).abs().max().item() > 1e-3  # the fp8 layers really are quantized


def test_keeping_every_projection_is_exactly_float(tiny, calib_file, tmp_path, prompts) -> None:
    qc = _quantize(tiny, calib_file, tmp_path / "all", 4 * LAYERS)
    assert len(qc["ignored_layers"]) == 7 * LAYERS
    got = _llm(tmp_path / "all")
    outs = got.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_ids(
        load_hf_model(tiny), prompts, 8)


def test_module_names_and_bad_counts(tiny, tmp_path) -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert fc.checkpoint_module_names(
        ["model.layers.3.self_attn.qkv_proj", "model.layers.3.mlp.down_proj"], packed) == [
        "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj",
        "model.layers.3.self_attn.v_proj", "model.layers.3.mlp.down_proj"]
    assert fc.most_sensitive({"a": 1.0, "b": 3.0, "c": 2.0}, 2) == ["b", "c"]
    with pytest.raises(ValueError, match="keep_float"):
        fc.most_sensitive({"a": 1.0}, -1)
    with pytest.raises(SystemExit):
        run_quantize_cli(["quantize", "--model", str(tiny), "--method", "int8_wo", "--output",
                  str(tmp_path / "x"), "--keep-float", "2"])


@pytest.mark.gpu
def test_keep_float_checkpoint_on_gpu_matches_cpu(kept_two, prompts) -> None:
    skip_without_fp8()
    out, _ = kept_two
    cpu = _prompt_logprobs(_llm(out), prompts)
    gpu = _prompt_logprobs(_llm(out, device="cuda", dtype="bfloat16"), prompts)
    assert (gpu - cpu).abs().mean().item() < 0.05


def test_quantize_reads_a_gguf_file(tmp_path) -> None:
    from tests.models.tiny_gguf import write_tiny_gguf

    prompts = [[5, 17, 300, 42], list(range(3, 40))]  # inside the tiny tokenizer's 420 ids
    gguf = write_tiny_gguf(tmp_path, "F32", tie_word_embeddings=True)
    out = tmp_path / "from-gguf"
    assert run_quantize_cli(["quantize", "--model", str(gguf), "--method", "fp8", "--output", str(out),
                     "--keep-float", str(4 * LAYERS), "--num-calib-samples", "2",
                     "--max-calib-len", "16"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "gguf" not in config and config["tie_word_embeddings"]
    assert (out / "tokenizer.json").is_file()
    # Every projection kept: the written checkpoint is the GGUF's float model, token for token.
    hf = load_hf_model(tmp_path / "hf" / "tiny-LlamaForCausalLM")
    got = _llm(out).generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == greedy_ids(hf, prompts, 8)
