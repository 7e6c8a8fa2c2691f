"""int4 experts on the CPU path: quantized at load with quantization="int4_awq", a tiny Mixtral
and Qwen3-MoE generate the same greedy tokens as the same model with its expert weights replaced
by their dequantized int4 values (exact in float32), and the layer's int4 layout."""
from __future__ import annotations

import re

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.kernels.moe import reference
from slipstream.layers.moe import ExpertQuantMethod, FusedMoE, check_int4_sizes
from slipstream.models.moe import SparseMoeBlock
from slipstream.quantization.utils import dequantize_int4_groupwise, unpack_int4_rows
from tests.helpers import rel_err
from tests.models.moe_checkpoints import make_tiny_moe_checkpoint
from tests.quantization.checkpoint_io import write_int4_layout

PROMPTS = [[5, 77, 300, 12, 9, 41, 250], [100, 3, 3, 480, 17]]


def _dequantized(w, scale, zero, group):
    experts, rows, _ = w.shape
    q = unpack_int4_rows(w.reshape(experts * rows, -1))
    return dequantize_int4_groupwise(q, scale.reshape(experts * rows, -1),
                                     zero.reshape(experts * rows, -1), torch.float32,
                                     group).view(experts, rows, -1)


def _to_dequantized_float(layer: FusedMoE) -> None:
    """The experts' weights become their dequantized int4 values, run as float32."""
    group = layer.quant_method.group_size
    for name in ("w13", "w2"):
        w = _dequantized(getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_scale"),
                         getattr(layer, f"{name}_zero"), group)
        layer.register_parameter(f"{name}_weight", torch.nn.Parameter(w, requires_grad=False))
        for part in ("scale", "zero"):
            layer.register_parameter(f"{name}_{part}", None)
    layer.quant_method = ExpertQuantMethod(None)


@pytest.mark.parametrize("group", [16, 20])  # 20: a short last group (K = 32 and 48)
def test_int4_experts_layer(group):
    layer = FusedMoE(6, 2, 32, 48, torch.float32, renormalize=True, weight_format="int4",
                     int4_group_size=group)
    g = torch.Generator().manual_seed(0)
    full13 = torch.randn(6, 96, 32, generator=g) * 0.2
    full2 = torch.randn(6, 32, 48, generator=g) * 0.2
    layer.w13_weight.data.copy_(full13)
    layer.w2_weight.data.copy_(full2)
    x = torch.randn(7, 32, generator=g)
    logits = torch.randn(7, 6, generator=g)
    want = layer(x, logits)
    layer.quant_method.process_after_loading(layer)
    groups13, groups2 = -(-32 // group), -(-48 // group)
    assert layer.w13_weight.dtype == torch.uint8 and layer.w13_weight.shape == (6, 96, 16)
    assert layer.w13_scale.shape == (6, 96, groups13) and layer.w2_zero.shape == (6, 32, groups2)
    got = layer(x, logits)
    assert 0 < rel_err(got, want) < 0.25  # quantized (4 bits of Gaussian weights), and close
    deq13 = _dequantized(layer.w13_weight, layer.w13_scale, layer.w13_zero, group)
    assert rel_err(deq13, full13) < 0.15
    weights, ids = reference.route_topk(logits, 2, True)
    deq2 = _dequantized(layer.w2_weight, layer.w2_scale, layer.w2_zero, group)
    assert torch.equal(got, reference.fused_moe(x, deq13, deq2, weights, ids))


def test_int4_sizes_must_pack():
    check_int4_sizes(32, 48, 2)
    with pytest.raises(ValueError, match="even input sizes"):
        FusedMoE(4, 2, 32, 6, torch.float32, renormalize=True, weight_format="int4",
                 int4_group_size=16, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="positive group size"):
        ExpertQuantMethod("int4", group_size=0)


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_int4_at_load_generates_as_the_dequantized_model(tmp_path_factory, arch):
    path = make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe_int4"), arch)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20,
              quantization="int4_awq")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def generate():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]

    quantized = generate()
    blocks = [layer.mlp for layer in llm.engine.runner.model.model.layers
              if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(b.experts.w13_weight.dtype == torch.uint8 for b in blocks)
    for block in blocks:
        _to_dequantized_float(block.experts)
    assert generate() == quantized


def _write_int4_checkpoint(src, dst, layout: str, group: int):
    """src re-saved with every projection (attention and each expert's gate/up/down)
    RTN-quantized in groups of `group`, in the AWQ GEMM or GPTQ (v1) layout, per expert module
    as AutoAWQ / AutoGPTQ write MoE checkpoints."""
    projection = re.compile(r"(_proj|\.w[123])\.weight$")
    return write_int4_layout(src, dst, layout, group, lambda name: bool(projection.search(name)))


def _greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch,layout", [("Qwen3MoeForCausalLM", "awq"),
                                         ("MixtralForCausalLM", "gptq")])
