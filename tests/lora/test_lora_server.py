"""LoRA adapters through `slipstream serve`: listed in /v1/models, picked by the `model` field
(outputs equal to the offline engine with the same adapter), loaded and unloaded at run time
behind the API key, bad adapters refused with a 400 while the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from slipstream import LLM, LoRARequest, SamplingParams
from tests.lora.peft_adapters import make_adapter
from tests.serve.server import API_KEY, MODEL, start_server, stop_server

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_chat_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_loras")
    return [make_adapter(tiny_chat_model_dir, root / f"s{i}", targets, r, seed=10 + i)
            for i, (targets, r) in enumerate([(["q_proj", "v_proj", "down_proj"], 8),
                                              (["gate_proj", "up_proj", "o_proj"], 4)])]


@pytest.fixture(scope="module")
def offline_texts(tiny_chat_model_dir, adapters) -> list[str]:
    """Greedy text of PROMPT: base model, then each adapter (the offline engine)."""
    llm = LLM(str(tiny_chat_model_dir), device="cpu", enable_lora=True, max_loras=2,
              kv_cache_memory=1 << 22)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    loras = [None] + [LoRARequest(f"s{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    return [llm.generate([PROMPT], params, use_tqdm=False, lora_request=lo)[0].outputs[0].text
            for lo in loras]


@pytest.fixture(scope="module")
def lora_server(tiny_chat_model_dir, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora_serve_logs") / "server.log"
    handle = start_server(tiny_chat_model_dir, log, extra=[
        "--enable-lora", "--max-loras", "1", "--lora-modules", f"sql={adapters[0]}"])
    yield handle
    assert stop_server(handle) == 0, handle.log_tail()


def _complete(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True})


def test_adapters_as_models_and_load_unload(lora_server, adapters, offline_texts, tmp_path):
    with httpx.Client(base_url=lora_server.base_url, headers=lora_server.headers,
                      timeout=60.0) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == [MODEL, "sql"]
        base, sql = _complete(client, MODEL).json(), _complete(client, "sql").json()
        assert base["choices"][0]["text"] == offline_texts[0]
        assert sql["choices"][0]["text"] == offline_texts[1] != offline_texts[0]
        assert (base["model"], sql["model"]) == (MODEL, "sql")
        assert _complete(client, "code").status_code == 404

        # Loaded at run time; with one slot the two adapters take turns.
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "code",
                                                        "lora_path": str(adapters[1])})
        assert r.status_code == 200, r.text
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "sql", "code"]
        assert _complete(client, "code").json()["choices"][0]["text"] == offline_texts[2]
        assert _complete(client, "sql").json()["choices"][0]["text"] == offline_texts[1]
        chat = client.post("/v1/chat/completions", json={
            "model": "code", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["model"] == "code"

        again = client.post("/v1/load_lora_adapter", json={"lora_name": "code",
                                                            "lora_path": str(adapters[1])})
        assert again.status_code == 400 and "taken" in again.json()["error"]["message"]
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad",
                                                          "lora_path": str(tmp_path)})
        assert bad.status_code == 400
        assert "adapter_config.json is missing" in bad.json()["error"]["message"]

        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "code"}).status_code == 200
        assert _complete(client, "code").status_code == 404
        assert client.post("/v1/unload_lora_adapter",
                           json={"lora_name": "code"}).status_code == 404
        assert _complete(client, "sql").json()["choices"][0]["text"] == offline_texts[1]

    # Behind the API key like the other routes.
    anonymous = httpx.post(lora_server.base_url + "/v1/load_lora_adapter",
                           json={"lora_name": "x", "lora_path": str(adapters[1])})
    assert anonymous.status_code == 401
    assert API_KEY not in anonymous.text
