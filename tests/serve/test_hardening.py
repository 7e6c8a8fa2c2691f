"""Slow, numerous and malformed clients against the hardened HTTP layer (in process, fake
engine): slow headers and short bodies are cut off with 408, connections and requests over
their caps get 429 with Retry-After, and every such answer is an OpenAI error body."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from slipstream.serve.app import build_app
from slipstream.serve.hardening import HttpLimits
from slipstream.serve.params import ServeLimits
from tests.serve.inprocess import HoldingEngine, InProcessServer
from tests.serve.test_app_errors import ByteTokenizer

LIMITS = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=6, max_concurrent_requests=2)
BODY = {"model": "fake", "prompt": "hi", "max_tokens": 1}


class SlowTokenizer(ByteTokenizer):
    """Takes `delay_s` per encode, as a few megabytes of text do; one byte per token."""

    max_input_bytes_per_token = 1

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        time.sleep(self.delay_s)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def srv():
    engine = HoldingEngine()
    tokenizer = SlowTokenizer()
    with InProcessServer(engine, tokenizer, LIMITS, max_model_len=64) as server:
        server.engine = engine
        server.tokenizer = tokenizer
        yield server


def _connect(srv) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Read until the server closes; parse status, headers and the JSON body."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _assert_openai_error(body: dict, code: str) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code, body


def test_slow_headers_are_cut_off_with_408(srv):
    sock = _connect(srv)
    start = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes
    status, _, body = _read_response(sock)
    elapsed = time.monotonic() - start
    assert status == 408 and 0.4 < elapsed < 3.0, elapsed
    _assert_openai_error(body, "timeout")


def test_body_shorter_than_content_length_is_cut_off_with_408(srv):
    sock = _connect(srv)
    start = time.monotonic()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
        b'\r\ncontent-length: 100\r\n\r\n{"model": '
    )
    status, headers, body = _read_response(sock)
    assert status == 408 and time.monotonic() - start < 3.0
    assert headers["connection"] == "close"
    _assert_openai_error(body, "timeout")


def test_huge_header_is_an_openai_400(srv):
    resp = httpx.get(srv.base_url + "/v1/models", headers={"x-big": "a" * 2**20})
    assert resp.status_code == 400
    _assert_openai_error(resp.json(), "invalid_http_request")


def test_connection_cap_answers_429(srv):
    idle = [_connect(srv) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.05)
        resp = httpx.post(srv.base_url + "/v1/completions", json=BODY, timeout=5)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        _assert_openai_error(resp.json(), "too_many_connections")
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.05)
    assert httpx.post(srv.base_url + "/v1/completions", json=BODY).status_code == 200


def test_request_cap_answers_429_and_health_still_answers(srv):
    srv.engine.hold_s = 1.0
    results: list[int] = []

    def held() -> None:
        results.append(httpx.post(srv.base_url + "/v1/completions", json=BODY, timeout=10).status_code)

    threads = [threading.Thread(target=held) for _ in range(LIMITS.max_concurrent_requests)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)
        resp = httpx.post(srv.base_url + "/v1/completions", json=BODY, timeout=5)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        _assert_openai_error(resp.json(), "too_many_requests")
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
        for t in threads:
            t.join(10)
    finally:
        srv.engine.hold_s = 0.0
    assert results == [200] * LIMITS.max_concurrent_requests


def _health_latencies(base_url: str, seconds: float) -> list[float]:
    out = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while time.monotonic() < deadline:
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            out.append(time.monotonic() - start)
            time.sleep(0.02)
    return out


def test_slow_tokenization_does_not_stall_the_event_loop(srv):
    """Two prompts that take 0.6 s each to tokenize: /health keeps answering in milliseconds."""
    srv.tokenizer.delay_s = 0.6
    codes: list[int] = []

    def slow() -> None:
        codes.append(httpx.post(srv.base_url + "/v1/completions", json=BODY, timeout=10).status_code)

    threads = [threading.Thread(target=slow) for _ in range(LIMITS.max_concurrent_requests)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.05)
        latencies = _health_latencies(srv.base_url, 0.4)
        for t in threads:
            t.join(10)
    finally:
        srv.tokenizer.delay_s = 0.0
    assert codes == [200] * len(threads)
    # A stalled loop would hold /health for the whole 0.6 s; the bound leaves room for a
    # loaded CI machine.
    assert latencies and max(latencies) < 0.3, latencies


def test_prompt_longer_than_any_fit_is_rejected_without_tokenizing(srv):
    calls = srv.tokenizer.calls
    for body in (
        {**BODY, "prompt": "x" * 65},
        {"model": "fake", "messages": [{"role": "user", "content": "y" * 65}]},
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        resp = httpx.post(srv.base_url + path, json=body, timeout=5)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and "bytes" in err["message"]
        assert err["param"] == ("prompt" if "prompt" in body else "messages")
    assert srv.tokenizer.calls == calls


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_fails_a_request_with_no_output(stream):
    app = build_app(
        HoldingEngine(hold_s=2.0),
        ByteTokenizer(),
        "fake",
        ServeLimits(max_model_len=64, request_timeout_s=0.2),
    )

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", json={**BODY, "stream": stream})

    start = time.monotonic()
    resp = asyncio.run(go())
    assert time.monotonic() - start < 1.5
    if stream:
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
    else:
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
