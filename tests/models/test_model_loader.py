"""Loader: fused weights, sharded checkpoints, dummy weights and every kind of bad checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.engine.args import EngineArgs
from slipstream.models.loader import build_model, load_model
from slipstream.models.registry import get_model_class, supported_architectures
from tests.helpers import load_hf_model


def engine_config(path, **kw):
    return EngineArgs(model=str(path), device="cpu", dtype="float32", **kw).create_engine_config()


@pytest.fixture(scope="module")
def qwen2_dir(tiny_checkpoint):
    return tiny_checkpoint("Qwen2ForCausalLM")


def copy_with_tensors(src, dst, edit):
    """Copy a checkpoint dir, rewriting model.safetensors through edit(dict) -> dict."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(edit(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_registry_unknown_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match="GPTBigCodeForCausalLM") as e:
        get_model_class("GPTBigCodeForCausalLM")
    for arch in supported_architectures():
        assert arch in str(e.value)
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_load_model_unknown_architecture(tmp_path, qwen2_dir):
    dst = tmp_path / "odd"
    shutil.copytree(qwen2_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        load_model(engine_config(dst))


def test_fused_weights_hold_the_checkpoint_tensors(qwen2_dir):
    model = load_model(engine_config(qwen2_dir))
    ckpt = load_file(str(qwen2_dir / "model.safetensors"))
    layer = model.model.layers[1]
    p = "model.layers.1."
    qkv_w = torch.cat([ckpt[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    qkv_b = torch.cat([ckpt[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    gate_up = torch.cat([ckpt[p + "mlp.gate_proj.weight"], ckpt[p + "mlp.up_proj.weight"]])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv_w)
    assert torch.equal(layer.self_attn.qkv_proj.bias, qkv_b)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert layer.self_attn.o_proj.bias is None  # Qwen2: bias on q/k/v only


def test_missing_tensor_is_named(tmp_path, qwen2_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    dst = copy_with_tensors(qwen2_dir, tmp_path / "m",
                            lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="missing 1 tensor.*up_proj"):
        load_model(engine_config(dst))


def test_unexpected_tensor_is_named(tmp_path, qwen2_dir):
    dst = copy_with_tensors(qwen2_dir, tmp_path / "u",
                            lambda t: {**t, "model.layers.0.mystery.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        load_model(engine_config(dst))


def test_wrong_shape_is_named(tmp_path, qwen2_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    dst = copy_with_tensors(qwen2_dir, tmp_path / "s",
                            lambda t: {**t, name: torch.zeros(8, 64)})
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        load_model(engine_config(dst))


def test_no_weights_without_dummy_is_a_clear_error(tmp_path, qwen2_dir):
    dst = tmp_path / "cfg-only"
    dst.mkdir()
    shutil.copy(qwen2_dir / "config.json", dst / "config.json")
    with pytest.raises(FileNotFoundError, match="dummy"):
        load_model(engine_config(dst))


def test_dummy_load_from_config_alone(tmp_path, qwen2_dir):
    dst = tmp_path / "cfg-only"
    dst.mkdir()
    shutil.copy(qwen2_dir / "config.json", dst / "config.json")
    a = load_model(engine_config(dst, load_format="dummy", seed=3))
    b = load_model(engine_config(dst, load_format="dummy", seed=3))
    c = load_model(engine_config(dst, load_format="dummy", seed=4))
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.01 < wa.std().item() < 0.05
    assert abs(a.model.norm.weight.mean().item() - 1.0) < 0.05
    for _, p in a.named_parameters():
        assert torch.isfinite(p).all()


def test_sharded_checkpoint_with_index(tmp_path, qwen2_dir):
    hf = load_hf_model(qwen2_dir)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a = load_model(engine_config(qwen2_dir)).state_dict()
    b = load_model(engine_config(sharded)).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_build_never_runs_random_init(monkeypatch, qwen2_dir):
    def forbidden(*args, **kwargs):
        raise AssertionError("random init ran while building the model")

    for name in ("normal_", "uniform_", "kaiming_uniform_", "xavier_uniform_", "trunc_normal_"):
        monkeypatch.setattr(torch.nn.init, name, forbidden)
    monkeypatch.setattr(torch.Tensor, "normal_", forbidden)
    monkeypatch.setattr(torch.Tensor, "uniform_", forbidden)
    model = build_model(engine_config(qwen2_dir))
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 32 + 32, 64)


def test_bfloat16_load(qwen2_dir):
    model = load_model(engine_config(qwen2_dir).replace(dtype="bfloat16"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
