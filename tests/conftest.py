"""Test-wide setup and the fixtures shared across folders.

GPU tests (`@pytest.mark.gpu`) are skipped where no CUDA device exists. The tiny models are built
once per session from tests/helpers.py and shared: treat their directories as read-only (copy one
before editing it).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import make_tiny_checkpoint

# Tests that omit the model run on the small embedded one, even where SmolLM2 is installed
# (subprocesses inherit it); tests of the default selection set the variable themselves.
os.environ.setdefault("SLIPSTREAM_DEFAULT_MODEL", "embedded")
# Kernel-tuning results of test engines stay out of the user's ~/.cache (one directory per
# process, so parallel test workers never share a file).
os.environ.setdefault("SLIPSTREAM_CACHE_DIR", tempfile.mkdtemp(prefix="slipstream-test-cache-"))

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when a kernel module is imported: decide first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """Factory: `tiny_checkpoint(arch="LlamaForCausalLM", **overrides)` -> the directory of
    `make_tiny_checkpoint(arch, **overrides)`, built once per session for each distinct
    (arch, overrides). Read-only: a test that edits a checkpoint builds its own in tmp_path."""
    built: dict[str, Path] = {}

    def get(arch: str = "LlamaForCausalLM", **overrides: Any) -> Path:
        key = repr((arch, sorted(overrides.items())))
        if key not in built:
            built[key] = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint) -> Path:
    """The default tiny Llama checkpoint (no tokenizer)."""
    return tiny_checkpoint("LlamaForCausalLM")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer (adds <s>, chat template, id 5 as a second EOS)."""
    from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok_bos"), add_bos=True, eos_extra=5)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (max_position_embeddings 256) with a tokenizer and chat template beside it:
    what `slipstream serve` needs."""
    from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("serve_model")
    model_dir = make_tiny_checkpoint(root, "LlamaForCausalLM", max_position_embeddings=256)
    make_tiny_tokenizer(model_dir)  # byte-level BPE (420 ids < vocab 512) with a chat template
    return model_dir


@pytest.fixture(scope="session")
def server(tiny_chat_model_dir, tmp_path_factory):
    """One real `slipstream serve` process per session on tiny_chat_model_dir (API key
    tests.serve.server.API_KEY); shut down with SIGTERM at the end, which must exit 0."""
    from tests.serve.server import pid_alive, start_server, stop_server

    log_path = tmp_path_factory.mktemp("serve_logs") / "server.log"
    handle = start_server(tiny_chat_model_dir, log_path)
    yield handle
    engine_pid = handle.engine_pid()
    code = stop_server(handle)
    # Graceful shutdown on SIGTERM: exit 0 and no engine process left behind.
    assert code == 0, f"server exited with {code} on SIGTERM:\n{handle.log_tail()}"
    if engine_pid is not None:
        assert not pid_alive(engine_pid), "engine process outlived the server"


@pytest.fixture
def int4_reference(monkeypatch):
    """int4 layers on the CPU run the float32 reference twin instead of torch's bf16 int4 GEMM
    (quantization/int4_cpu.py): for tests that hold a layout's decoding to float math exactly."""
    from slipstream.quantization import int4_cpu

    monkeypatch.setattr(int4_cpu, "MAX_ROWS", 0)
