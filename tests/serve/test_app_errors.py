"""The HTTP layer against a fake engine, in process: internal failures become a generic 500 (or
an error event then [DONE] in a stream) without leaking details, and a dead engine means 503.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from slipstream.engine.async_llm import EngineDeadError
from slipstream.outputs import CompletionOutput, RequestOutput
from slipstream.serve.app import build_app
from slipstream.serve.params import ServeLimits

SECRET = "secret-internal-detail"


class ByteTokenizer:
    """Token id = byte value + 1 (0 is reserved); enough for the HTTP layer."""

    def __len__(self) -> int:
        return 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] or "" for m in messages)


class FakeEngine:
    """Answers "ok" one token at a time, or fails the way `mode` says."""

    config = None

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.dead = asyncio.Event()
        self.stats: dict = {}
        self.aborted: list[str] = []

    @property
    def is_running(self) -> bool:
        return self.mode != "dead"

    def generate(self, prompt, params, request_id, priority=0):
        if self.mode == "dead":
            raise EngineDeadError("gone")
        if self.mode == "reject":
            raise ValueError("temperature must be in [0, 2], got 9")
        return self._stream(prompt, request_id)

    async def _stream(self, prompt, request_id):
        tokens = []
        for i, ch in enumerate("ok"):
            if self.mode == "crash" and i == 1:
                raise RuntimeError(SECRET)
            tokens.append(ord(ch) + 1)
            done = i == 1
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(
                0, "ok"[: i + 1], list(tokens), finish_reason="length" if done else None)],
                finished=done)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def get_stats(self, fresh: bool = False, timeout_s: float = 2.0) -> dict:
        return self.stats


def _call(mode: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    engine = FakeEngine(mode)
    app = build_app(engine, ByteTokenizer(), "fake", ServeLimits(max_model_len=64))

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_fake_engine_happy_path():
    resp = _call("ok", BODY)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize("body,path", [(BODY, "/v1/completions"),
                                       (CHAT, "/v1/chat/completions")])
def test_internal_error_is_generic_500(body, path):
    resp = _call("crash", body, path)
    assert resp.status_code == 500
    err = resp.json()["error"]
    assert err["type"] == "server_error" and SECRET not in resp.text


@pytest.mark.parametrize("body,path", [(BODY, "/v1/completions"),
                                       (CHAT, "/v1/chat/completions")])
def test_internal_error_in_stream_is_an_error_event_then_done(body, path):
    resp = _call("crash", {**body, "stream": True}, path)
    assert resp.status_code == 200
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert SECRET not in resp.text


def test_dead_engine_is_503_and_unhealthy():
    resp = _call("dead", BODY)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
    app = build_app(FakeEngine("dead"), ByteTokenizer(), "fake", ServeLimits(max_model_len=64))

    async def health() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/health")).status_code

    assert asyncio.run(health()) == 503


def test_engine_value_error_is_400_with_param():
    resp = _call("reject", BODY)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
