"""MoE models and the FusedMoE layer on the CPU path: prompt logits equal transformers' at every
position, the routing rule matters, expert placement (expert parallelism) splits the sum
exactly, and int8 / fp8 experts stay close to the 16-bit ones."""
from __future__ import annotations

import re

import pytest
import torch

from slipstream.engine.args import EngineArgs
from slipstream.kernels.moe import reference
from slipstream.layers.moe import DOWN, GATE, UP, FusedMoE, experts_of_rank
from slipstream.layers.moe_fp8_checkpoint import Fp8ExpertCheckpoint
from slipstream.models.loader import iterate_safetensors, load_weights, safetensors_files
from slipstream.models.moe import MixtralForCausalLM, SparseMoeBlock
from slipstream.models.quantize_as_loaded import QuantizeAsLoaded
from slipstream.runner.model_runner import ModelRunner
from tests.helpers import max_rel_err, rel_err
from tests.models.moe_checkpoints import MOE_ARCHITECTURES, make_tiny_moe_checkpoint
from tests.models.test_llama_parity import full_logits, hf_logits, make_runner

PROMPT = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_moe_checkpoint(root, arch) for arch in MOE_ARCHITECTURES}


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_prompt_logits_match_transformers(checkpoints, arch):
    runner = make_runner(checkpoints[arch])
    ours = full_logits(runner, PROMPT, block_ids=list(range(12)))
    ref = hf_logits(checkpoints[arch], PROMPT)
    assert max_rel_err(ours, ref) < 1e-4
    blocks = [layer.mlp for layer in runner.model.model.layers]
    if arch == "Qwen2MoeForCausalLM":  # mlp_only_layers=[1]: a dense layer, a shared expert
        assert not isinstance(blocks[1], SparseMoeBlock) and blocks[0].shared_expert is not None
    else:
        assert all(isinstance(b, SparseMoeBlock) for b in blocks)
    # Guard: the checkpoint's normalisation rule moves the logits when flipped.
    for block in blocks:
        if isinstance(block, SparseMoeBlock):
            block.experts.renormalize = not block.experts.renormalize
    assert max_rel_err(full_logits(runner, PROMPT, list(range(12))), ref) > 1e-2


def _random_moe(num_experts=6, top_k=2, hidden=32, inter=24, local=None, seed=0) -> FusedMoE:
    layer = FusedMoE(num_experts, top_k, hidden, inter, torch.float32, renormalize=True,
                     local_experts=local)
    g = torch.Generator().manual_seed(seed)
    full13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    full2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    layer.w13_weight.data.copy_(full13[list(layer.local_experts)])
    layer.w2_weight.data.copy_(full2[list(layer.local_experts)])
    return layer


def test_expert_placement_splits_the_sum_exactly():
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(3))
    full = _random_moe()(x, logits)
    even, odd = _random_moe(local=[0, 2, 4]), _random_moe(local=[5, 1, 3])
    assert even.local_experts == (0, 2, 4) and odd.expert_map.tolist() == [-1, 0, -1, 1, -1, 2]
    torch.testing.assert_close(even(x, logits) + odd(x, logits), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="subset"):
        _random_moe(local=[6])


