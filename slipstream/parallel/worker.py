"""One rank of a distributed engine: a worker process (mp) or a Ray actor running `serve`.

It joins the world process group, then obeys the engine core's messages (msgpack over ZeroMQ):
load a model on a tp x pp layout, size and fill the KV cache, run each step's batch. Every
active rank runs every step (the collectives need them all); the output rank (tensor rank 0 of
the last stage) sends the sampled tokens back, numbered like the step. With pipeline
parallelism several steps (micro-batches) are queued at once, so a stage runs step n + 1 while
the next stage runs n. A heartbeat thread lets the engine tell a hung worker from a slow one;
any exception is reported as an "error" message before the worker exits.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque

import zmq

from slipstream import envs
from slipstream.engine.core_proc import config_from_dict, pack, unpack, watch_parent

logger = logging.getLogger("slipstream.parallel.worker")

HEARTBEAT_S = 1.0
TIMELINE_STEPS = 256


class Worker:
    """The message loop of one rank."""

    def __init__(self, header: dict, commands: zmq.Socket, results: zmq.Socket):
        self.rank, self.header = header["rank"], header
        self.commands, self.results = commands, results
        self.runner = None
        self.decoder = None
        self.is_output_rank = False
        self.last_decode_steps = None  # tokens of the latest multi-step decode, on the device
        # (micro-batch, start, end) of the latest steps, time.monotonic(): shows when stages
        # overlap (a "timeline" message reads it). Host times: on a GPU a stage without the
        # head ends once its work is queued.
        self.timeline: deque[tuple[int, float, float]] = deque(maxlen=TIMELINE_STEPS)

    def run(self) -> None:
        while True:
            msg = unpack(self.commands.recv())
            if msg["t"] == "shutdown":
                return
            reply = self.handle(msg)
            if reply is not None:
                self.results.send(pack({**reply, "rank": self.rank}))

    def handle(self, msg: dict) -> dict | None:
        kind = msg["t"]
        if kind == "step":
            return self.step(msg)
        if kind == "timeline":
            return {"t": "timeline", "steps": list(self.timeline)}
        if kind == "load":
            return self.load(msg)
        if kind == "num_blocks":
            return {"t": "num_blocks", "n": self.runner.determine_num_blocks()}
        if kind == "init_kv":
            self.runner.initialize_kv_cache(msg["n"])
            return {"t": "done"}
        if kind == "warmup":
            self.runner.warmup()
            return {"t": "done"}
        if kind == "capture":
            self.runner.capture_cuda_graphs()
            return {"t": "done", "max_decode_batch": self.runner.max_decode_batch}
        raise ValueError(f"worker: unknown message {kind!r}")

    def step(self, msg: dict) -> dict | None:
        """Run one step (micro-batch). A stage that is not the last returns once it has sent
        its activations on, and takes the next micro-batch while later stages run this one;
        the sends and receives between two stages pair up in the order the steps came."""
        start = time.monotonic()
        sched = self.decoder.decode(msg)
        if msg.get("steps", 1) > 1:
            tokens = self.launch_decode_steps(sched, msg["steps"], msg.get("feed"))
            # Other ranks go on to the next message without waiting for the tokens.
            out = self.runner.collect_decode_steps(sched, tokens) if self.is_output_rank else None
        else:
            out = self.runner.execute_model(sched)
        self.timeline.append((msg["mb"], start, time.monotonic()))
        if not self.is_output_rank:
            return None
        from slipstream.parallel.messages import encode_runner_output

        return encode_runner_output(out, msg["mb"])

    def launch_decode_steps(self, sched, num_steps: int, feed_rows: list[int] | None):
        """The runner's multi-step decode (graphs replayed, each step's token fed in on the
        device); its tokens [num_steps, seqs] on the device. feed_rows: rows of the latest
        multi-step decode's last tokens, which the host has not seen, as the seqs' inputs."""
        feed = None
        if feed_rows is not None:
            if self.last_decode_steps is None:
                raise RuntimeError("a fed multi-step decode came with no decode before it")
            feed = (self.last_decode_steps.on_device[-1], feed_rows)
        self.last_decode_steps = self.runner.launch_decode_steps(sched, num_steps, feed)
        return self.last_decode_steps

    def load(self, msg: dict) -> dict:
        """Drop any model, make the layout's groups (collective over the world), and load this
        rank's shard; ranks the layout leaves out answer "idle"."""
        from slipstream.config import EngineConfig
        from slipstream.parallel import state
        from slipstream.parallel.messages import StepDecoder
        from slipstream.parallel.worker_runner import WorkerRunner
        from slipstream.structured.manager import StructuredOutputManager

        if self.decoder is not None:
            self.decoder.close()
        self.runner = self.decoder = self.last_decode_steps = None
        self.timeline.clear()
        gc.collect()
        info = state.set_layout(msg["tp"], msg["pp"])
        if info is None:
            return {"t": "loaded", "idle": True}
        config = config_from_dict(EngineConfig, msg["config"])
        config = config.replace(device=self.header["device"])
        if info.pp_size > 1 and config.device.startswith("cuda"):
            config = config.replace(enforce_eager=True)  # stages send and receive eagerly
        self.runner = WorkerRunner(config)
        self.runner.load_model()
        self.decoder = StepDecoder(StructuredOutputManager(
            config.tokenizer_path, config.model.vocab_size) if info.is_last_stage else None)
        self.is_output_rank = info.rank == state.output_rank(info.tp_size, info.pp_size)
        return {"t": "loaded", "idle": False, "weight_bytes": self.runner.weight_bytes(),
                "kv_bytes_per_block": self.runner.kv_cache_bytes_per_block()}


def _heartbeat(ctx: zmq.Context, address: str, rank: int) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    beat = pack({"t": "beat", "rank": rank})
    while True:
        sock.send(beat)
        time.sleep(HEARTBEAT_S)


def serve(header: dict) -> int:
    """Run one rank until shutdown; header: rank, world_size, init_method, backend, device,
    cmd_addr, result_addr. Returns the exit code."""
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(header["cmd_addr"])
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(header["result_addr"])
    threading.Thread(target=_heartbeat, args=(ctx, header["result_addr"], header["rank"]),
                     name="heartbeat", daemon=True).start()
    try:
        _init(header)
        results.send(pack({"t": "hello", "rank": header["rank"]}))
        Worker(header, commands, results).run()
        return 0
    except Exception as exc:  # noqa: BLE001 - report any failure to the engine, then die
        logger.error("worker rank %d failed:\n%s", header["rank"], traceback.format_exc())
        results.send(pack({"t": "error", "rank": header["rank"],
                           "msg": f"{type(exc).__name__}: {exc}"}))
        return 1
    finally:
        commands.close(0)
        results.close()


def _init(header: dict) -> None:
    import torch

    from slipstream.parallel import state

    device = header["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    state.init_world(header["rank"], header["world_size"], header["init_method"],
                     header["backend"], envs.WORKER_START_TIMEOUT_S.get())


def main() -> None:
    logging.basicConfig(level=envs.LOG_LEVEL.get(),
                        format="%(asctime)s worker %(levelname)s %(message)s")
    # The engine decides when we stop (shutdown message, stdin EOF): a Ctrl-C sent to the
    # whole process group must not kill a rank in the middle of a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    header = json.loads(sys.stdin.buffer.readline())
    watch_parent()
    code = serve(header)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
