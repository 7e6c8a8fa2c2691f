"""The server's own share of W6's TTFT and ITL, stage by stage, on the CPU.

Starts `slipstream serve` (the embedded model unless --model) in a child process whose request
path is wrapped with time.monotonic stamps (one clock for every process on the host), sends
W6-shaped streaming /v1/completions requests one at a time (token-id prompts, ignore_eos), and
prints each stage's median: the HTTP way in, the handler, the hop to the engine, the engine's
wait and prefill, the way back, the output processing, the SSE chunk and the client's read.
The stamps live in this script only: the package carries no tracing code.

    PYTHONPATH=$PWD python benchmarks/bench_serve_host.py --requests 20 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TRACE: list[dict] = []  # one dict a timed request, in the server process
BACKGROUND_HEADER = b"x-bench-background"  # requests that only keep the server busy


def _patch_server(trace_path: str) -> None:
    """Wrap the request path's stages with stamps (server process only)."""
    import contextvars

    from slipstream.engine import async_llm
    from slipstream.serve import app as app_mod
    from slipstream.serve import streaming

    current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("trace", default=None)
    by_request: dict[str, dict] = {}  # engine request id -> its trace
    real_build, real_create = app_mod.build_app, app_mod.create_completion

    def build_app(*args, **kwargs):
        app = real_build(*args, **kwargs)

        async def stamped(scope, receive, send):
            timed = (
                scope["type"] == "http"
                and scope["path"] == "/v1/completions"
                and BACKGROUND_HEADER not in dict(scope["headers"])
            )
            if timed:
                TRACE.append({"asgi": time.monotonic(), "recv": [], "handled": [], "sent": []})
            token = current.set(TRACE[-1] if timed else None)
            try:
                await app(scope, receive, send)
            finally:
                current.reset(token)

        return stamped

    async def create_completion(*args, **kwargs):
        if (trace := current.get()) is not None:
            trace["handler"] = time.monotonic()
        return await real_create(*args, **kwargs)

    real_generate = async_llm.AsyncLLM.generate

    def generate(self, prompt, params, request_id, *args, **kwargs):
        trace = current.get()
        if trace is None:
            return real_generate(self, prompt, params, request_id, *args, **kwargs)
        trace["gen_in"] = time.monotonic()
        out = real_generate(self, prompt, params, request_id, *args, **kwargs)
        trace["gen_out"] = time.monotonic()
        by_request[f"{request_id}-0"] = trace
        return out

    real_handle = async_llm.AsyncLLM._handle

    def handle(self, msg):
        if msg.get("t") != "outputs":
            return real_handle(self, msg)
        received = time.monotonic()
        traces = [by_request[o["request_id"]] for o in msg["outs"] if o["request_id"] in by_request]
        real_handle(self, msg)
        handled = time.monotonic()
        for trace in traces:
            trace["recv"].append(received)
            trace["handled"].append(handled)

    real_finished = async_llm.AsyncLLM._on_finished

    def on_finished(self, ro, now):
        trace = by_request.pop(f"{ro.request_id}-0", None)
        if trace is not None:
            m = ro.metrics
            trace.update(
                arrival=m.arrival_time,
                engine_arrival=m.engine_arrival_time,
                scheduled=m.first_scheduled_time,
                engine_first=m.engine_first_token_time,
                first=m.first_token_time,
            )
        real_finished(self, ro, now)

    real_produce = streaming.SSEResponse._produce

    async def produce(self, send):
        trace = current.get()

        async def stamped_send(message):
            if trace is not None and message.get("type") == "http.response.body" and message.get("body"):
                trace["sent"].append(time.monotonic())
            await send(message)

        await real_produce(self, stamped_send)

    app_mod.build_app = build_app
    app_mod.create_completion = create_completion
    async_llm.AsyncLLM.generate = generate
    async_llm.AsyncLLM._handle = handle
    async_llm.AsyncLLM._on_finished = on_finished
    streaming.SSEResponse._produce = produce

    def dump(*_):
        with open(trace_path, "w") as f:
            json.dump(TRACE, f)

    import atexit

    atexit.register(dump)


def _server_main(trace_path: str, argv: list[str]) -> None:
    _patch_server(trace_path)
    from slipstream.serve import server as server_mod
    from slipstream.serve.app import build_app

    server_mod.build_app = build_app
    from slipstream.serve.cli import main

    main(argv)