def test_split_experts_load_their_slices_and_sum_exactly():
    """Tensor parallelism without expert parallelism: rank r holds rows [r I/2, (r+1) I/2) of
    each expert's gate and up and those columns of its down; the ranks' partial sums (before
    the all-reduce) add up to the whole layer's output."""
    full = _random_moe()
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = full.route(torch.randn(9, 6, generator=torch.Generator().manual_seed(3)))
    inter, total = full.intermediate_size, torch.zeros(9, 32)
    for rank in range(2):
        part = FusedMoE(6, 2, 32, inter, torch.float32, renormalize=True, tp_size=2, tp_rank=rank)
        assert part.intermediate_size == inter // 2 and part.w2_weight.shape == (6, 32, inter // 2)
        for e in range(6):
            gate, up = full.w13_weight[e, :inter], full.w13_weight[e, inter:]
            part.weight_loader(part.w13_weight, gate, 3 * e + GATE)
            part.weight_loader(part.w13_weight, up, 3 * e + UP)
            part.weight_loader(part.w2_weight, full.w2_weight[e], 3 * e + DOWN)
        total += part.experts(x, weights, ids)
    torch.testing.assert_close(total, full.experts(x, weights, ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not split"):
        FusedMoE(6, 2, 32, 25, torch.float32, renormalize=True, tp_size=2)


def test_expert_parallel_placement():
    assert [experts_of_rank(8, 4, r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [experts_of_rank(7, 3, r) for r in range(3)] == [(0, 1, 2), (3, 4), (5, 6)]
    with pytest.raises(ValueError, match="at least one expert per rank"):
        experts_of_rank(2, 4, 0)


def test_loader_keeps_only_this_ranks_experts(checkpoints):
    """A model built with local_experts loads those experts' tensors and skips the others'."""
    path = checkpoints["MixtralForCausalLM"]
    config = EngineArgs(model=str(path), device="cpu", dtype="float32").create_engine_config()
    runner = make_runner(path)
    ctx = _build_context(config, local_experts=[1, 4])
    model = MixtralForCausalLM(ctx)
    layers = QuantizeAsLoaded(model, "cpu")
    load_weights(model, iterate_safetensors(safetensors_files(path)), layers)
    layers.finish()
    for part, whole in zip(model.model.layers, runner.model.model.layers, strict=True):
        assert part.mlp.experts.w13_weight.shape[0] == 2
        assert torch.equal(part.mlp.experts.w13_weight, whole.mlp.experts.w13_weight[[1, 4]])
        assert torch.equal(part.mlp.experts.w2_weight, whole.mlp.experts.w2_weight[[1, 4]])


def _build_context(config, local_experts):
    from slipstream.kernels import get_ops
    from slipstream.layers.attention import get_attention_backend
    from slipstream.models.llama import BuildContext

    ops = get_ops("cpu")
    return BuildContext(config.model, torch.float32, ops, get_attention_backend("cpu", ops),
                        local_experts=local_experts)


@pytest.mark.parametrize("fmt,dtype,tol", [("int8", torch.int8, 0.02),
                                           ("fp8", torch.float8_e4m3fn, 0.06)])
def test_quantized_experts(fmt, dtype, tol):
    layer = _random_moe()
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(4))
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(5))
    want = layer(x, logits)
    layer.quant_method = type(layer.quant_method)(fmt)
    layer.quant_method.process_after_loading(layer)
    assert layer.w13_weight.dtype == dtype and layer.w2_scale.shape == (6, 32)
    assert rel_err(layer(x, logits), want) < tol


@pytest.mark.parametrize("method,dtype", [("int8_wo", torch.int8),
                                          ("fp8", torch.float8_e4m3fn)])
def test_quantization_at_load_reaches_the_experts(checkpoints, method, dtype):
    path = checkpoints["Qwen3MoeForCausalLM"]
    config = EngineArgs(model=str(path), device="cpu", dtype="float32", block_size=4,
                        quantization=method).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(64)
    experts = runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == dtype and experts.w13_scale.dtype == torch.float32
    assert runner.model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # router: as is
    ref = hf_logits(path, PROMPT[:20])
    assert rel_err(full_logits(runner, PROMPT[:20], list(range(12))), ref) < 0.3


def test_unsupported_expert_quantization_is_refused():
    """Experts in a format FusedMoE does not read (pre-quantized int8) are refused, not run in
    16 bits unnoticed; fp8 at load and pre-quantized fp8 are read."""
    from types import SimpleNamespace

    from slipstream.models.moe import expert_weight_format
    from slipstream.quantization.fp8 import Fp8LinearMethod
    from slipstream.quantization.int8_wo import Int8WeightOnlyMethod

    ctx = SimpleNamespace(quant_factory=lambda prefix: Int8WeightOnlyMethod(prequantized=True))
    with pytest.raises(ValueError, match="MoE experts support quantization"):
        expert_weight_format(ctx, "model.layers.0.mlp.experts")
    ctx = SimpleNamespace(quant_factory=lambda prefix: Fp8LinearMethod())
    assert expert_weight_format(ctx, "model.layers.0.mlp.experts") == ("fp8", None)
    ctx = SimpleNamespace(quant_factory=lambda prefix: Fp8LinearMethod(True, block_size=(16, 16)))
    assert expert_weight_format(ctx, "x")[1] == Fp8ExpertCheckpoint((16, 16), "weight_scale_inv")


_EXPERT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _fp8_expert_checkpoints(src, out, layout: str, float_modules: list[str]
                            ) -> tuple[object, object]:
    """(pre-quantized fp8 checkpoint, float checkpoint of its dequantized values) from src: the
    experts in `layout` ("tensor": one scale per tensor, with a static input scale; "channel":
    one per row; "block": 16 x 16 blocks), everything else float (float_modules listed as
    such)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from slipstream.quantization.fp8_layouts import dequantize_blockwise
    from slipstream.quantization.utils import FP8_DTYPE, FP8_MAX, quantize_fp8_per_channel

    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        quantized[name] = dequantized[name] = w
        if not _EXPERT.search(name):
            continue
        base = name.removesuffix(".weight")
        if layout == "block":
            blocks = w.unflatten(0, (-1, 16)).unflatten(2, (-1, 16)).abs().amax(dim=(1, 3))
            scale = blocks / FP8_MAX
            q = (w / scale.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(FP8_DTYPE)
            quantized[f"{base}.weight_scale_inv"] = scale
            # What the loader must make of it: the blocks requantized row by row.
            q2, row_scale = quantize_fp8_per_channel(dequantize_blockwise(q, scale, (16, 16)))
            dequantized[name] = q2.float() * row_scale[:, None]
        elif layout == "channel":
            q, scale = quantize_fp8_per_channel(w)
            quantized[f"{base}.weight_scale"] = scale[:, None]
            dequantized[name] = q.float() * scale[:, None]
        else:
            scale = w.abs().max() / FP8_MAX
            q = (w / scale).to(FP8_DTYPE)
            quantized[f"{base}.weight_scale"] = scale
            quantized[f"{base}.input_scale"] = torch.tensor(0.02)
            dequantized[name] = q.float() * scale
        quantized[name] = q
    paths = []
    for kind, weights in (("fp8", quantized), ("dequantized", dequantized)):
        path = out / kind
        shutil.copytree(src, path)
        save_file(weights, str(path / "model.safetensors"))
        if kind == "fp8":
            config = json.loads((path / "config.json").read_text())
            qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "modules_to_not_convert": float_modules}
            if layout == "block":
                qc["weight_block_size"] = [16, 16]
            config["quantization_config"] = qc
            (path / "config.json").write_text(json.dumps(config))
        paths.append(path)
    return tuple(paths)


@pytest.mark.parametrize("arch,layout", [("MixtralForCausalLM", "tensor"),
                                         ("Qwen3MoeForCausalLM", "channel"),
                                         ("Qwen2MoeForCausalLM", "block")])
def test_prequantized_fp8_experts(checkpoints, tmp_path, arch, layout):
    """Pre-quantized fp8 experts load into the per-row fp8 layout: the dequantized checkpoint's
    logits (for block scales: of the blocks requantized per row, as the loader does)."""
    float_modules = ["self_attn", "lm_head"]
    if arch == "Qwen2MoeForCausalLM":  # its shared experts and dense layer 1 stay float too
        float_modules += ["shared_expert", "model.layers.1.mlp"]
    fp8_path, float_path = _fp8_expert_checkpoints(checkpoints[arch], tmp_path, layout,
                                                   float_modules)
    runner = make_runner(fp8_path)
    experts = next(iter(runner.model.moe_blocks().values())).experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w13_scale.dtype == torch.float32
    ours = full_logits(runner, PROMPT, block_ids=list(range(12)))
    want = full_logits(make_runner(float_path), PROMPT, block_ids=list(range(12)))
    assert max_rel_err(ours, want) < 1e-5


def test_reference_routing_rules():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = reference.route_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]] and torch.allclose(w[0], probs[:2])
    w, _ = reference.route_topk(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_sizes_count_every_parameter_and_the_active_experts(checkpoints, arch):
    import json

    from slipstream.models.sizes import count_parameters, weight_bytes
    from tests.helpers import load_hf_model

    cfg = json.loads((checkpoints[arch] / "config.json").read_text())
    hf = load_hf_model(checkpoints[arch])
    assert count_parameters(cfg) == sum(p.numel() for p in hf.parameters())
    every, one_token = weight_bytes(cfg, "float32"), weight_bytes(cfg, "float32", decode_batch=1)
    inter, hidden = cfg["moe_intermediate_size"] if "moe_intermediate_size" in cfg else \
        cfg["intermediate_size"], cfg["hidden_size"]
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    sparse = sum(1 for i in range(cfg["num_hidden_layers"])
                 if i not in (cfg.get("mlp_only_layers") or []))
    unread = sparse * (experts - cfg["num_experts_per_tok"]) * 3 * hidden * inter * 4
    assert every - one_token == unread


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_l2_prefetch_spans_only_the_attention_output(checkpoints, arch):
    """The GPU attaches L2 prefetch spans at start-up; an MoE layer has no gate/up projection
    to name (which experts follow is known only after routing), so only o_proj is prefetched."""
    model = make_runner(checkpoints[arch]).model
    o_bytes = sum(t.numel() * t.element_size()
                  for t in model.model.layers[0].self_attn.o_proj.parameters())
    assert model.attach_l2_prefetch(1 << 30) == o_bytes


def test_fp8_expert_slices_for_tensor_parallel_ranks():
    """A rank's slice of a pre-quantized expert tensor: rows (gate / up) cut with their scales,
    columns (down) keep every row's scale; block scales are requantized over the slice only."""
    from slipstream.layers.moe_fp8_checkpoint import per_row_fp8
    from slipstream.quantization.fp8_layouts import dequantize_blockwise
    from slipstream.quantization.utils import quantize_fp8_per_channel

    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(6))
    q, rows = quantize_fp8_per_channel(w)
    row_fmt = Fp8ExpertCheckpoint()
    for cut in ((0, 16, 16), (1, 24, 24)):
        got_q, got_s = per_row_fp8(q, rows[:, None], row_fmt, cut)
        assert torch.equal(got_q.float(), q.float().narrow(*cut))
        assert torch.equal(got_s, rows.narrow(0, 16, 16) if cut[0] == 0 else rows)
    blocks = torch.rand(2, 3, generator=torch.Generator().manual_seed(7)) + 0.5
    block_fmt = Fp8ExpertCheckpoint((16, 16), "weight_scale_inv")
    got_q, got_s = per_row_fp8(q, blocks, block_fmt, (1, 24, 24))
    want_q, want_s = quantize_fp8_per_channel(
        dequantize_blockwise(q, blocks, (16, 16)).narrow(1, 24, 24))
    assert torch.equal(got_q.float(), want_q.float()) and torch.equal(got_s, want_s)
    with pytest.raises(ValueError, match="one per tensor or one per row"):
        per_row_fp8(q, rows[:5], row_fmt)
