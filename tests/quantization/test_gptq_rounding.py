"""GPTQ rounding (quantization/gptq.py) into int4_awq's layout: lower output error than
round-to-nearest for the same groups (32, 64, a short last group, per channel, act-order), and
`slipstream quantize --method int4_awq --gptq` checkpoints that load with no new code path and
generate exactly what their dequantized integers compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream import LLM, SamplingParams
from slipstream.quantization import checkpoint
from slipstream.quantization import utils as qu
from slipstream.quantization.gptq import GptqOptions, gptq_quantize, sink_weighted_gram
from tests.helpers import greedy_ids, load_hf_model
from tests.quantization.checkpoint_io import run_quantize_cli

PROMPTS = [[5, 17, 99, 300, 41], [7, 8, 9, 10, 11, 12, 13]]
MAX_NEW = 8


def _correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Inputs with correlated channels of unequal size, as a real layer's are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + torch.randn(k, k, generator=g) / k**0.5
    spread = torch.rand(k, generator=g) * 2 + 0.2
    return torch.randn(rows, k, generator=g) @ mix * spread


def _output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return (x @ (wq - w).t()).norm().item()


@pytest.mark.parametrize(
    "k,group,act_order",
    [(128, 32, False), (128, 64, False), (160, 64, False), (160, 64, True), (96, -1, False)],
    ids=["g32", "g64", "g64-short-last", "g64-act-order", "per-channel"],
)
def test_gptq_beats_round_to_nearest_on_output_error(k, group, act_order) -> None:
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(1))
    x = _correlated_inputs(1024, k, seed=2)
    g = group if group > 0 else k
    q, scales, zeros = qu.quantize_int4_groupwise(w, g)
    rtn = qu.dequantize_int4_groupwise(q, scales.half(), zeros, group_size=g)
    q, scales, zeros = gptq_quantize(w, x.t() @ x, group, GptqOptions(act_order=act_order))
    assert q.dtype == zeros.dtype == torch.uint8 and scales.dtype == torch.float16
    assert q.shape == w.shape and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (48, -(-k // g))
    gptq = qu.dequantize_int4_groupwise(q, scales, zeros, group_size=g)
    assert _output_error(x, w, gptq) < 0.85 * _output_error(x, w, rtn)


def test_a_column_that_never_sees_input_rounds_to_zero() -> None:
    """An input channel that is always zero carries no error to spread: its weights become
    exactly 0 (the zero point), and the factorisation stays finite."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    x = _correlated_inputs(256, 64, seed=4)
    x[:, 5] = 0.0
    q, scales, zeros = gptq_quantize(w, x.t() @ x, 32)
    deq = qu.dequantize_int4_groupwise(q, scales, zeros, group_size=32)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[:, 5], torch.zeros(16))


def test_each_blocks_first_token_weighs_as_asked() -> None:
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(5))
    rows = torch.cat([x[:, :1]] * 4 + [x[:, 1:]], dim=1).reshape(-1, 8)  # token 0 four times
    assert torch.allclose(sink_weighted_gram(x, 1.0), rows.t() @ rows / rows.shape[0], atol=1e-6)
    plain = x.reshape(-1, 8)
    assert torch.allclose(sink_weighted_gram(x, 0.25), plain.t() @ plain / 15, atol=1e-6)
    rest = x[:, 1:].reshape(-1, 8)  # weight 0: the first tokens left out
    assert torch.allclose(sink_weighted_gram(x, 0.0), rest.t() @ rest / 12, atol=1e-6)


def test_gptq_needs_a_hessian_of_the_weights_inputs() -> None:
    with pytest.raises(ValueError, match="Hessian"):
        gptq_quantize(torch.randn(8, 64), torch.eye(32), 32)


