"""A killed or hung engine process: in-flight requests fail with an error (503 / an error event),
/health is 503 while the front end restarts the engine, then the server serves again; past the
restart cap it exits 1. IPC directories never outlive the front end.

One server runs the whole story (engine starts are the slow part). Its model directory has no
tokenizer (as dummy-weight benchmark models do), so it also checks token-id-only serving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.serve.server import MODEL, free_port, start_server, stop_server

LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True}
SHORT = {**LONG, "max_tokens": 3, "logprobs": 1}
HANG_TIMEOUT_S = 1.5
FLAGS = [
    "--engine-hang-timeout",
    str(HANG_TIMEOUT_S),
    "--max-engine-restarts",
    "2",
    "--engine-restart-backoff",
    "0.1",
]


def _without_tokenizer(model_dir, dest):
    dest.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, dest / name)
    return dest


def _check_token_id_serving(base_url: str) -> None:
    resp = httpx.post(base_url + "/v1/completions", json=SHORT, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"])


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _first_tokens_seen(base_url: str) -> float:
    """Requests that have had their first token, from the front end's TTFT histogram."""
    for line in httpx.get(base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("slipstream_time_to_first_token_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class InFlight:
    """One plain and one streamed long request, started together."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.results: dict = {}
        self.streaming = threading.Event()
        self.threads = [threading.Thread(target=self._plain), threading.Thread(target=self._stream)]
        self._seen_before = _first_tokens_seen(base_url)
        for t in self.threads:
            t.start()

    def wait_both_generating(self, timeout_s: float = 60.0) -> bool:
        """Both requests have their first token, so both are in the engine (the streamed one's
        first event alone let the plain one arrive after the failure on a loaded machine,
        where it rightly got engine_restarting)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.streaming.is_set() and _first_tokens_seen(self.base_url) >= self._seen_before + 2:
                return True
            time.sleep(0.005)
        return False

    def _plain(self) -> None:
        resp = httpx.post(self.base_url + "/v1/completions", json=LONG, timeout=60)
        self.results["plain"] = (resp.status_code, resp.json())

    def _stream(self) -> None:
        events = []
        with httpx.stream(
            "POST", self.base_url + "/v1/completions", json={**LONG, "stream": True}, timeout=60
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    self.streaming.set()
        self.results["stream"] = events

    def any_finished(self) -> bool:
        return bool(self.results)

    def join(self) -> None:
        for t in self.threads:
            t.join(60)

    def assert_failed_with_engine_dead(self) -> None:
        self.join()
        status, body = self.results["plain"]
        assert status == 503 and body["error"]["code"] == "engine_dead", body
        events = self.results["stream"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead", events[-2]


def _freeze_mid_generation(handle, engine_pid: int, attempts: int = 3) -> tuple[InFlight, float]:
    """Two long requests generating and the engine stopped (SIGSTOP) under them; the requests
    and when the engine stopped. On a loaded machine both requests can finish between seeing
    their first tokens and the signal, leaving nothing to fail: then the engine resumes and
    a new pair tries again."""
    for _ in range(attempts):
        inflight = InFlight(handle.base_url)
        assert inflight.wait_both_generating(), handle.log_tail()
        os.kill(engine_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(0.3)  # outputs the engine sent before it stopped reach the clients
        if not inflight.any_finished():
            return inflight, stopped_at
        os.kill(engine_pid, signal.SIGCONT)
        inflight.join()
    raise AssertionError(f"requests finished before the engine could be stopped, {attempts} times")


def _watch_restart(base_url: str, timeout_s: float = 120.0) -> tuple[set[int], list[dict]]:
    """Poll /health (and send requests) until it is 200 again; the statuses seen, and the
    error bodies of requests sent while it was not."""
    statuses: set[int] = set()
    refused: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(base_url + "/health", timeout=5).status_code
        statuses.add(status)
        if status == 200 and 503 in statuses:
            return statuses, refused
        if status == 503 and len(refused) < 3:
            resp = httpx.post(base_url + "/v1/completions", json=SHORT, timeout=5)
            if resp.status_code == 503:
                refused.append({**resp.json()["error"], "retry": resp.headers.get("retry-after")})
        time.sleep(0.05)
    raise AssertionError(f"no restart seen: /health gave {statuses}")


def test_engine_killed_or_hung_is_restarted_until_the_cap(tiny_chat_model_dir, tmp_path):
    tmp = Path(tempfile.mkdtemp(prefix="ss"))  # short: IPC socket paths have a length limit
    stale = tmp / f"slipstream-ipc-{_dead_pid()}-left"
    stale.mkdir()
    bare = _without_tokenizer(tiny_chat_model_dir, tmp_path / "bare")
    handle = start_server(bare, tmp_path / "server.log", api_key=None, extra=FLAGS, env={"TMPDIR": str(tmp)})
    try:
        assert not stale.exists(), "a dead server's IPC directory was not removed"
        _check_token_id_serving(handle.base_url)

        for how in (signal.SIGKILL, signal.SIGSTOP):
            engine_pid = handle.engine_pid()
            # Frozen at once: on a fast CPU the 100 tokens take well under a second.
            inflight, stopped_at = _freeze_mid_generation(handle, engine_pid)
            if how == signal.SIGKILL:
                os.kill(engine_pid, how)
            statuses, refused = _watch_restart(handle.base_url)
            inflight.assert_failed_with_engine_dead()
            if how == signal.SIGSTOP:  # noticed after the hang timeout, not before
                assert time.monotonic() - stopped_at > HANG_TIMEOUT_S
            assert all(r["code"] == "engine_restarting" and r["retry"] for r in refused), refused
            _check_token_id_serving(handle.base_url)
            assert handle.engine_pid() not in (None, engine_pid)

        metrics = httpx.get(handle.base_url + "/metrics").text
        assert "slipstream_engine_restarts_total 2.0" in metrics
        assert "slipstream_engine_up 1.0" in metrics

        os.kill(handle.engine_pid(), signal.SIGKILL)  # a third failure in a row: over the cap
        assert handle.proc.wait(timeout=60) == 1, handle.log_tail()
        assert list(tmp.iterdir()) == [], "IPC directories outlived the server"
    finally:
        stop_server(handle)
        shutil.rmtree(tmp, ignore_errors=True)


def test_engine_start_failure_exits_nonzero(tiny_chat_model_dir, tmp_path):
    """A checkpoint the engine cannot load: the server says why and exits 1, no hang."""
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_chat_model_dir / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slipstream.serve",
            "--model",
            str(broken),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-model-len",
            "64",
            "--log-level",
            "warning",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "engine failed to start" in proc.stderr