def _body(args: argparse.Namespace, rng, output_len: int) -> dict:
    return {
        "prompt": [rng.randrange(100, args.max_token_id) for _ in range(args.input_len)],
        "max_tokens": output_len,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


async def _background(client, args: argparse.Namespace, seed: int) -> None:
    """Streams that keep the server busy (other requests' tokens) while one is timed."""
    import random

    rng = random.Random(seed)
    headers = {BACKGROUND_HEADER.decode(): "1"}
    while True:
        body = _body(args, rng, args.background_len)
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            async for _ in resp.aiter_lines():
                pass


async def _client(args: argparse.Namespace) -> list[dict]:
    import random

    import httpx

    rng = random.Random(0)
    out = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=120) as client:
        busy = [asyncio.create_task(_background(client, args, 1 + k)) for k in range(args.background)]
        for i in range(args.requests + args.warmups):
            body = _body(args, rng, args.output_len)
            got = []
            t0 = time.monotonic()
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"choices":[{' in line:
                        got.append(time.monotonic())
            if i >= args.warmups:
                out.append({"t0": t0, "chunks": got})
            await asyncio.sleep(0.05 + 0.1 * rng.random())  # land at varied points of a step
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
    return out


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def _table(client: list[dict], server: list[dict]) -> list[tuple[str, float]]:
    server = server[-len(client) :]
    ttft_rows = {
        "client send -> ASGI app (HTTP in)": [s["asgi"] - c["t0"] for c, s in zip(client, server)],
        "ASGI -> handler (body, pydantic, middleware)": [s["handler"] - s["asgi"] for s in server],
        "handler -> generate() (checks, params)": [s["gen_in"] - s["handler"] for s in server],
        "generate() (input processing, msgpack)": [s["gen_out"] - s["gen_in"] for s in server],
        "generate() -> engine took it (ZMQ hop, decode, add)": [
            s["engine_arrival"] - s["gen_out"] for s in server
        ],
        "engine took it -> scheduled": [s["scheduled"] - s["engine_arrival"] for s in server],
        "prefill step (model + engine host)": [s["engine_first"] - s["scheduled"] for s in server],
        "engine token -> front end read it (ZMQ back)": [s["recv"][0] - s["engine_first"] for s in server],
        "output processing (detok, RequestOutput)": [s["handled"][0] - s["recv"][0] for s in server],
        "-> SSE chunk to uvicorn (wake-ups, formatting)": [s["sent"][0] - s["handled"][0] for s in server],
        "uvicorn write -> client has it": [c["chunks"][0] - s["sent"][0] for c, s in zip(client, server)],
        "TTFT (client)": [c["chunks"][0] - c["t0"] for c in client],
    }
    itl_rows: dict[str, list[float]] = {
        "front end gap between outputs (engine step + ZMQ)": [],
        "output processing": [],
        "-> SSE chunk to uvicorn": [],
        "uvicorn write -> client": [],
        "ITL (client)": [],
    }
    for c, s in zip(client, server):
        n = min(len(s["recv"]), len(s["sent"]), len(c["chunks"]))
        for k in range(1, n):
            itl_rows["front end gap between outputs (engine step + ZMQ)"].append(
                s["recv"][k] - s["recv"][k - 1]
            )
            itl_rows["output processing"].append(s["handled"][k] - s["recv"][k])
            itl_rows["-> SSE chunk to uvicorn"].append(s["sent"][k] - s["handled"][k])
            itl_rows["uvicorn write -> client"].append(c["chunks"][k] - s["sent"][k])
            itl_rows["ITL (client)"].append(c["chunks"][k] - c["chunks"][k - 1])
    rows = [("TTFT: " + k, _p50(v)) for k, v in ttft_rows.items()]
    rows += [("ITL: " + k, _p50(v)) for k, v in itl_rows.items()]
    ttft = [c["chunks"][0] - c["t0"] for c in client]
    rows.append(("TTFT max (client)", max(ttft) * 1e3))
    return rows


def _serving(httpx, port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    if sys.argv[1:2] == ["--server"]:  # the child: the trace path, then serve's own arguments
        _server_main(sys.argv[2], sys.argv[3:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmups", type=int, default=3)
    p.add_argument("--input-len", type=int, default=467)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--max-token-id",
        type=int,
        default=4000,
        help="prompt ids are drawn below this (the embedded model has 4,096)",
    )
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--background",
        type=int,
        default=0,
        help="streams kept running beside the timed requests (W6 has about 3)",
    )
    p.add_argument("--background-len", type=int, default=256)
    p.add_argument("--json", default=None, help="write the table here too")
    p.add_argument(
        "--serve-args",
        default="",
        help='more `slipstream serve` flags, one string (e.g. "--load-format dummy")',
    )
    args = p.parse_args()
    trace = tempfile.mktemp(suffix=".json")
    cmd = [
        sys.executable,
        __file__,
        "--server",
        trace,
        "--port",
        str(args.port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--max-model-len",
        "1024",
    ]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.serve_args.split()
    env = {**os.environ, "SLIPSTREAM_DEFAULT_MODEL": os.environ.get("SLIPSTREAM_DEFAULT_MODEL", "embedded")}
    server = subprocess.Popen(cmd, env=env)
    try:
        import httpx

        deadline = time.monotonic() + 900
        while not _serving(httpx, args.port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        client = asyncio.run(_client(args))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    with open(trace) as f:
        server_trace = json.load(f)
    os.unlink(trace)
    rows = _table(client, server_trace)
    print(f"\n{'stage (p50, ms)':<62} {'ms':>8}")
    for name, ms in rows:
        print(f"{name:<62} {ms:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows), f, indent=1)


if __name__ == "__main__":
    main()
