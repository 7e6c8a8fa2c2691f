"""A table of client mistakes: each gets the right 4xx status and an OpenAI error body naming
the problem, and the server keeps serving afterwards.
"""
from __future__ import annotations

import httpx
import pytest

from tests.serve.server import API_KEY, MAX_MODEL_LEN, MODEL

C = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _c(**fields):
    return {**OK_PROMPT, **fields}


def _chat(**fields):
    return {**OK_CHAT, **fields}


# (id, path, json body or raw bytes, expected status, expected param or None, message part)
CASES = [
    ("max_tokens_wrong_type", C, _c(max_tokens="5"), 400, "max_tokens", "integer"),
    ("max_tokens_float", C, _c(max_tokens=5.5), 400, "max_tokens", None),
    ("max_tokens_zero", C, _c(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens_negative", C, _c(max_tokens=-3), 400, "max_tokens", None),
    ("max_tokens_huge", C, _c(max_tokens=10**12), 400, "max_tokens", str(MAX_MODEL_LEN)),
    ("max_tokens_beyond_int64", C, _c(max_tokens=10**30), 400, "max_tokens", None),
    ("temperature_negative", C, _c(temperature=-1.0), 400, "temperature", None),
    ("temperature_string", C, _c(temperature="hot"), 400, "temperature", None),
    ("temperature_infinite", C, b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}',
     400, "temperature", None),
    ("top_p_zero", C, _c(top_p=0.0), 400, "top_p", None),
    ("top_p_above_one", C, _c(top_p=1.5), 400, "top_p", None),
    ("top_k_negative", C, _c(top_k=-5), 400, "top_k", None),
    ("presence_penalty_range", C, _c(presence_penalty=3.0), 400, "presence_penalty", None),
    ("n_zero", C, _c(n=0), 400, "n", None),
    ("n_over_cap", C, _c(n=10_000), 400, "n", "at most"),
    ("logprobs_over_cap", C, _c(logprobs=50), 400, "logprobs", "at most"),
    ("logprobs_negative", C, _c(logprobs=-1), 400, "logprobs", None),
    ("seed_too_big", C, _c(seed=2**70), 400, "seed", None),
    ("stream_not_bool", C, _c(stream="yes"), 400, "stream", None),
    ("stop_wrong_type", C, _c(stop=5), 400, "stop", None),
    ("stop_empty_string", C, _c(stop=[""]), 400, "stop", None),
    ("min_tokens_over_max", C, _c(min_tokens=10, max_tokens=2), 400, "min_tokens", None),
    ("best_of_unsupported", C, _c(best_of=3), 400, "best_of", None),
    ("logit_bias_out_of_vocab", C, _c(logit_bias={"99999": 1.0}), 400, "logit_bias", None),
    ("logit_bias_not_a_token_id", C, _c(logit_bias={"five": 1.0}), 400, "logit_bias", None),
    ("unknown_field", C, _c(frobnicate=True), 400, "frobnicate", None),
    ("missing_prompt", C, {"model": MODEL}, 400, "prompt", None),
    ("empty_prompt", C, _c(prompt=""), 400, "prompt", "empty"),
    ("empty_prompt_list", C, _c(prompt=[]), 400, "prompt", None),
    ("prompt_wrong_type", C, _c(prompt={"text": "hi"}), 400, "prompt", None),
    ("token_id_outside_vocab", C, _c(prompt=[1, 2, 10**6]), 400, "prompt", "vocabulary"),
    ("negative_token_id", C, _c(prompt=[-1]), 400, "prompt", "vocabulary"),
    ("prompt_over_context", C, _c(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt",
     str(MAX_MODEL_LEN)),
    ("prompt_plus_max_tokens_over_context", C, _c(prompt=[5] * 100, max_tokens=100), 400,
     "max_tokens", "200"),
    ("lone_surrogate", C, b'{"model": "tiny", "prompt": "bad \\ud800 text"}', 400, "prompt",
     "UTF-8"),
    ("invalid_utf8_bytes", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, None),
    ("malformed_json", C, b'{"model": "tiny", "prompt": ', 400, None, "JSON"),
    ("json_not_object", C, b"[1, 2, 3]", 400, None, None),
    ("empty_body", C, b"", 400, None, None),
    ("unknown_model", C, _c(model="gpt-9"), 404, "model", "gpt-9"),
    ("chat_no_messages", CHAT, _chat(messages=[]), 400, "messages", None),
    ("chat_bad_role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role", None),
    ("chat_image_part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content",
     None),
    ("chat_top_logprobs_without_logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs",
     None),
    ("chat_max_completion_tokens_over", CHAT, _chat(max_completion_tokens=10**9), 400,
     "max_completion_tokens", str(MAX_MODEL_LEN)),
    ("chat_unknown_model", CHAT, _chat(model="nope"), 404, "model", None),
    ("chat_prompt_over_context", CHAT, _chat(messages=[{"role": "user", "content": "w " * 400}]),
     400, "messages", str(MAX_MODEL_LEN)),
    ("detokenize_bad_id", "/detokenize", {"tokens": [-7]}, 400, "tokens", None),
    ("tokenize_neither", "/tokenize", {}, 400, "prompt", None),
]


def _post(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def _assert_error_body(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.mark.parametrize("path,body,status,param,fragment",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(http, path, body, status, param, fragment):
    err = _assert_error_body(_post(http, path, body), status)
    if param is not None:
        assert err["param"] == param, err
    if fragment is not None:
        assert fragment in err["message"], err
    assert err["type"] == ("invalid_request_error" if status in (400, 404) else err["type"])


def test_server_still_serves_after_bad_inputs(http):
    for _, path, body, _, _, _ in CASES:
        _post(http, path, body)
    resp = http.post(C, json={**OK_PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": f"Basic {API_KEY}"},
                                     {"Authorization": f"Bearer {API_KEY}x"}])
@pytest.mark.parametrize("method,path", [("POST", C), ("GET", "/v1/models"),
                                         ("GET", "/metrics"), ("POST", "/tokenize")])
def test_wrong_or_missing_api_key(server, headers, method, path):
    resp = httpx.request(method, server.base_url + path, headers=headers, json=OK_PROMPT)
    err = _assert_error_body(resp, 401)
    assert err["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == 'Bearer realm="slipstream"'


def test_largest_seed_with_n_above_one(http):
    resp = http.post(C, json=_c(seed=2**63 - 1, n=2, temperature=1.0, ignore_eos=True))
    assert resp.status_code == 200, resp.text
    assert [c["index"] for c in resp.json()["choices"]] == [0, 1]


def test_health_needs_no_key(server):
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_body_size_cap(http):
    huge = {"model": MODEL, "prompt": "x" * (5 * 1024 * 1024)}
    err = _assert_error_body(http.post(C, json=huge), 413)
    assert "limit" in err["message"]


def test_chunked_body_over_cap(http):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"y" * 65536
        yield b'"}'

    resp = http.post(C, content=chunks(), headers={"content-type": "application/json"})
    _assert_error_body(resp, 413)


def test_unknown_route_and_method(http):
    assert _assert_error_body(http.get("/v1/nothing"), 404)["code"] == "not_found"
    _assert_error_body(http.get(C), 405)
