"""/score and /rerank on a real `slipstream serve` process with a BERT cross-encoder: each
pair's score equal to transformers (token type ids for the second segment), vLLM's response
shapes, rerank order and top_n, and 400s that name the field."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.serve.server import MODEL, start_server, stop_server

QUERY = "what jumps?"
DOCS = ["the quick brown fox", "a cat sat on the mat", "hello world"]


@pytest.fixture(scope="module")
def cross_server(tiny_bert_cross_encoder_dir, tmp_path_factory):
    handle = start_server(
        tiny_bert_cross_encoder_dir, tmp_path_factory.mktemp("score_logs") / "server.log", api_key=None
    )
    yield handle
    assert stop_server(handle) == 0, handle.log_tail()


@torch.no_grad()
def _hf_scores(model_dir, query: str, docs: list[str]) -> list[float]:
    import transformers

    model = transformers.BertForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return [model(**tok(query, d, return_tensors="pt")).logits[0, 0].sigmoid().item() for d in docs]


def test_score_and_rerank_equal_transformers(cross_server, tiny_bert_cross_encoder_dir):
    import transformers

    want = _hf_scores(tiny_bert_cross_encoder_dir, QUERY, DOCS)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_bert_cross_encoder_dir)
    num_tokens = sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)

    r = httpx.post(
        cross_server.base_url + "/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS}, timeout=60
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["usage"] == {"prompt_tokens": num_tokens, "completion_tokens": 0, "total_tokens": num_tokens}
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in body["data"])
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)

    # Lists of equal length pair up, on the /v1 path too.
    r = httpx.post(
        cross_server.base_url + "/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}, timeout=60
    )
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want[:2], abs=1e-4)

    r = httpx.post(
        cross_server.base_url + "/v1/rerank",
        json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    assert [x["index"] for x in body["results"]] == best
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in best]
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx([want[i] for i in best], abs=1e-4)
    assert body["usage"]["total_tokens"] == num_tokens


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ],
)
def test_bad_pairs_are_400s(cross_server, path, body, param):
    r = httpx.post(cross_server.base_url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_generation_endpoints_refuse_on_a_scoring_server(cross_server):
    r = httpx.post(
        cross_server.base_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 400, r.text
