"""/v1/embeddings on a real `slipstream serve` process with a pooling model: OpenAI shapes,
float and base64 vectors equal to the reference pooling, dimensions, and the errors."""
from __future__ import annotations

import base64
import shutil

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.serve.server import MODEL, start_server, stop_server


@pytest.fixture(scope="module")
def embed_server(tiny_qwen3_embed_dir, tmp_path_factory):
    from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

    model_dir = tmp_path_factory.mktemp("embed_model")
    shutil.copytree(tiny_qwen3_embed_dir, model_dir, dirs_exist_ok=True)
    make_tiny_tokenizer(model_dir)
    handle = start_server(model_dir, tmp_path_factory.mktemp("embed_logs") / "server.log",
                          api_key=None)
    yield handle, model_dir
    assert stop_server(handle) == 0, handle.log_tail()


@torch.no_grad()
def _reference(model_dir, ids: list[int], dims: int | None = None) -> torch.Tensor:
    import transformers

    model = transformers.Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return F.normalize(last[:dims] if dims else last, dim=0)


def test_float_and_base64_embeddings(embed_server):
    handle, model_dir = embed_server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["hello world", "the quick brown fox jumps"]
    r = httpx.post(handle.base_url + "/v1/embeddings", json={"model": MODEL, "input": texts},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    ids = [tok.encode(t) for t in texts]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                             "total_tokens": sum(map(len, ids))}
    for i, (item, prompt) in enumerate(zip(body["data"], ids)):
        assert item["object"] == "embedding" and item["index"] == i
        got = torch.tensor(item["embedding"])
        assert torch.allclose(got, _reference(model_dir, prompt), atol=1e-4)
    r64 = httpx.post(handle.base_url + "/v1/embeddings",
                     json={"input": [ids[0]], "encoding_format": "base64", "dimensions": 16},
                     timeout=60)
    assert r64.status_code == 200, r64.text
    raw = np.frombuffer(base64.b64decode(r64.json()["data"][0]["embedding"]), dtype="<f4")
    assert raw.shape == (16,)
    assert torch.allclose(torch.from_numpy(raw.copy()), _reference(model_dir, ids[0], 16),
                          atol=1e-4)


def test_openai_client_and_errors(embed_server):
    handle, _ = embed_server
    import openai

    client = openai.OpenAI(base_url=handle.base_url + "/v1", api_key="none")
    res = client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]])
    assert [d.index for d in res.data] == [0, 1] and len(res.data[0].embedding) == 64
    assert abs(float(np.linalg.norm(res.data[1].embedding)) - 1.0) < 1e-4
    url = handle.base_url
    for body, param in [({"input": []}, "input"), ({"input": [[999999]]}, "input"),
                        ({"input": "x", "dimensions": 65}, "dimensions"),
                        ({"input": "x", "encoding_format": "int8"}, None)]:
        r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        if param:
            assert r.json()["error"]["param"] == param
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and "embeddings" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_an_embedding_model_scores_by_cosine(embed_server):
    handle, model_dir = embed_server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    query, docs = "hello world", ["the quick brown fox", "hello world"]
    r = httpx.post(handle.base_url + "/score", json={"text_1": query, "text_2": docs}, timeout=60)
    assert r.status_code == 200, r.text
    q = _reference(model_dir, tok.encode(query))
    want = [float(q @ _reference(model_dir, tok.encode(d))) for d in docs]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
    assert r.json()["data"][1]["score"] == pytest.approx(1.0, abs=1e-4)
