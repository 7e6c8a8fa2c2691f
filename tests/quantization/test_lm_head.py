"""quantize_lm_head: the LM head stored per vocabulary row in FP8 / INT8, as fp8 / int8_wo store a
linear layer, or in int4_awq's groupwise INT4 when asked by name (opt-in; the head stays in the
model dtype by default)."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from slipstream import LLM, SamplingParams
from slipstream.engine.args import EngineArgs
from slipstream.kernels.gemv.int4_common import w4_linear_reference
from slipstream.layers.embedding import LMHead, VocabEmbedding
from slipstream.quantization import fp8, int8_wo, utils
from tests.helpers import rel_err

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)


def _head(vocab: int = 300, hidden: int = 64, tied: bool = False) -> tuple[LMHead, VocabEmbedding]:
    emb = VocabEmbedding(vocab, hidden, torch.float32)
    emb.weight.data.normal_(0, 0.05)
    head = LMHead(vocab, hidden, torch.float32, tied=emb if tied else None)
    if not tied:
        head.weight.data.normal_(0, 0.05)
    return head, emb


@pytest.mark.parametrize("method", ["fp8", "int8_wo"])
@pytest.mark.parametrize("m", [5, 20])  # 20: int8 above 16 tokens runs chunks of the head
def test_quantized_head_is_the_methods_linear(method: str, m: int) -> None:
    head, _ = _head()
    w = head.weight.data.clone()
    head.quantize(method, chunk_rows=128)  # several chunks, the last one short
    want_q, want_scale = (utils.quantize_fp8_per_channel(w) if method == "fp8"
                          else utils.quantize_int8_per_channel(w))
    # 300 rows padded with zero rows to 304, a multiple of 16 (torch._scaled_mm's).
    assert head.weight.shape == (304, 64) and not head.weight[300:].float().any()
    assert head.weight.dtype == want_q.dtype and torch.equal(head.weight_scale[:300], want_scale)
    assert torch.equal(head.weight[:300].view(torch.uint8), want_q.view(torch.uint8))
    assert head.large_m_rows == (128 if method == "int8_wo" else 0)
    x = torch.randn(m, 64)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (m, 300) and logits.is_contiguous()
    if method == "fp8":  # the CPU twin quantizes activations per token, as large batches do
        want = fp8.fp8_linear_reference(x, want_q, want_scale)
    elif m <= int8_wo._CPU_PACKED_MAX_M:  # the CPU's bf16 INT8 GEMM: x and scales in bf16
        want = F.linear(x.bfloat16().float(), want_q.float()) * want_scale.bfloat16().float()
    else:
        want = F.linear(x, want_q.float()) * want_scale
    bf16 = method == "int8_wo" and m <= int8_wo._CPU_PACKED_MAX_M
    torch.testing.assert_close(logits, want, **({"rtol": 2 ** -8, "atol": 1e-3} if bf16 else {}))
    # Within the weight rounding of the float head: a real quantization, not a different matrix.
    exact = F.linear(x, w)
    assert rel_err(logits, exact) < (0.06 if method == "fp8" else 0.01)


@pytest.mark.parametrize(("hidden", "group"), [(128, 128), (64, 64)])  # 64: one group a row
@pytest.mark.parametrize("m", [5, 20])  # 20: chunks of the head
def test_int4_head_is_int4_awqs_linear(hidden: int, group: int, m: int) -> None:
    head, _ = _head(hidden=hidden)
    w = head.weight.data.clone()
    head.quantize("int4", chunk_rows=128)
    want_q, want_s, want_z = utils.quantize_int4_groupwise(
        torch.cat([w, w.new_zeros(4, hidden)]), group)  # 300 rows padded to 304
    assert head.weight.shape == (304, hidden // 2) and head.weight.dtype == torch.uint8
    assert torch.equal(head.weight, utils.pack_int4_rows(want_q))
    assert torch.equal(head.weight_scale, want_s.half()) and torch.equal(head.weight_zero, want_z)
    assert head.large_m_rows == 128
    x = torch.randn(m, hidden)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (m, 300) and logits.is_contiguous()
    want = w4_linear_reference(x, head.weight, head.weight_scale, head.weight_zero, group)[:, :300]
    torch.testing.assert_close(logits, want.float(), rtol=1e-5, atol=1e-5)
    exact = F.linear(x, w)  # within int4's rounding of the float head, not another matrix
    assert 0.01 < rel_err(logits, exact) < 0.15


def test_int4_head_without_triton(monkeypatch) -> None:
    """Where Triton cannot load, the int4 head dequantizes its rows and multiplies in torch."""
    from slipstream.quantization import int4_awq

    monkeypatch.setattr(int4_awq, "_INT4_LINEAR", [None])
    head, _ = _head(hidden=128)
    head.quantize("int4", chunk_rows=128)
    x = torch.randn(20, 128)
    want = w4_linear_reference(x, head.weight, head.weight_scale, head.weight_zero, 128)[:, :300]
    torch.testing.assert_close(head(x), want.float(), rtol=1e-5, atol=1e-5)


def test_int4_head_needs_a_hidden_size_of_sixteens() -> None:
    head, _ = _head(hidden=40)
    with pytest.raises(ValueError, match="multiple of 16"):
        head.quantize("int4")


def test_tied_head_gets_its_own_copy() -> None:
    head, emb = _head(tied=True)
    table = emb.weight.data.clone()
    head.quantize("int8_wo")
    assert head.weight.dtype == torch.int8 and emb.weight.dtype == torch.float32
    assert torch.equal(emb.weight, table)  # lookups still read the float table
    ids = torch.tensor([0, 7, 299])
    assert torch.equal(emb(ids), table[ids])


@pytest.mark.parametrize(("method", "choice"), [("fp8", True), ("int8_wo", True),
                                              ("int4_awq", True), ("int4_awq", "int4")])
def test_engine_with_quantized_head(method: str, choice, tiny_checkpoint) -> None:
    """Tiny Llama with tied embeddings: the head is quantized (int4_awq: in INT8, or INT4 when
    named), the embedding is not, and the logprob of the float head's first greedy token stays
    within the head's rounding of the float head's (measured here: 0.005 / 0.017 nats for
    int8, 0.035 / 0.09 for fp8 with its activation rounding on the CPU, 0.37 for int4)."""
    int4 = {"hidden_size": 128, "intermediate_size": 256} if method == "int4_awq" else {}
    path = tiny_checkpoint("LlamaForCausalLM", tie_word_embeddings=True, **int4)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250]}, {"prompt_token_ids": [42] * 9}]
    plain = LLM(str(path), quantization=method, kv_cache_memory=16 << 20)
    quant = LLM(str(path), quantization=method, quantize_lm_head=choice, kv_cache_memory=16 << 20)
    model = quant.engine.runner.model
    if choice == "int4":
        assert model.lm_head.weight.dtype == torch.uint8 and model.lm_head.weight_zero is not None
    else:
        assert model.lm_head.weight.dtype in (torch.int8, torch.float8_e4m3fn)
    assert model.model.embed_tokens.weight.dtype == quant.engine.runner.model.model.norm.weight.dtype
    assert plain.engine.runner.model.lm_head.quantized_linear is None
    outs = [o.outputs[0] for o in quant.generate(prompts, GREEDY, use_tqdm=False)]
    refs = [o.outputs[0] for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    # int4 (one 128-weight group a row of this tiny random head, round-to-nearest) moved it
    # 0.37 nats: the float head's token must still be among its top 5 (the logprobs' keys).
    tol = {"fp8": 0.25, "int4": 0.6}.get(choice if choice == "int4" else method, 0.05)
    if method == "int4_awq" and choice is True:
        assert model.lm_head.weight.dtype == torch.int8
    for out, ref in zip(outs, refs):
        first = ref.token_ids[0]  # the float head's choice, among the quantized head's top 5
        assert abs(out.logprobs[0][first] - ref.logprobs[0][first]) < tol


@pytest.mark.parametrize(("quantization", "head"), [("fp8", "fp8"), ("int8_wo", "int8_wo"),
                                                   ("int4_awq", "int8_wo"), ("w8a8_sq", "int8_wo"),
                                                   (None, None)])
def test_head_format_per_method(quantization, head, tiny_llama_dir) -> None:
    """fp8 keeps an FP8 head; the integer methods an INT8 weight-only one (an int4 head would
    move the logits much more); an unquantized model has nothing to say which."""
    path = tiny_llama_dir
    args = EngineArgs(model=str(path), quantization=quantization, quantize_lm_head=True)
    if head is None:
        with pytest.raises(ValueError, match="quantize_lm_head needs a quantization method"):
            args.create_engine_config()
        return
    assert args.create_engine_config().quant.lm_head == head
    plain = EngineArgs(model=str(path), quantization=quantization).create_engine_config()
    assert plain.quant.lm_head is None


@pytest.mark.parametrize(("quantization", "choice", "head"), [
    ("int4_awq", "int4", "int4"), ("fp8", "int4", "int4"), ("fp8", "int8", "int8_wo"),
    ("int8_wo", "INT4", "int4"), ("fp8", "fp8", "fp8"), ("int4_awq", False, None)])
def test_head_format_named(quantization, choice, head, tiny_llama_dir) -> None:
    """A format named takes the place of the method's own: int8 and int4 with any method."""
    path = tiny_llama_dir
    args = EngineArgs(model=str(path), quantization=quantization, quantize_lm_head=choice)
    assert args.create_engine_config().quant.lm_head == head


