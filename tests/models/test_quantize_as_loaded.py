"""Load-time quantization one layer at a time: the 16-bit weights of a method that quantizes at
load never exist for more than one decoder layer at once, and the values are those of quantizing
the whole loaded model afterwards."""
from __future__ import annotations

import pytest
import torch

from slipstream.engine.args import EngineArgs
from slipstream.layers.linear import LinearBase
from slipstream.models import norm_fold, quantize_as_loaded
from slipstream.models.loader import build_model, load_model
from slipstream.quantization.utils import (
    FP8_DTYPE,
    quantize_fp8_per_channel,
    quantize_int8_per_channel,
)
from tests.helpers import make_tiny_checkpoint


def engine_config(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return EngineArgs(model=str(path), **kw).create_engine_config()


@pytest.fixture(scope="module")
def llama_dir(tiny_checkpoint):
    # 128 wide: int4_awq's group size divides it
    return tiny_checkpoint("LlamaForCausalLM",
                           num_hidden_layers=3, hidden_size=128, intermediate_size=256)


def _unquantized_layers(model) -> set[int]:
    """Decoder layers that hold a linear layer's 16-bit weight with storage (not yet quantized)."""
    out = set()
    for path, module in model.named_modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, LinearBase) and w is not None and not w.is_meta
                and w.element_size() >= 2):
            out.add(int(path.split(".")[2]))
    return out


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("method", ["fp8", "int8_wo", "int4_awq"])
def test_one_decoder_layer_unquantized_at_a_time(monkeypatch, llama_dir, method, load_format):
    seen = []
    process = quantize_as_loaded.QuantizeAsLoaded._process

    def spy(self, path):
        if path.startswith("model.layers."):
            seen.append((int(path.split(".")[2]), _unquantized_layers(self.model)))
        process(self, path)

    monkeypatch.setattr(quantize_as_loaded.QuantizeAsLoaded, "_process", spy)
    model = load_model(engine_config(llama_dir, quantization=method, load_format=load_format))
    assert len(seen) == 3 * 4  # qkv, o, gate_up, down per layer, each processed once
    for layer, holding in seen:
        assert holding <= {layer}, f"processing layer {layer}, 16-bit weights in {holding}"
    assert not _unquantized_layers(model)
    assert not any(p.is_meta for p in model.parameters())


