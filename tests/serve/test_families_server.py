"""`slipstream serve` on a Gemma 2 checkpoint (sliding-window and global layers, soft-capping,
a prompt past the window): the completion equals the offline engine's, field by field."""

from __future__ import annotations

import httpx
import pytest

from slipstream import LLM, SamplingParams
from tests.helpers import make_tiny_checkpoint
from tests.serve.server import API_KEY, MODEL, start_server, stop_server

PROMPT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))"


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

    model_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma"), "Gemma2ForCausalLM", max_position_embeddings=256
    )
    make_tiny_tokenizer(model_dir)
    handle = start_server(model_dir, tmp_path_factory.mktemp("logs") / "server.log")
    yield model_dir, handle
    assert stop_server(handle) == 0


def test_completion_equals_offline(gemma_server):
    model_dir, handle = gemma_server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    resp = httpx.post(
        handle.base_url + "/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert resp.status_code == 200, resp.text
    data = resp.json()
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=4 << 20)
    want = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(want.prompt_token_ids) > 8  # longer than the window
    assert data["object"] == "text_completion" and data["model"] == MODEL
    choice = data["choices"][0]
    assert choice["text"] == want.outputs[0].text
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert data["usage"] == {
        "prompt_tokens": len(want.prompt_token_ids),
        "completion_tokens": 8,
        "total_tokens": len(want.prompt_token_ids) + 8,
    }
