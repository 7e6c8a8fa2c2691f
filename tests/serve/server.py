"""A real `slipstream serve` process for the tests: started as a subprocess on a free 127.0.0.1
port (engine in its own process behind it), so the tests exercise exactly what a user starts.

The session's shared `server` fixture (tests/conftest.py) is built from these helpers; tests that
need a server with other flags start their own with `start_server`.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "sk-test-0123456789"
MODEL = "tiny"
MAX_MODEL_LEN = 128
STARTUP_TIMEOUT_S = 180.0


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def engine_pid(self) -> int | None:
        """The engine core process: the server's one python child."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                return int(stat.parent.name)
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log_path: Path, api_key: str | None = API_KEY,
                 extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> ServerHandle:
    port = free_port()
    cmd = [sys.executable, "-m", "slipstream.serve", "--model", str(model_dir),
           "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(4 * 2**20),
           "--max-num-seqs", "128", "--device", "cpu", "--no-access-log",
           "--log-level", "warning", *(extra or [])]
    if api_key:
        cmd += ["--api-key", api_key]
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    env = {**os.environ, "SLIPSTREAM_API_KEY": "", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path, api_key)
    wait_healthy(handle)
    return handle


def wait_healthy(handle: ServerHandle) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited with {handle.proc.returncode}:\n"
                               f"{handle.log_tail()}")
        try:
            if httpx.get(handle.base_url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(handle)
    raise RuntimeError(f"server did not become healthy:\n{handle.log_tail()}")


def stop_server(handle: ServerHandle, timeout_s: float = 20.0) -> int:
    if handle.proc.poll() is None:
        handle.proc.send_signal(signal.SIGTERM)
        try:
            handle.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            handle.proc.kill()
            handle.proc.wait()
    return handle.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent already exited).
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"
