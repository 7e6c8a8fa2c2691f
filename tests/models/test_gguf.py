"""GGUF checkpoints: greedy output equals transformers' own GGUF loader token for token (float and
quantized tensor types, tied embeddings, Llama's permuted q/k), config / tokenizer / chat
template / EOS from the metadata, and clear errors for files the engine cannot load.
"""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.engine.args import EngineArgs
from slipstream.models.gguf import iterate_gguf_weights, unpermute_rows
from slipstream.tokenizer.tokenizer import load_tokenizer
from tests.helpers import greedy_ids, load_hf_model
from tests.models.tiny_gguf import BOS, EOS, EOT, PAD, tiny_tokenizer_parts, write_tiny_gguf
from tests.tokenizer.tiny_tokenizer import CHAT_TEMPLATE

pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

PROMPTS = ["hello world, the quick brown fox", "def main():\n", "Les élèves 你好 😀"]
MAX_NEW = 10


def engine_config(path, **kw):
    return EngineArgs(model=str(path), device="cpu", dtype="float32", **kw).create_engine_config()


def hf_gguf_greedy(path, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' GGUF loader (float32) as the reference, never stopping early."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return greedy_ids(model, prompts, max_new)


def slipstream_greedy(path, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_token_ids(path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_llama_greedy_matches_transformers_gguf(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path, qtype)
    prompts = hf_token_ids(path)
    assert slipstream_greedy(path, prompts) == hf_gguf_greedy(path, prompts)


@pytest.mark.parametrize("arch,qtype,overrides", [
    ("LlamaForCausalLM", "Q8_0", {"tie_word_embeddings": True}),
    ("Qwen2ForCausalLM", "Q4_0", {}),
    # transformers reads no head_dim from a qwen3 GGUF: its default (128) must be the real one.
    ("Qwen3ForCausalLM", "Q8_0", {"tie_word_embeddings": True, "head_dim": 128}),
])
def test_other_shapes_match_transformers_gguf(tmp_path, arch, qtype, overrides):
    path = write_tiny_gguf(tmp_path, qtype, arch=arch, **overrides)
    prompts = hf_token_ids(path)
    assert slipstream_greedy(path, prompts) == hf_gguf_greedy(path, prompts)


def test_f32_gguf_equals_its_source_checkpoint(tmp_path):
    """Independent of transformers' GGUF loader: the F32 file runs as the HF checkpoint it was
    written from (the q/k permute undone exactly)."""
    path = write_tiny_gguf(tmp_path, "F32")
    prompts = [[5, 17, 300, 42], list(range(3, 40))]
    expected = greedy_ids(load_hf_model(tmp_path / "hf" / "tiny-LlamaForCausalLM"), prompts, MAX_NEW)
    assert slipstream_greedy(path, prompts) == expected


def test_tied_embeddings_when_the_file_has_no_output_tensor(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q8_0", tie_word_embeddings=True)
    config = engine_config(path)
    assert config.model.tie_word_embeddings
    names = [name for name, _ in iterate_gguf_weights(path, _llama_hf_names(2))]
    assert "lm_head.weight" not in names


def test_config_tokenizer_chat_template_and_eos_from_metadata(tmp_path):
    import json

    path = write_tiny_gguf(tmp_path, "Q4_0", eot=True)
    hf_cfg = json.loads((tmp_path / "hf" / "tiny-LlamaForCausalLM" / "config.json").read_text())
    model = engine_config(path).model
    assert model.architecture == "LlamaForCausalLM"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "bos_token_id"):
        assert getattr(model, field) == hf_cfg[field], field
    assert model.rms_norm_eps == pytest.approx(hf_cfg["rms_norm_eps"])
    assert not model.tie_word_embeddings
    ids = tiny_tokenizer_parts(tmp_path / "again")["ids"]
    assert model.eos_token_ids == (ids[EOS], ids[EOT])  # end-of-turn stops generation too
    tok = load_tokenizer(path)
    assert (tok.bos_token_id, tok.pad_token_id) == (ids[BOS], ids[PAD])
    assert tok.eos_token_ids[:2] == (ids[EOS], ids[EOT])
    assert tok.hf.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi<|end|><|assistant|>"
    assert tok.decode(tok.encode(PROMPTS[2])) == PROMPTS[2]


def test_llm_on_a_gguf_file_chats_with_its_template(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q8_0", eot=True)
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4),
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("<|user|>hi<|end|><|assistant|>")
    assert out.outputs[0].token_ids


def test_a_directory_holding_one_gguf_file(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1")
    config = engine_config(tmp_path)
    assert config.model_path == str(path) and config.tokenizer_path == str(path)
    assert load_tokenizer(tmp_path).path == str(path)


def test_weights_come_in_layer_order(tmp_path):
    """The writer puts lm_head first (safetensors order); the iterator yields the embedding,
    the layers in order, then the rest, as whole-layer load-time quantization needs."""
    path = write_tiny_gguf(tmp_path, "Q8_0")
    names = [name for name, _ in iterate_gguf_weights(path, _llama_hf_names(2))]
    assert names[0] == "model.embed_tokens.weight"
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers) and set(layers) == {0, 1}
    assert set(names[-2:]) == {"model.norm.weight", "lm_head.weight"}


def test_unpermute_rows_inverts_llama_cpp_permute():
    heads, head_dim, k = 3, 8, 5
    w = torch.arange(heads * head_dim * k, dtype=torch.float32).reshape(heads * head_dim, k)
    permuted = w.reshape(heads, 2, head_dim // 2, k).transpose(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, heads), w)


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*llama"):
        engine_config(path)


def test_two_gguf_files_in_a_directory_is_an_error(tmp_path):
    write_tiny_gguf(tmp_path, "Q8_0", name="a")
    write_tiny_gguf(tmp_path / "b", "Q4_0", name="b").rename(tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"2 GGUF files \(a.gguf, b.gguf\)"):
        engine_config(tmp_path)


def test_missing_and_wrong_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found"):
        engine_config(tmp_path / "absent.gguf")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a .gguf file"):
        engine_config(tmp_path / "weights.bin")
    (tmp_path / "broken.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        engine_config(tmp_path / "broken.gguf")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_from_the_rope_freqs_tensor(tmp_path):
    """A Llama 3.x file carries its long-context RoPE as llama.cpp's rope_freqs tensor: applied,
    the GGUF runs as the HF checkpoint it was written from. (transformers' GGUF loader ignores
    the tensor, so the reference is the source checkpoint.) With head_dim 16 and an original
    context of 64, every frequency class is present: kept, ramped and divided by the factor."""
    from slipstream.layers.rotary import inverse_frequencies

    path = write_tiny_gguf(tmp_path, "F32", rope_scaling=LLAMA3_ROPE)
    model_cfg = engine_config(path).model
    assert model_cfg.rope_scaling["rope_type"] == "freq_factors"
    names = [n for n, _ in iterate_gguf_weights(path, _llama_hf_names(2))]
    assert len(names) == len(set(names)) and not any("rope" in n for n in names)
    hf = load_hf_model(tmp_path / "hf" / "tiny-LlamaForCausalLM")
    inv_freq = inverse_frequencies(model_cfg.head_dim, model_cfg.rope_theta,
                                   model_cfg.rope_scaling)
    torch.testing.assert_close(inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    default = inverse_frequencies(model_cfg.head_dim, model_cfg.rope_theta, None)
    assert (inv_freq == default).sum() == 1 and (inv_freq * 8 == default).sum() >= 3
    prompts = [[5, 17, 300, 42], list(range(3, 40))]
    assert slipstream_greedy(path, prompts) == greedy_ids(hf, prompts, MAX_NEW)
    from slipstream.bench.hf_baseline import build_hf_model

    assert build_hf_model(path, "float32", "cpu").config.num_hidden_layers == 2  # bench baseline


def test_rope_freqs_with_another_scaling_is_an_error(tmp_path):
    from slipstream.models.gguf import _rope_scaling

    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    with pytest.raises(ValueError, match="rope_freqs.weight tensor together with RoPE scaling"):
        _rope_scaling(meta, "llama", "m.gguf", [1.0, 2.0])
    with pytest.raises(ValueError, match="needs 4 positive factors"):
        inverse_frequencies_of(8, [1.0, 2.0])


def inverse_frequencies_of(rotary_dim: int, factors: list[float]):
    from slipstream.layers.rotary import inverse_frequencies

    return inverse_frequencies(rotary_dim, 10000.0, {"rope_type": "freq_factors",
                                                     "freq_factors": factors})


def _llama_hf_names(layers: int) -> list[str]:
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                 "post_attention_layernorm"]
    names = [f"model.layers.{i}.{n}.weight" for i in range(layers) for n in per_layer]
    return ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", *names]


# ---- quantization="int4_awq": Q4_0 / Q4_1 blocks straight into the int4 layout (group 32) ----

def _greedy_logprobs(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[max(step.values()) for step in o.outputs[0].logprobs] for o in outs]
    return tokens, torch.tensor(logprobs)


@pytest.mark.usefixtures("int4_reference")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_awq_takes_q4_blocks_as_they_are(tmp_path, qtype):
    """Q4_0 maps exactly onto integer zeros, Q4_1 onto float zeros (-m): both give the
    dequantized model's greedy tokens and log-probs (the CPU int4 path is float32). Float zeros
    have no AutoAWQ form: saving such a layer says so."""
    from slipstream.quantization.gguf_int4 import GGUFInt4Method

    path = write_tiny_gguf(tmp_path, qtype)
    prompts = hf_token_ids(path)
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=16 << 20)
    tokens, logprobs = _greedy_logprobs(LLM(str(path), **kw), prompts)
    llm = LLM(str(path), quantization="int4_awq", **kw)
    got_tokens, got_logprobs = _greedy_logprobs(llm, prompts)
    assert got_tokens == tokens
    torch.testing.assert_close(got_logprobs, logprobs, rtol=0, atol=1e-4)
    for layer in llm.engine.runner.model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            params = dict(linear.named_parameters())
            assert isinstance(linear.quant_method, GGUFInt4Method)
            assert params["qweight"].dtype == torch.uint8 and params["scales"].shape[1] * 32 \
                == linear.input_size
            assert set(params) == {"qweight", "scales", "zeros"}
            assert params["zeros"].dtype == (torch.float16 if qtype == "Q4_1" else torch.uint8)
    if qtype == "Q4_1":
        with pytest.raises(ValueError, match="float zero points"):
            linear.quant_method.checkpoint_tensors(linear)


def test_int4_awq_rounds_other_gguf_types_at_group_32(tmp_path):
    from slipstream.quantization.gguf_int4 import GGUFInt4Method

    path = write_tiny_gguf(tmp_path, "Q8_0")  # hidden 64: group 128 could not divide it
    llm = LLM(str(path), quantization="int4_awq", dtype="float32", device="cpu",
              kv_cache_memory=16 << 20)
    linear = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert not isinstance(linear.quant_method, GGUFInt4Method)
    assert linear.scales.shape[1] == linear.input_size // 32
    assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_int8_wo_quantizes_dequantized_gguf_weights(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q8_0")
    llm = LLM(str(path), quantization="int8_wo", dtype="float32", device="cpu",
              kv_cache_memory=16 << 20)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_decoded_blocks_are_gguf_dequantize(qtype):
    import gguf

    from slipstream.quantization.gguf_int4 import decode_blocks

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)).numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(w, kind)
    q, d, m = decode_blocks(torch.from_numpy(blocks), qtype)
    q = q.float().reshape(6, 3, 32)
    groups = (q - 8) * d[..., None] if m is None else q * d[..., None] + m[..., None]
    assert torch.equal(groups.reshape(6, 96), torch.from_numpy(gguf.quants.dequantize(blocks, kind)))


def test_int4_awq_gguf_with_dummy_weights(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1")
    llm = LLM(str(path), quantization="int4_awq", load_format="dummy", dtype="float32",
              device="cpu", kv_cache_memory=16 << 20)
    assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n,k", [(576 + 2 * 192, 576), (2 * 1536, 576), (576, 1536)])
def test_gguf_int4_layer_on_the_gpu_kernels(qtype, n, k):
    """SmolLM2's shapes (K = 576 is no multiple of 128): the int4 kernels at group 32, one row
    (GEMV), a decode batch and a prefill (GEMM), against the dequantized weight in float32."""
    import gguf

    from slipstream.layers.linear import LinearBase
    from slipstream.quantization.gguf_int4 import GGUFInt4Method

    w = 0.05 * torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = torch.from_numpy(gguf.quants.quantize(w.numpy(), kind))
    want_w = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind)).cuda()
    with torch.device("cuda"):
        layer = LinearBase(k, [n], False, torch.bfloat16, GGUFInt4Method(qtype))
    layer.gguf_blocks.data.copy_(blocks)
    layer.quant_method.process_after_loading(layer)
    for m in (1, 8, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ want_w.t()
        got = layer(x).float()
        assert (got - want).norm() / want.norm() < 1e-2, (m, qtype)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_int4_engine_on_the_gpu_agrees_with_the_dequantized_model(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path, qtype, hidden_size=576, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           tie_word_embeddings=True)
    prompts = hf_token_ids(path)
    # float16, not bfloat16: on this random model bfloat16's rounding alone moves the log-probs
    # by ~0.15 (the CPU path shows the same), which would hide a wrong offset or zero point.
    kw = dict(dtype="float16", device="cuda", kv_cache_memory=64 << 20)
    tokens, logprobs = _greedy_logprobs(LLM(str(path), **kw), prompts)
    got_tokens, got_logprobs = _greedy_logprobs(LLM(str(path), quantization="int4_awq", **kw),
                                                prompts)
    assert [t[0] for t in got_tokens] == [t[0] for t in tokens]
    assert (got_logprobs[:, 0] - logprobs[:, 0]).abs().max() < 0.05
