"""The name a model is served under: never an absolute path."""
from __future__ import annotations

import pytest

from slipstream.serve.server import served_name


@pytest.mark.parametrize(("model", "name"), [
    (None, "default"),
    ("", "default"),
    ("/models/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"),
    ("/models/Llama-3.1-8B-Instruct/", "Llama-3.1-8B-Instruct"),
    ("./ckpt", "ckpt"),
    ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
])
def test_served_name(model: str | None, name: str) -> None:
    assert served_name(model) == name
