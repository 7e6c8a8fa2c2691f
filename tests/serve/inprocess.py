"""uvicorn in a thread of the test process, serving `build_app` over a fake engine with the
hardened protocol: HTTP-layer behaviour (timeouts, caps, the event loop staying free) tested in
a fraction of a second, with no engine process."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from slipstream.outputs import CompletionOutput, RequestOutput
from slipstream.serve.app import build_app
from slipstream.serve.hardening import HttpLimits, hardened_h11
from slipstream.serve.params import ServeLimits
from tests.serve.server import free_port


class HoldingEngine:
    """Answers one token after `hold_s` seconds (asleep on the event loop, as a real engine's
    stream waits)."""

    config = None

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.dead = asyncio.Event()
        self.stats: dict = {}
        self.is_running = True

    def generate(self, prompt, params, request_id, priority=0):
        return self._stream(prompt, request_id)

    async def _stream(self, prompt, request_id):
        await asyncio.sleep(self.hold_s)
        yield RequestOutput(
            request_id,
            None,
            list(prompt),
            [CompletionOutput(0, "k", [108], finish_reason="length")],
            finished=True,
        )

    async def abort(self, request_id: str) -> None:
        pass

    async def get_stats(self, fresh: bool = False, timeout_s: float = 2.0) -> dict:
        return self.stats


class InProcessServer:
    def __init__(self, engine, tokenizer, limits: HttpLimits, max_model_len: int = 64) -> None:
        app = build_app(
            engine, tokenizer, "fake", ServeLimits(max_model_len=max_model_len), http_limits=limits
        )
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            lifespan="off",
            log_level="error",
            http=hardened_h11(limits),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