def test_build_gives_load_time_weights_no_storage(llama_dir):
    model = build_model(engine_config(llama_dir, quantization="fp8"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.is_meta and qkv.weight.shape == (qkv.output_size, qkv.input_size)
    assert qkv.weight.output_dim == 0  # the loader attributes survive materialisation
    assert not model.model.embed_tokens.weight.is_meta
    assert not build_model(engine_config(llama_dir)).model.layers[0].self_attn.qkv_proj.weight.is_meta


@pytest.mark.parametrize("method,quantize", [("fp8", quantize_fp8_per_channel),
                                             ("int8_wo", quantize_int8_per_channel)])
def test_dummy_weights_are_the_quantized_16_bit_dummy_weights(llama_dir, method, quantize,
                                                              monkeypatch):
    """Same seed, same values as before the change: the 16-bit dummy model, quantized (norms
    unfolded: test_norm_fold.py checks the folded weights)."""
    with norm_fold.kept_norms():
        plain = load_model(engine_config(llama_dir, load_format="dummy"))
        quant = load_model(engine_config(llama_dir, load_format="dummy", quantization=method))
    for (name, a), (_, b) in zip(plain.named_modules(), quant.named_modules(), strict=True):
        if isinstance(a, LinearBase):
            q, scale = quantize(a.weight.data)
            assert torch.equal(b.weight.view(torch.uint8) if b.weight.dtype == FP8_DTYPE else b.weight,
                               q.view(torch.uint8) if q.dtype == FP8_DTYPE else q), name
            assert torch.equal(b.weight_scale, scale), name


def test_checkpoint_weights_are_the_quantized_checkpoint(llama_dir):
    plain = load_model(engine_config(llama_dir))
    quant = load_model(engine_config(llama_dir, quantization="int8_wo"))
    down_a, down_b = plain.model.layers[2].mlp.down_proj, quant.model.layers[2].mlp.down_proj
    q, scale = quantize_int8_per_channel(down_a.weight.data)
    assert torch.equal(down_b.weight, q) and torch.equal(down_b.weight_scale, scale)


def test_a_missing_tensor_is_still_named(tmp_path, llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path / "missing"
    shutil.copytree(llama_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        load_model(engine_config(dst, quantization="fp8"))


@pytest.mark.gpu
def test_gpu_peak_memory_stays_below_the_16_bit_model(tmp_path):
    """32 layers of 1024 x 4096 (16.8M linear weights each): 1.07 GB of bf16 linear weights, which
    the old load-then-quantize held all at once. Quantizing as loaded peaks at the fp8 weights
    (0.54 GB) plus about one layer in bf16 and its float32 temporaries (~0.14 GB)."""
    layers = 32
    d = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", hidden_size=1024, intermediate_size=4096,
                             num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                             vocab_size=1024)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_model(engine_config(d, device="cuda", dtype="bfloat16", quantization="fp8",
                                     load_format="dummy"))
    peak = torch.cuda.max_memory_allocated() - base
    linear_bf16 = layers * (3 * 1024 * 1024 + 1024 * 1024 + 2 * 4096 * 1024 + 4096 * 1024) * 2
    assert peak < 0.75 * linear_bf16, (peak, linear_bf16)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE


def test_a_tensor_repeated_after_its_layer_was_quantized_is_an_error(llama_dir):
    from safetensors.torch import load_file

    from slipstream.models.loader import load_weights
    from slipstream.models.quantize_as_loaded import QuantizeAsLoaded

    model = build_model(engine_config(llama_dir, quantization="fp8"))
    tensors = list(load_file(str(llama_dir / "model.safetensors")).items())
    again = next(t for t in tensors if t[0] == "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="down_proj.weight arrived again"):
        load_weights(model, [*tensors, again], QuantizeAsLoaded(model, "cpu"))


def test_out_of_memory_message_sizes_the_weights_and_names_the_way_out(tmp_path):
    from slipstream.bench.shapes import materialize_shape, shape_config, weight_bytes
    from slipstream.models.loader import oom_message

    d = materialize_shape("llama-3.1-70b", tmp_path)
    config = engine_config(d, dtype="bfloat16", load_format="dummy")
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.75 GiB.\nmore")
    msg = oom_message(config, free=139 * 2**30, total=int(139.8 * 2**30), error=err)
    cfg = shape_config("llama-3.1-70b")
    assert "about 131.4 GiB as loaded (bfloat16)" in msg
    fp8 = weight_bytes(cfg, "bfloat16", "fp8") / 2**30
    int4 = weight_bytes(cfg, "bfloat16", "int4_awq") / 2**30
    assert f"about {fp8:.1f} / {int4:.1f} GiB" in msg and fp8 < 70 < 131
    assert "139.8 GiB, 139.0 GiB of it free" in msg and "quantization='fp8'" in msg
    assert msg.endswith("(CUDA out of memory. Tried to allocate 1.75 GiB.)")
    quant = oom_message(engine_config(d, dtype="bfloat16", quantization="fp8"), 1, 2, err)
    assert f"about {fp8:.1f} GiB as loaded (bfloat16, fp8)" in quant


@pytest.mark.gpu
@pytest.mark.gpu_alone  # it runs the device out of memory: a neighbour under -n could fail with it
def test_gpu_a_model_too_big_for_the_gpu_says_so(monkeypatch, tmp_path):
    """A 100-layer Llama-3.1-70B (163 GiB of bf16 weights) does not fit one H200: the loader's
    error sizes it and suggests quantizing at load instead of a bare allocator message. The
    up-front estimate check is switched off to run out of memory for real (the error a model
    the estimate misjudges would get)."""
    import json

    from slipstream.bench.shapes import shape_config
    from slipstream.models import loader

    monkeypatch.setattr(loader, "check_weights_fit", lambda *args: None)

    if torch.cuda.get_device_properties(0).total_memory > 160 * 2**30:
        pytest.skip("this GPU would hold the weights")
    (tmp_path / "config.json").write_text(json.dumps(
        {**shape_config("llama-3.1-70b"), "num_hidden_layers": 100}))
    before = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError,
                       match=r"^out of GPU memory while loading .*about 163.\d GiB as loaded.*'fp8'"):
        load_model(engine_config(tmp_path, device="cuda", dtype="bfloat16", load_format="dummy"))
    assert torch.cuda.memory_allocated() - before < 2**30  # the partly built model is freed


def test_weights_that_cannot_fit_fail_before_loading(tmp_path):
    import json

    from slipstream.bench.shapes import shape_config
    from slipstream.models.loader import check_weights_fit, weights_estimate

    (tmp_path / "config.json").write_text(json.dumps(
        {**shape_config("llama-3.1-70b"), "num_hidden_layers": 100}))
    bf16 = engine_config(tmp_path, dtype="bfloat16", load_format="dummy")
    fp8 = engine_config(tmp_path, dtype="bfloat16", load_format="dummy", quantization="fp8")
    free, total = 139 * 2**30, int(139.8 * 2**30)
    assert weights_estimate(bf16) > free > weights_estimate(fp8)
    with pytest.raises(torch.OutOfMemoryError, match=r"^not enough GPU memory for .*about 163.3 "
                       r"GiB as loaded \(bfloat16\).*free the GPU\.$"):
        check_weights_fit(bf16, free, total)
    check_weights_fit(fp8, free, total)  # ~87 GiB: fits, loading goes on
    check_weights_fit(bf16, int(weights_estimate(bf16) * 0.99), total)  # within the margin