@pytest.mark.parametrize(("quantization", "choice", "error"), [
    ("int8_wo", "fp8", "an fp8 LM head needs quantization='fp8'"),
    ("int4_awq", "int3", "unknown format 'int3'"),
    (None, "int4", "quantize_lm_head needs a quantization method")])
def test_head_format_refused(quantization, choice, error, tiny_llama_dir) -> None:
    path = tiny_llama_dir
    args = EngineArgs(model=str(path), quantization=quantization, quantize_lm_head=choice)
    with pytest.raises(ValueError, match=error):
        args.create_engine_config()


def test_cli_flag() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "fp8",
                                                       "--quantize-lm-head"]))
    assert args.quantize_lm_head and args.quantization == "fp8"
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantize_lm_head is None  # checkpoint's
    no = EngineArgs.from_cli_args(parser.parse_args(["--no-quantize-lm-head"]))
    assert no.quantize_lm_head is False
    named = EngineArgs.from_cli_args(parser.parse_args(["--quantize-lm-head", "int4"]))
    assert named.quantize_lm_head == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantize-lm-head", "int2"])


def test_quantized_checkpoint_carries_the_choice(tiny_llama_dir, tmp_path) -> None:
    """`slipstream quantize --quantize-lm-head` records it; LLM(OUTPUT) follows it unless told
    otherwise. The head itself is stored float (the engine quantizes what it reads)."""
    import json

    from slipstream.quantization.checkpoint import quantize_checkpoint

    src = tiny_llama_dir
    out = quantize_checkpoint(src, "int8_wo", tmp_path / "out", quantize_lm_head=True)
    assert json.loads((out / "config.json").read_text())["quantize_lm_head"] is True
    head = LLM(str(out), kv_cache_memory=16 << 20).engine.runner.model.lm_head
    assert head.weight.dtype == torch.int8
    head = LLM(str(out), kv_cache_memory=16 << 20,
               quantize_lm_head=False).engine.runner.model.lm_head
    assert head.quantized_linear is None and head.weight.is_floating_point()
    four = quantize_checkpoint(src, "int8_wo", tmp_path / "four", quantize_lm_head="int4")
    assert json.loads((four / "config.json").read_text())["quantize_lm_head"] == "int4"
    head = LLM(str(four), kv_cache_memory=16 << 20).engine.runner.model.lm_head
    assert head.weight.dtype == torch.uint8 and head.weight_zero is not None
    with pytest.raises(ValueError, match="an fp8 LM head"):
        quantize_checkpoint(src, "int8_wo", tmp_path / "bad", quantize_lm_head="fp8")
    again = quantize_checkpoint(src, "int8_wo", tmp_path / "again")  # without: no key
    assert "quantize_lm_head" not in json.loads((again / "config.json").read_text())
    with pytest.raises(ValueError, match="not 'none'"):
        quantize_checkpoint(src, "none", tmp_path / "kv", kv_cache_dtype="fp8",
                            quantize_lm_head=True)


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fp8", "int8_wo"])
@pytest.mark.parametrize("m", [1, 4, 64])  # the decode GEMVs; torch._scaled_mm / cuBLAS
def test_gpu_quantized_head(method: str, m: int) -> None:
    vocab, hidden = 128256, 4096
    head = LMHead(vocab, hidden, torch.bfloat16).cuda()
    head.weight.data.normal_(0, 0.02)
    w = head.weight.data.float()
    head.quantize(method)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    got = head(x)
    want = F.linear(x.float(), head.weight.float() * head.weight_scale[:, None])
    # bf16 output; fp8 may also round the activations to FP8 (per token at M=64; per token
    # and slice in the small-batch tensor-core GEMV, which the tuner picks at M=4 on the H200).
    tol = 4e-2 if method == "fp8" else 1e-2
    assert rel_err(got, want) < tol
    exact = F.linear(x.float(), w)
    assert rel_err(got, exact) < (6e-2 if method == "fp8" else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 64])  # the one-row and few-row GEMVs; the large-M path
def test_gpu_int4_head(m: int) -> None:
    vocab, hidden = 128256, 4096
    head = LMHead(vocab, hidden, torch.bfloat16).cuda()
    head.weight.data.normal_(0, 0.02)
    w = head.weight.data.float()
    head.quantize("int4")
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    got = head(x)
    want = w4_linear_reference(x.float(), head.weight, head.weight_scale, head.weight_zero,
                               128)[:, :vocab]
    assert got.shape == (m, vocab) and rel_err(got, want) < 1e-2
    exact = F.linear(x.float(), w)
    assert rel_err(got, exact) < 0.15
