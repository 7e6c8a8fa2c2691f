"""The engine core in its own process: a tight loop of drain inputs, step, send outputs.

Started by AsyncLLM as `python -m slipstream.engine.core_proc`; the first stdin line carries the
config and socket addresses as JSON, and stdin reaching EOF means the parent is gone. All traffic
is msgpack over ZeroMQ (explicit dict encoders below; never pickle).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import typing
from typing import Any

import msgpack
import zmq

from slipstream import envs
from slipstream.config import EngineConfig
from slipstream.engine.request import Request
from slipstream.outputs import EngineCoreOutput
from slipstream.sampling.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from slipstream.sampling_params import SamplingParams

logger = logging.getLogger("slipstream.engine.core_proc")

STATS_INTERVAL_S = 0.1  # publish stats at most this often while busy
IDLE_POLL_MS = 1000


# ----------------------------------------------------------------------------- wire codecs


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    # Logprob dicts are keyed by token id: allow int map keys.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def config_to_dict(config: EngineConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_dict(cls: type, data: dict) -> Any:
    """Rebuild a (nested, frozen) config dataclass from `dataclasses.asdict` output."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(hints[f.name], data[f.name])
    return cls(**kwargs)


def _coerce(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    candidates = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) \
        else (hint,)
    for cand in candidates:
        if dataclasses.is_dataclass(cand) and isinstance(value, dict):
            return config_from_dict(cand, value)
        if (typing.get_origin(cand) or cand) is tuple and isinstance(value, list):
            return tuple(value)
    return value


_UnionType = type(int | None)

_ALWAYS_SENT = ("request_id", "prompt_token_ids", "sampling_params", "arrival_time")
_NEVER_SENT = ("generator",)  # sampler state lives only in the engine


