"""GPTQ act-order (desc_act) 4-bit checkpoints: groups spread over K by a permuted g_idx load as
contiguous groups plus an input column permutation, and compute x @ W_deq^T."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from slipstream import LLM, SamplingParams
from slipstream.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from slipstream.quantization import int4_awq
from slipstream.quantization import utils as qu
from slipstream.quantization.base import get_quant_method_factory
from slipstream.quantization.int4_awq import ACT_ORDER_PERM, dequantize_layer

GROUP = 32
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
               "sym": False}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def act_order_g_idx(k: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ act-order: the i-th column quantized (a random order here) lands in group i // G."""
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // GROUP).to(torch.int32)
    return g_idx


def gptq_tensors(w: torch.Tensor, g_idx: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [N, K] RTN-quantized in groups g_idx, in the GPTQ v1 layout; also the dequantized [N, K]."""
    n, k = w.shape
    order = torch.argsort(g_idx.long(), stable=True)  # group 0's columns, then group 1's ...
    q_grouped, scales, zeros = qu.quantize_int4_groupwise(w[:, order], GROUP)
    scales = scales.half()
    q = torch.empty_like(q_grouped)
    q[:, order] = q_grouped
    deq = torch.empty(n, k)
    deq[:, order] = qu.dequantize_int4_groupwise(q_grouped, scales, zeros)
    stored_zeros = ((zeros.to(torch.int16) - 1) & 0xF).to(torch.uint8)  # v1: zero - 1 (mod 16)
    return {
        "qweight": qu.pack_int32_cols(q).t().contiguous(),  # int32 [K/8, N], packed along K
        "qzeros": qu.pack_int32_cols(stored_zeros.t().contiguous()),  # int32 [K/G, N/8]
        "scales": scales.t().contiguous(),  # [K/G, N]
        "g_idx": g_idx.clone(),  # a file holds each tensor once: q, k and v get their own copy
    }, deq


def _factory(desc_act: bool = True):
    return get_quant_method_factory("int4_awq", {"quantization_config": {**GPTQ_CONFIG,
                                                                         "desc_act": desc_act}})


def _load_layer(layer, shards: list[dict[str, torch.Tensor]]) -> None:
    """Feed each shard's checkpoint tensors through the layer's loaders, then repack."""
    for shard, tensors in enumerate(shards):
        for name, t in tensors.items():
            layer.weight_loader(getattr(layer, name), t, shard if len(shards) > 1 else None)
    layer.quant_method.process_after_loading(layer)


def _qkv_layer():
    return QKVParallelLinear(128, 16, 4, 2, bias=False, params_dtype=torch.float32,
                             quant_method=_factory()("qkv"))  # shards of 64, 32, 32 rows


def _load_fused(layer, g_idx_of_shard, gen: torch.Generator) -> torch.Tensor:
    shards, deqs = [], []
    for shard, size in enumerate(layer.output_sizes):
        tensors, deq = gptq_tensors(torch.randn(size, layer.input_size, generator=gen),
                                    g_idx_of_shard(shard))
        shards.append(tensors)
        deqs.append(deq)
    _load_layer(layer, shards)
    return torch.cat(deqs)


@pytest.mark.usefixtures("int4_reference")
def test_fused_act_order_layer_matches_dequantized_float_math() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = _qkv_layer()
    g_idx = act_order_g_idx(layer.input_size, gen)  # q, k and v share one input: one g_idx
    assert not torch.equal(g_idx.long(), torch.arange(128) // GROUP)
    deq = _load_fused(layer, lambda shard: g_idx, gen)
    perm = dict(layer.named_buffers())[ACT_ORDER_PERM]
    assert perm.dtype == torch.int64 and perm.device == layer.qweight.device
    assert torch.equal(dequantize_layer(layer, torch.float32), deq)
    x = torch.randn(5, 128, generator=gen)
    # Float32 either way; only the order of the K-sum differs.
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("int4_reference")
def test_plain_act_order_layer_matches_dequantized_float_math(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    layer = RowParallelLinear(256, 64, bias=True, params_dtype=torch.float32,
                              quant_method=_factory()("down"))
    tensors, deq = gptq_tensors(torch.randn(64, 256, generator=gen), act_order_g_idx(256, gen))
    layer.bias.data.copy_(torch.randn(64, generator=gen))
    _load_layer(layer, [tensors])
    x = torch.randn(2, 3, 256, generator=gen)
    want = F.linear(x, deq, layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(int4_awq, "_INT4_LINEAR", [None])  # no Triton: dequantize + F.linear
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="act-order"):  # AutoAWQ cannot express the permutation
        layer.quant_method.checkpoint_tensors(layer)


@pytest.mark.usefixtures("int4_reference")
@pytest.mark.parametrize("desc_act", [False, True])
def test_contiguous_g_idx_keeps_the_fast_path(desc_act: bool) -> None:
    """Plain GPTQ, and act-order with static groups (g_idx = k // G): no permutation, no gather."""
    layer = ColumnParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                                 quant_method=_factory(desc_act)("x"))
    tensors, deq = gptq_tensors(torch.randn(64, 128), (torch.arange(128) // GROUP).to(torch.int32))
    _load_layer(layer, [tensors])
    assert ACT_ORDER_PERM not in dict(layer.named_buffers())
    x = torch.randn(4, 128)
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-5, atol=1e-4)


def test_g_idx_with_a_wrong_group_count_is_a_value_error() -> None:
    gen = torch.Generator().manual_seed(2)
    g_idx = act_order_g_idx(128, gen)
    g_idx[(g_idx == 0).nonzero()[0]] = 1  # group 0 one column short, group 1 one over
    layer = ColumnParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                                 quant_method=_factory()("x"))
    tensors, _ = gptq_tensors(torch.randn(64, 128, generator=gen), act_order_g_idx(128, gen))
    tensors["g_idx"] = g_idx
    with pytest.raises(ValueError, match=r"\[64, 128\] layer must give each of its 4 groups "
                                         r"exactly 32 input columns.*31\.\.33"):
        _load_layer(layer, [tensors])
    layer = ColumnParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                                 quant_method=_factory()("x"))
    tensors["g_idx"] = torch.arange(128, dtype=torch.int32) % 5  # group 4 does not exist
    with pytest.raises(ValueError, match="exactly 32"):
        _load_layer(layer, [tensors])


