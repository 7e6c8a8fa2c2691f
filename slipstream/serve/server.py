"""The serving process: bind the socket, start the engine process, run uvicorn until told to stop.

The listening socket is bound before the (slow) engine start so a busy port fails at once.
SIGINT/SIGTERM shut down gracefully (exit 0). A dead or hung engine is restarted by AsyncLLM;
past its restart cap the server exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from slipstream.config import EngineConfig
from slipstream.engine.async_llm import AsyncLLM, Supervision
from slipstream.engine.startup import freeze_startup_objects
from slipstream.serve.app import build_app
from slipstream.serve.hardening import HttpLimits, hardened_h11
from slipstream.serve.metrics import ServerMetrics
from slipstream.serve.params import ServeLimits

logger = logging.getLogger("slipstream.serve")


def served_name(model: str | None) -> str:
    """The name clients send for a model: "default" for the default model, else the checkpoint
    directory's name or the GGUF file's stem (never an absolute path: it shows in responses and
    metric labels)."""
    if not model:
        return "default"
    path = Path(model.rstrip("/\\"))
    return path.stem if path.suffix.lower() == ".gguf" else path.name or model


async def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    """Start the engine and the HTTP server; returns the process exit code."""
    http_limits = HttpLimits(header_timeout_s=args.header_timeout,
                             body_timeout_s=args.body_timeout,
                             max_connections=args.max_connections,
                             max_concurrent_requests=args.max_concurrent_requests)
    uv_config = uvicorn.Config(None, host=args.host, port=args.port, log_level=args.log_level,
                               access_log=args.access_log, timeout_graceful_shutdown=5,
                               lifespan="off", http=hardened_h11(http_limits))
    sock = uv_config.bind_socket()  # fail now if the port is taken, not after model load
    model_name = args.served_model_name or served_name(args.model)
    loras = _lora_registry(config, model_name, getattr(args, "lora_modules", None))
    holder: dict = {}
    metrics = ServerMetrics(model_name, lambda: {**holder["engine"].stats,
                                                  **holder["engine"].health_stats()}
                            if holder else {})
    supervision = Supervision(hang_timeout_s=args.engine_hang_timeout or None,
                              max_restarts=args.max_engine_restarts,
                              backoff_s=args.engine_restart_backoff)
    engine = await AsyncLLM.create(config, stat_logger=metrics,
                                   startup_timeout_s=args.engine_startup_timeout,
                                   supervision=supervision)
    holder["engine"] = engine
    tokenizer = engine.tokenizer
    limits = ServeLimits(max_model_len=config.scheduler.max_model_len, max_n=args.max_n,
                         max_logprobs=args.max_logprobs, max_tokens=args.max_tokens_cap,
                         max_prompts=args.max_prompts, max_request_bytes=args.max_request_bytes,
                         vocab_size=config.model.vocab_size,
                         request_timeout_s=args.request_timeout)
    uv_config.app = build_app(engine, tokenizer, model_name, limits, args.api_key, metrics,
                              http_limits, tool_call_parser=args.tool_call_parser, loras=loras)
    freeze_startup_objects()  # no full collection over the start-up objects mid-stream
    server = _Server(uv_config)
    watchdog = asyncio.create_task(_stop_when_engine_dies(engine, server))
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        died = engine.dead.is_set()
        await engine.shutdown()
    if died:
        logger.error("exiting because the engine died: %s", engine.dead_reason)
        return 1
    return 0


def _lora_registry(config: EngineConfig, model_name: str, modules: list[str] | None):
    """The served adapters (--lora-modules), each checked before the engine starts."""
    from slipstream.serve.lora import LoRARegistry, parse_lora_modules

    pairs = parse_lora_modules(modules)
    if not config.lora.enabled:
        if pairs:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    registry = LoRARegistry(config, model_name)
    for name, path in pairs:
        registry.add(name, path)
    return registry


async def _stop_when_engine_dies(engine, server) -> None:
    await engine.dead.wait()
    logger.error("engine is down for good (%s): shutting down", engine.dead_reason)
    await asyncio.sleep(1.0)  # let in-flight handlers write their errors; /health says 503
    server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn.Server whose signal handling ends serve() without re-raising the signal."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self._request_exit, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def _request_exit(self, sig: int) -> None:
        logger.info("received %s: shutting down", signal.Signals(sig).name)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
        self.should_exit = True