def encode_request(request: Request) -> dict:
    """Init fields of a fresh Request that differ from their defaults (so new fields travel)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Request):
        if f.name in _NEVER_SENT:
            continue
        value = getattr(request, f.name)
        if f.name not in _ALWAYS_SENT and value == _default_of(f):
            continue
        if isinstance(value, SamplingParams):
            value = dataclasses.asdict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def decode_request(data: dict) -> Request:
    data = dict(data)
    data["sampling_params"] = SamplingParams(**data["sampling_params"])
    if "eos_token_ids" in data:
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
    return Request(**data)


def decode_beam_output(data: dict) -> BeamSearchOutput:
    return BeamSearchOutput([BeamSequence(**seq) for seq in data["sequences"]])


_OUTPUT_FIELDS = tuple(f.name for f in dataclasses.fields(EngineCoreOutput))


def encode_output(output: EngineCoreOutput) -> dict:
    # A shallow dict: msgpack encodes it at once (asdict's deep copy cost ~15 us an output).
    return {name: getattr(output, name) for name in _OUTPUT_FIELDS}


def decode_output(data: dict) -> EngineCoreOutput:
    return EngineCoreOutput(**data)


# ----------------------------------------------------------------------------- engine loop


class EngineLoop:
    """Owns the EngineCore and the two sockets; runs until shutdown or a fatal error."""

    def __init__(self, core: Any, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.running = True
        self._stats_dirty = True
        self._stats_wanted = False
        self._last_stats = 0.0
        self.num_aborted = 0  # abort requests received (client gone, stop string matched)
        self.num_iterations = 0
        self.last_step: dict[str, Any] = {}

    def run(self) -> None:
        while self.running:
            busy = self.core.has_unfinished_requests()
            self._drain(block=not busy)
            if self.core.has_unfinished_requests():
                start = time.perf_counter()
                outputs = self.core.step()
                self._record_step(outputs, time.perf_counter() - start)
                self._stats_dirty = True
                if outputs:
                    self.outbox.send(pack({"t": "outputs",
                                           "outs": [encode_output(o) for o in outputs]}))
                self._send_finished_beams()
            self._maybe_send_stats()

    def _record_step(self, outputs: list, seconds: float) -> None:
        """The latest iteration, for stats (the executor's get_latest_iteration_stats)."""
        self.num_iterations += 1
        self.last_step = {"iteration": self.num_iterations, "step_time_s": seconds,
                          "num_requests_with_output": len(outputs),
                          "num_new_tokens": sum(len(o.new_token_ids) for o in outputs)}

    def _send_finished_beams(self) -> None:
        for search_id, tokens in self.core.beams.take_progress().items():
            self.outbox.send(pack({"t": "beam_progress", "id": search_id, "tokens": tokens}))
        for search_id, out in self.core.beams.take_finished().items():
            self.outbox.send(pack({"t": "beam_done", "id": search_id,
                                   "out": dataclasses.asdict(out)}))

    def _add_beam_search(self, msg: dict) -> None:
        try:
            self.core.add_beam_search(msg["id"], list(msg["prompt"]),
                                      BeamSearchParams(**msg["params"]), tuple(msg["eos"]),
                                      msg.get("priority", 0))
        except (ValueError, TypeError) as exc:
            self.outbox.send(pack({"t": "req_error", "id": msg.get("id"), "msg": str(exc)}))

    def _drain(self, block: bool) -> None:
        """Handle every queued message; wait up to IDLE_POLL_MS for the first one when idle."""
        if block and not self.inbox.poll(IDLE_POLL_MS):
            return
        while self.running:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(unpack(raw))

    def _handle(self, msg: dict) -> None:
        kind = msg.get("t")
        if kind == "add":
            for data in msg["reqs"]:
                self._add(data)
        elif kind == "beam":
            self._add_beam_search(msg)
        elif kind == "abort":
            self.core.abort_requests(list(msg["ids"]))
            self.num_aborted += len(msg["ids"])
        elif kind == "stats":
            self._stats_wanted = True
        elif kind == "shutdown":
            self.running = False
        self._stats_dirty = True

    def _add(self, data: dict) -> None:
        try:
            self.core.add_request(decode_request(data))
        except (ValueError, TypeError) as exc:
            # The front end validated already; report instead of dying on a bad request.
            self.outbox.send(pack({"t": "req_error", "id": data.get("request_id"),
                                   "msg": str(exc)}))

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        idle = not self.core.has_unfinished_requests()
        due = self._stats_dirty and (idle or now - self._last_stats >= STATS_INTERVAL_S)
        if self._stats_wanted or due:
            stats = {**self.core.get_stats(), "num_aborted_requests": self.num_aborted,
                     **self.last_step}
            self.outbox.send(pack({"t": "stats", "stats": stats, "reply": self._stats_wanted}))
            self._stats_wanted = False
            self._stats_dirty = False
            self._last_stats = now


def _leave_a_core_for_the_front_end(config: EngineConfig) -> None:
    """On a CPU engine, run torch on the free physical cores but one (runner/cpu_threads.py;
    --cpu-threads or OMP_NUM_THREADS win).

    The front end detokenizes while the engine steps; if torch's OpenMP team spans every core,
    each parallel region waits for a thread the OS has parked behind the front end, and a 10 ms
    step becomes hundreds of milliseconds.
    """
    if not config.device.startswith("cpu"):
        return
    from slipstream.runner.cpu_threads import configure_cpu_threads

    configure_cpu_threads(config.cpu_threads, reserve=1)


def watch_parent() -> None:
    """Exit as soon as stdin closes: the process that started this one died or let it go."""
    def watch() -> None:
        # os.read on the raw fd: a thread blocked inside sys.stdin's buffered reader would hold
        # its lock and make interpreter shutdown abort.
        while os.read(sys.stdin.fileno(), 4096):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> int:
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    outbox.setsockopt(zmq.LINGER, 2000)
    try:
        # Inside the try: a failure to import the engine (torch, Triton) reaches the front end.
        from slipstream.engine.core import EngineCore
        from slipstream.engine.startup import freeze_startup_objects

        _leave_a_core_for_the_front_end(config)
        core = EngineCore(config)
        logger.info("%d start-up objects frozen out of garbage collection",
                    freeze_startup_objects())
        outbox.send(pack({"t": "ready", "stats": core.get_stats()}))
        EngineLoop(core, inbox, outbox).run()
        return 0
    except Exception as exc:  # noqa: BLE001 - report any failure to the front end, then die
        logger.error("engine core failed:\n%s", traceback.format_exc())
        outbox.send(pack({"t": "fatal", "msg": f"{type(exc).__name__}: {exc}"}))
        return 1
    finally:
        inbox.close(0)
        outbox.close()
        ctx.term()


def main() -> None:
    logging.basicConfig(level=envs.LOG_LEVEL.get(),
                        format="%(asctime)s engine %(levelname)s %(message)s")
    # The front end decides when we stop (shutdown message, or stdin EOF when it is gone); a
    # SIGINT/SIGTERM sent to every process (systemd, a terminal) must not cut a step short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    header = json.loads(sys.stdin.buffer.readline())
    config = config_from_dict(EngineConfig, header["config"])
    watch_parent()
    code = run_engine_core(config, header["input_addr"], header["output_addr"])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # sockets are closed; skip the slow teardown of torch and friends


if __name__ == "__main__":
    main()