def test_fused_shards_with_different_g_idx_are_a_value_error() -> None:
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="different g_idx"):
        _load_fused(_qkv_layer(), lambda shard: act_order_g_idx(128, gen), gen)


def test_act_order_refuses_only_k_split_tensor_parallel_layers() -> None:
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
        RowParallelLinear(256, 64, bias=False, params_dtype=torch.float32,
                          quant_method=_factory()("o"), tp_size=2, tp_rank=0)
    # Column-parallel layers split N, never K; row-parallel at one rank keeps all of K.
    ColumnParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                         quant_method=_factory()("x"), tp_size=2, tp_rank=1)
    RowParallelLinear(256, 64, bias=False, params_dtype=torch.float32,
                      quant_method=_factory()("o"))


# --- a tiny Llama in the GPTQ act-order layout vs. a float model of its dequantized weights -------

_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                 "up_proj": "gate_up"}  # fused projections read one input: one g_idx


def _write_act_order_and_dequantized(src: Path, quantized: Path, dequantized: Path) -> None:
    shutil.copytree(src, quantized)
    shutil.copytree(src, dequantized)
    gen = torch.Generator().manual_seed(4)
    g_idx_of: dict[str, torch.Tensor] = {}
    packed, floats = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            packed[name] = floats[name] = t
            continue
        base = name.removesuffix(".weight")
        parent, _, proj = base.rpartition(".")
        key = f"{parent}.{_SHARED_INPUT.get(proj, proj)}"
        if key not in g_idx_of:
            g_idx_of[key] = act_order_g_idx(t.shape[1], gen)
        tensors, floats[name] = gptq_tensors(t, g_idx_of[key])
        packed.update({f"{base}.{k}": v for k, v in tensors.items()})
    save_file(packed, str(quantized / "model.safetensors"))
    save_file(floats, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = GPTQ_CONFIG
    (quantized / "config.json").write_text(json.dumps(config))


def _greedy(path: Path, prompts) -> list[list[int]]:
    llm = LLM(str(path), kv_cache_memory=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.usefixtures("int4_reference")
def test_act_order_llama_generates_like_its_dequantized_float_model(tiny_checkpoint, tmp_path) -> None:
    tiny = tiny_checkpoint("LlamaForCausalLM", hidden_size=128, intermediate_size=256)
    quantized, dequantized = tmp_path / "gptq-act-order", tmp_path / "dequantized"
    _write_act_order_and_dequantized(tiny, quantized, dequantized)
    prompts = [[5, 17, 99, 300], [7, 8, 9, 10, 11]]
    assert _greedy(quantized, prompts) == _greedy(dequantized, prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_act_order_layer_matches_dequantized_float_math(m: int) -> None:
    """The permutation buffer moves to the GPU with the layer, and the gather feeds every int4
    kernel (M=1 GEMV, skinny, GEMM), eager and replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(2)
    k, n = 1024, 512
    layer = RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16,
                              quant_method=_factory()("down"))
    tensors, deq = gptq_tensors(torch.randn(n, k, generator=gen), act_order_g_idx(k, gen))
    _load_layer(layer, [tensors])
    layer.to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    want = x.float() @ deq.t().cuda()
    tol = 2e-2 * want.abs().max().item()  # bf16 output (and bf16 products at M=1)
    assert (layer(x).float() - want).abs().max().item() <= tol
    out = layer(x)  # tuned and compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    want = x.float() @ deq.t().cuda()
    assert (out.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()
