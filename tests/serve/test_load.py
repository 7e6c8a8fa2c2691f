"""Many clients at once: 100 concurrent requests each get exactly max_tokens, and an abort storm
(streams cancelled mid-way by the client) leaves no request running and every KV block free.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx

from tests.serve.server import MODEL


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def _one_request(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, str]:
    """Returns (completion tokens, finish reason); alternates streaming and plain requests."""
    body = {"model": MODEL, "prompt": f"request number {i}: ", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 1.0, "seed": i}
    if i % 2:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        return out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    tokens, reason = -1, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"] and event["choices"][0]["finish_reason"]:
                reason = event["choices"][0]["finish_reason"]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return tokens, reason


def test_100_concurrent_requests_get_exactly_max_tokens(server):
    rng = random.Random(0)
    wanted = [rng.randint(1, 12) for _ in range(100)]

    async def main() -> list[tuple[int, str]]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=120.0, limits=limits) as client:
            return await asyncio.gather(*(_one_request(client, i, n)
                                          for i, n in enumerate(wanted)))

    results = asyncio.run(main())
    assert [r[0] for r in results] == wanted
    assert all(r[1] == "length" for r in results)


async def _cancel_mid_stream(client: httpx.AsyncClient, i: int) -> int:
    """Start a long stream, read a couple of events, then hang up. Returns events read."""
    body = {"model": MODEL, "prompt": f"abort me {i}", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    if i % 3 == 0:  # some chat streams too
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"abort {i}"}],
                "max_tokens": 100, "ignore_eos": True, "stream": True}
        path = "/v1/chat/completions"
    else:
        path = "/v1/completions"
    seen = 0
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= 2 + i % 3:
                    break  # leaving the block closes the connection mid-stream
    return seen


def _engine_idle(http: httpx.Client) -> tuple[bool, str]:
    text = http.get("/metrics").text
    running = _metric(text, "slipstream_num_requests_running")
    waiting = _metric(text, "slipstream_num_requests_waiting")
    free = _metric(text, "slipstream_kv_cache_free_blocks")
    total = _metric(text, "slipstream_kv_cache_total_blocks")
    state = f"running={running} waiting={waiting} free={free}/{total}"
    return running == 0 and waiting == 0 and free == total and total > 0, state


def wait_engine_idle(http: httpx.Client, timeout_s: float) -> tuple[bool, str]:
    """Poll /metrics until no request is left and every block is free, or time runs out."""
    deadline = time.monotonic() + timeout_s
    idle, state = _engine_idle(http)
    while not idle and time.monotonic() < deadline:
        time.sleep(0.1)
        idle, state = _engine_idle(http)
    return idle, state


def _engine_aborts(http: httpx.Client) -> float:
    return _metric(http.get("/metrics").text, "slipstream_engine_aborted_requests_total")


def test_abort_storm_frees_everything(server, http):
    aborts_before = _engine_aborts(http)
    lengths_before = _finished(http, "length")

    async def storm() -> list[int]:
        # A fresh connection per request: closing a stream must really drop the connection.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers,
                                     timeout=60.0, limits=limits) as client:
            return await asyncio.gather(*(_cancel_mid_stream(client, i) for i in range(40)))

    seen = asyncio.run(storm())
    assert all(s >= 2 for s in seen)

    def ended() -> tuple[float, float]:
        return _engine_aborts(http) - aborts_before, _finished(http, "length") - lengths_before

    # Every cancelled stream ends in the engine: as an abort, or (on a busy 2-core machine, where
    # the client may take longer to hang up than the tiny model takes to write 100 tokens) as a
    # finished request. A disconnect is seen when the stream's next chunk is written, which took
    # over 10 s for some of the 40 there. A server that never passed the disconnect on would end
    # all 40 by length, so most must be aborts (CI saw 37 of 40).
    deadline = time.monotonic() + 30.0
    while sum(ended()) < len(seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    aborted, finished = ended()
    assert aborted + finished == len(seen), (aborted, finished)
    assert aborted >= len(seen) // 2, (aborted, finished)
    idle, state = wait_engine_idle(http, 10.0)
    assert idle, f"engine not idle after the abort storm: {state}"
    assert 'finished_reason="abort"' in http.get("/metrics").text
    start = time.monotonic()
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "still there?",
                                               "max_tokens": 4, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    assert time.monotonic() - start < 10.0


def _finished(http: httpx.Client, reason: str) -> float:
    """Sequences the server has finished for `reason` (abort, length, stop, ...)."""
    text = http.get("/metrics").text
    match = re.search(rf'^slipstream_request_success_total{{finished_reason="{reason}"[^}}]*}} (\S+)$',
                      text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _aborts(http: httpx.Client) -> float:
    return _finished(http, "abort")


def test_non_streaming_disconnect_aborts(server, http):
    """A plain request whose client times out is aborted too (nothing left running)."""
    before = _aborts(http)
    engine_before = _engine_aborts(http)
    # 16 samples x 120 tokens: far longer than the client's patience.
    body = {"model": MODEL, "prompt": "slow one", "max_tokens": 120, "ignore_eos": True,
            "n": 16}
    client = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=0.2)
    try:
        client.post("/v1/completions", json=body)
    except httpx.TimeoutException:
        pass
    finally:
        client.close()
    idle, state = wait_engine_idle(http, 10.0)
    assert idle, state
    assert _aborts(http) == before + 16
    assert _engine_aborts(http) == engine_before + 16