def _dequantized_twin(ckpt: Path, dst: Path, group: int) -> Path:
    """The float checkpoint of an AutoAWQ-layout checkpoint's dequantized integers."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    out = {n: t for n, t in tensors.items() if not n.endswith((".qweight", ".qzeros", ".scales"))}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        base = name.removesuffix(".qweight")
        q = qu.unpack_int32_cols(tensors[name], qu.AWQ_ORDER).t()
        zeros = qu.unpack_int32_cols(tensors[f"{base}.qzeros"], qu.AWQ_ORDER).t()
        scales = tensors[f"{base}.scales"].t()
        out[f"{base}.weight"] = qu.dequantize_int4_groupwise(q, scales, zeros, group_size=group)
    dst.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def short_group_model(tiny_checkpoint) -> Path:
    """hidden 160 and intermediate 288: short last groups at 64 and 128, output sizes multiples
    of 8 (the AutoAWQ layout packs eight output channels an int32)."""
    return tiny_checkpoint("LlamaForCausalLM", hidden_size=160, intermediate_size=288, head_dim=40, seed=4)


@pytest.mark.parametrize("group,awq", [(64, True), (32, False)], ids=["awq+gptq-g64", "gptq-g32"])
def test_quantize_gptq_writes_a_checkpoint_that_reloads(short_group_model, tmp_path, group, awq) -> None:
    """`slipstream quantize --method int4_awq --gptq` (with `--awq`: AWQ's scales first): the
    config records both, the checkpoint loads as any int4_awq one, and its greedy output equals
    transformers on its dequantized integers. Without AWQ (the default with GPTQ) the integers
    are GPTQ's, not round-to-nearest's."""
    out = tmp_path / "ckpt"
    argv = ["quantize", "--model", str(short_group_model), "--method", "int4_awq", "--output", str(out)]
    argv += ["--group-size", str(group), "--gptq", "--num-calib-samples", "4", "--max-calib-len", "64"]
    assert run_quantize_cli(argv + (["--awq"] if awq else [])) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == group and qc["calibration"] == {"awq_scales": awq, "gptq": True}
    llm = LLM(str(out), kv_cache_memory=16 << 20)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    down = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert down.int4_group_size == group and down.scales.shape == (160, -(-288 // group))
    twin = load_hf_model(_dequantized_twin(out, tmp_path / "twin", group))
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy_ids(twin, PROMPTS, MAX_NEW)
    if not awq:
        w = load_file(str(short_group_model / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
        rtn = qu.quantize_int4_groupwise(w, group)[0]
        got = qu.unpack_int32_cols(
            load_file(str(out / "model.safetensors"))["model.layers.0.mlp.down_proj.qweight"], qu.AWQ_ORDER
        ).t()
        assert 0.05 < (got != rtn).float().mean().item() < 0.9


def test_gptq_streams_at_the_default_group(short_group_model, tmp_path) -> None:
    """At the default group size AWQ + GPTQ run while the checkpoint loads, one decoder layer at
    a time; the files are those of running them on the whole loaded float model."""
    options = {"awq": True, "gptq": True}
    assert checkpoint.streams_calibration("int4_awq", options)
    assert not checkpoint.quantizes_at_load("int4_awq", None, {"awq": False, "gptq": True}, "cpu")
    assert checkpoint.quantizes_at_load("int4_awq", None, {"awq": False, "gptq": False}, "cpu")
    kw = dict(options=options, num_calib_samples=4, max_calib_len=64)
    streamed = checkpoint.quantize_checkpoint(short_group_model, "int4_awq", tmp_path / "s", **kw)
    whole = checkpoint.quantize_checkpoint(
        short_group_model, "int4_awq", tmp_path / "w", stream_layers=False, **kw
    )
    a, b = load_file(str(streamed / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.gpu
def test_gptq_on_cuda_matches_the_cpu_rounding() -> None:
    """`slipstream quantize --device cuda` runs GPTQ on the GPU: the same groups and nearly the
    same integers as on the CPU (float32 sums in another order can flip a rare tie, and GPTQ
    carries a flip on to later columns), and the same gain over round-to-nearest."""
    w = torch.randn(256, 320, generator=torch.Generator().manual_seed(6))
    x = _correlated_inputs(2048, 320, seed=7)
    h = x.t() @ x
    q_cpu, s_cpu, z_cpu = gptq_quantize(w, h, 64)
    q, s, z = gptq_quantize(w.cuda(), h.cuda(), 64)
    assert q.is_cuda and s.shape == s_cpu.shape and torch.allclose(s.cpu(), s_cpu, rtol=1e-2)
    assert (z.cpu() != z_cpu).float().mean().item() < 0.05
    assert (q.cpu() != q_cpu).float().mean().item() < 0.05
    rq, rs, rz = qu.quantize_int4_groupwise(w, 64)
    rtn = qu.dequantize_int4_groupwise(rq, rs.half(), rz, group_size=64)
    gptq = qu.dequantize_int4_groupwise(q.cpu(), s.cpu(), z.cpu(), group_size=64)
    assert _output_error(x, w, gptq) < 0.85 * _output_error(x, w, rtn)
