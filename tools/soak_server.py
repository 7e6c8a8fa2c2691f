"""Soak test of `slipstream serve` (not in CI): mixed traffic with random aborts, oversize and
malformed requests, and the engine process killed every few minutes.

Starts its own server on the default model (CPU unless --device says otherwise), runs for
--minutes, then waits for the server to go idle and reports: requests served, rejected (4xx,
expected), failed (5xx or transport errors), engine restarts, and KV blocks free at the end
(all of them must be). Exits 1 if blocks leaked or the server died.

    python tools/soak_server.py --minutes 30 --kill-every 180
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.serve.server import free_port  # noqa: E402

KEY = "sk-soak"


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "slipstream.serve",
        "--port",
        str(port),
        "--device",
        args.device,
        "--api-key",
        KEY,
        "--max-engine-restarts",
        "1000",
        "--engine-restart-backoff",
        "0.5",
        "--engine-hang-timeout",
        "30",
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    if args.model:
        cmd += ["--model", args.model]
    return subprocess.Popen(cmd)


def engine_pid(server_pid: int) -> int | None:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == server_pid:
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def one_request(client: httpx.AsyncClient, counts: collections.Counter) -> None:
    kind = random.choices(
        ["ok", "stream", "abort", "huge", "oversize", "malformed", "chat"], weights=[30, 25, 15, 5, 5, 10, 10]
    )[0]
    body: dict | bytes = {
        "prompt": "Once upon a time" * random.randint(1, 20),
        "max_tokens": random.randint(1, 64),
        "temperature": 0.7,
    }
    path = "/v1/completions"
    if kind == "chat":
        path, body = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16},
        )
    elif kind == "huge":
        body = {"prompt": "word " * 700_000, "max_tokens": 1}
    elif kind == "oversize":
        body = json.dumps({"prompt": "x" * (5 * 2**20)}).encode()
    elif kind == "malformed":
        body = random.choice([b'{"prompt": ', b"[1,2]", b'{"prompt": "a", "n": "x"}'])
    try:
        if kind in ("stream", "abort"):
            async with client.stream("POST", path, json={**body, "stream": True}) as resp:
                lines = 0
                async for _ in resp.aiter_lines():
                    lines += 1
                    if kind == "abort" and lines >= random.randint(1, 6):
                        break  # the client leaves: its request must be aborted
                counts[f"{kind}:{resp.status_code}"] += 1
            if resp.status_code in (429, 503):
                await asyncio.sleep(float(resp.headers.get("retry-after", 1)))
            return
        if isinstance(body, bytes):
            resp = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            resp = await client.post(path, json=body)
        counts[f"{kind}:{resp.status_code}"] += 1
        if resp.status_code in (429, 503):  # as a polite client would
            await asyncio.sleep(float(resp.headers.get("retry-after", 1)))
    except httpx.HTTPError as exc:
        counts[f"{kind}:{type(exc).__name__}"] += 1


async def traffic(base_url: str, deadline: float, concurrency: int, counts: collections.Counter) -> None:
    async with httpx.AsyncClient(
        base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as client:

        async def worker() -> None:
            while time.monotonic() < deadline:
                await one_request(client, counts)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def killer(server: subprocess.Popen, deadline: float, every_s: float, kills: list[float]) -> None:
    while time.monotonic() + every_s < deadline:
        await asyncio.sleep(every_s)
        pid = engine_pid(server.pid)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            kills.append(time.monotonic())
            print(f"killed engine {pid}", flush=True)


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server not healthy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=180.0, help="seconds")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        wait_healthy(base_url, 600)
        counts: collections.Counter = collections.Counter()
        kills: list[float] = []
        deadline = time.monotonic() + args.minutes * 60

        async def run() -> None:
            await asyncio.gather(
                traffic(base_url, deadline, args.concurrency, counts),
                killer(server, deadline, args.kill_every, kills),
            )

        asyncio.run(run())
        wait_healthy(base_url, 300)
        time.sleep(2.0)  # let the last aborts reach the engine
        text = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        free = metric(text, "slipstream_kv_cache_free_blocks")
        total = metric(text, "slipstream_kv_cache_total_blocks")
        restarts = metric(text, "slipstream_engine_restarts_total")
        served = sum(v for k, v in counts.items() if k.endswith(":200"))
        rejected = sum(v for k, v in counts.items() if re.search(r":4\d\d$", k))
        failed = sum(counts.values()) - served - rejected
        print(json.dumps(dict(sorted(counts.items())), indent=1))
        print(
            f"served {served}  rejected (4xx) {rejected}  failed {failed}  "
            f"engine kills {len(kills)}  restarts {restarts:.0f}  "
            f"KV blocks free {free:.0f} / {total:.0f}"
        )
        alive = server.poll() is None
        return 0 if alive and free == total else 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