def test_prequantized_int4_experts_load_like_load_time_rtn(tmp_path, monkeypatch, arch,
                                                           layout):
    """A GPTQ / AWQ MoE checkpoint of RTN-quantized weights (group 16) gives the tokens and
    logprobs of the float checkpoint quantized to int4 at load in groups of 16: the same
    integers, scales and zeros."""
    from slipstream.models import norm_fold
    from slipstream.quantization import int4_awq

    src = make_tiny_moe_checkpoint(tmp_path / "float", arch)
    path = _write_int4_checkpoint(src, tmp_path / layout, layout, group=16)
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=8 << 20)
    llm = LLM(str(path), quantization="int4_awq", **kw)
    experts = next(layer.mlp.experts for layer in llm.engine.runner.model.model.layers
                   if isinstance(layer.mlp, SparseMoeBlock))
    assert experts.int4_checkpoint is not None and experts.w2_zero.shape[2] == experts.intermediate_size // 16
    got = _greedy(llm)
    monkeypatch.setattr(int4_awq, "DEFAULT_GROUP", 16)
    with norm_fold.kept_norms():  # the checkpoint was written unfolded
        want_llm = LLM(str(src), quantization="int4_awq", **kw)
    want_experts = next(layer.mlp.experts for layer in want_llm.engine.runner.model.model.layers
                        if isinstance(layer.mlp, SparseMoeBlock))
    for name in ("w13_weight", "w13_scale", "w13_zero", "w2_weight", "w2_scale", "w2_zero"):
        assert torch.equal(getattr(experts, name), getattr(want_experts, name)), name
    assert got == _greedy(want_llm)


def test_int4_tensor_parallel_slices_keep_groups():
    from slipstream.layers.moe_int4_checkpoint import slice_int4
    from slipstream.quantization.utils import quantize_int4_groupwise

    q, scale, zero = quantize_int4_groupwise(torch.randn(8, 96), 32)
    cut = slice_int4(q, scale, zero, 1, 32, 64, 32)  # rank 1 of 3 would be 32..64; here 2 groups
    assert cut[0].shape == (8, 64) and cut[1].shape == (8, 2)
    assert torch.equal(cut[1], scale[:, 1:3])
    rows = slice_int4(q, scale, zero, 0, 4, 4, 32)
    assert torch.equal(rows[2], zero[4:])
    with pytest.raises(ValueError, match="whole groups of 32"):
        slice_int4(q, scale, zero, 1, 48, 48, 32)
    q, scale, zero = quantize_int4_groupwise(torch.randn(8, 80), 32)  # a short last group
    assert slice_int4(q, scale, zero, 1, 64, 16, 32)[1].shape == (8, 1)


def test_int4_expert_formats_taken_and_refused():
    from types import SimpleNamespace

    from slipstream.layers.moe_int4_checkpoint import Int4ExpertCheckpoint, unpack_expert
    from slipstream.models.moe import expert_weight_format
    from slipstream.quantization import utils as qu
    from slipstream.quantization.int4_awq import Int4LinearMethod

    for layout in (None, "awq", "gptq"):
        ctx = SimpleNamespace(quant_factory=lambda prefix, lay=layout: Int4LinearMethod(64, lay))
        assert expert_weight_format(ctx, "model.layers.0.mlp.experts") == ("int4", None)
    ctx = SimpleNamespace(quant_factory=lambda prefix: Int4LinearMethod(64, "compressed"))
    with pytest.raises(ValueError, match="MoE experts support quantization"):
        expert_weight_format(ctx, "model.layers.0.mlp.experts")
    # GPTQ act-order: a g_idx whose groups are not contiguous along K
    q, scales, zeros = qu.quantize_int4_groupwise(torch.randn(16, 64), 32)
    tensors = {"qweight": qu.pack_int32_cols(q).t().contiguous(),
               "qzeros": qu.pack_int32_cols(zeros.t().contiguous()),
               "scales": scales.t().contiguous().half(),
               "g_idx": (torch.arange(64) % 2).to(torch.int32)}
    with pytest.raises(ValueError, match="act-order"):
        unpack_expert(tensors, Int4ExpertCheckpoint("gptq", 32))
    tensors["g_idx"] = (torch.arange(64) // 32).to(torch.int32)
    got_q, _, got_zero = unpack_expert(tensors, Int4ExpertCheckpoint("gptq", 32))
    assert torch.equal(got_q, q) and torch.equal(got_zero, (zeros + 1) & 0xF)  # v1 offset
