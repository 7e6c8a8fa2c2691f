"""slipstream.assets: paths of the embedded models, a clear error when they are missing."""

from __future__ import annotations

import pytest
import torch

from slipstream import assets


def test_missing_model_raises_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "DEFAULT_MODEL_DIR", tmp_path / "default_model")
    monkeypatch.setattr(assets, "DRAFT_MODEL_DIR", tmp_path / "draft_model")
    with pytest.raises(FileNotFoundError, match="train_default_model.py"):
        assets.default_model_path()
    with pytest.raises(FileNotFoundError, match="draft model"):
        assets.default_draft_model_path()
    assert not assets.has_default_model()


def test_present_model_directories_are_returned(tmp_path, monkeypatch):
    for name in ("default_model", "draft_model"):
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / f).write_text("{}")
    monkeypatch.setattr(assets, "DEFAULT_MODEL_DIR", tmp_path / "default_model")
    monkeypatch.setattr(assets, "DRAFT_MODEL_DIR", tmp_path / "draft_model")
    assert assets.default_model_path() == tmp_path / "default_model"
    assert assets.default_draft_model_path() == tmp_path / "draft_model"
    assert assets.has_default_model()


def test_paths_point_inside_the_package():
    assert assets.DEFAULT_MODEL_DIR.parent == assets.ASSETS_DIR
    assert assets.DRAFT_MODEL_DIR.name == "draft_model"


@pytest.mark.skipif(not assets.has_default_model(), reason="embedded models not trained yet")
def test_shipped_models_load_and_fit_the_size_limit():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    total = 0
    for path in (assets.default_model_path(), assets.default_draft_model_path()):
        total += sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        enc = tok("def fibonacci(n):", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=4, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        assert out.shape[1] > enc.input_ids.shape[1]
        assert (path / "README.md").is_file()
    assert total <= 20 * 1000 * 1000
