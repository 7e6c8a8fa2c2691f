"""Killing the engine process: in-flight requests fail with an error (503 / an error event),
/health turns 503, and the server exits non-zero instead of hanging.

This server runs a model directory with no tokenizer (as dummy-weight benchmark models are), so
it also checks token-id-only serving.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.serve.server import MODEL, free_port, start_server, stop_server

LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True}


def _without_tokenizer(model_dir, dest):
    dest.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, dest / name)
    return dest


def _check_token_id_serving(base_url: str) -> None:
    text = httpx.post(base_url + "/v1/completions", json={**LONG, "prompt": "words"})
    assert text.status_code == 400 and "tokenizer" in text.json()["error"]["message"]
    ids = httpx.post(base_url + "/v1/completions",
                     json={**LONG, "max_tokens": 3, "logprobs": 1}, timeout=60)
    assert ids.status_code == 200, ids.text
    out = ids.json()
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"])


def test_engine_death_fails_requests_and_exits_nonzero(tiny_chat_model_dir, tmp_path):
    bare = _without_tokenizer(tiny_chat_model_dir, tmp_path / "bare")
    handle = start_server(bare, tmp_path / "server.log", api_key=None)
    try:
        _check_token_id_serving(handle.base_url)
        engine_pid = handle.engine_pid()
        assert engine_pid is not None
        results: dict = {}
        streaming = threading.Event()

        def plain() -> None:
            resp = httpx.post(handle.base_url + "/v1/completions", json=LONG, timeout=60)
            results["plain"] = (resp.status_code, resp.json())

        def stream() -> None:
            events = []
            with httpx.stream("POST", handle.base_url + "/v1/completions",
                              json={**LONG, "stream": True}, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()
            results["stream"] = events

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert streaming.wait(60), handle.log_tail()
        os.kill(engine_pid, signal.SIGKILL)

        health = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and 503 not in health:
            try:
                health.append(httpx.get(handle.base_url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                break  # already gone
            time.sleep(0.05)
        for t in threads:
            t.join(30)

        assert 503 in health, f"/health never reported 503: {health}\n{handle.log_tail()}"
        status, body = results["plain"]
        assert status == 503 and body["error"]["code"] == "engine_dead", body
        events = results["stream"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead", events[-2]
        assert handle.proc.wait(timeout=30) == 1, handle.log_tail()
    finally:
        stop_server(handle)


def test_engine_start_failure_exits_nonzero(tiny_chat_model_dir, tmp_path):
    """A checkpoint the engine cannot load: the server says why and exits 1, no hang."""
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_chat_model_dir / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.serve", "--model", str(broken), "--port", str(port),
         "--device", "cpu", "--max-model-len", "64", "--log-level", "warning"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "engine failed to start" in proc.stderr
