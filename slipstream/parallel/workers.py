"""A pool of worker ranks and the sockets to them: the engine core's side of the transport.

The core binds one PUSH socket per rank (commands) and one PULL socket for everything the ranks
send back (replies, heartbeats, errors); all msgpack. `wait` is the only place the core blocks
on the workers, and it fails fast: a worker that exits (or whose Ray actor dies) is reported at
once, one silent for SLIPSTREAM_WORKER_TIMEOUT_S seconds (no heartbeat) as hung, and the pool
is torn down either way, so no caller waits forever on a collective that cannot finish.

`MpWorkerPool` starts the ranks as local processes (`python -m slipstream.parallel.worker`,
the header on stdin, like the engine core process); ray_workers.py starts them as Ray actors.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import zmq

from slipstream import envs
from slipstream.engine.core_proc import pack, unpack

logger = logging.getLogger(__name__)

POLL_MS = 100


class WorkerError(RuntimeError):
    """A worker rank failed, exited or hung; the distributed engine cannot go on."""


class WorkerPool:
    """world_size ranks and their sockets. Subclasses start the ranks (`_launch`) and tell
    whether one has died (`_dead_worker`)."""

    def __init__(self, world_size: int, device: str, host: str | None = None):
        self.world_size, self.device = world_size, device
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.ctx = zmq.Context()
        self._tmp = None if host else tempfile.TemporaryDirectory(prefix="slipstream-workers-")
        self.results = self.ctx.socket(zmq.PULL)
        self.result_addr = self._bind(self.results, host, "results")
        self.commands, self.cmd_addrs = [], []
        for rank in range(world_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            self.cmd_addrs.append(self._bind(sock, host, f"cmd-{rank}"))
            self.commands.append(sock)
        self.init_method = f"tcp://{host or '127.0.0.1'}:{_free_port()}"
        self.closed = self.started = False
        self.failure: str | None = None
        self._last_beat = [time.monotonic()] * world_size

    def _bind(self, sock: zmq.Socket, host: str | None, name: str) -> str:
        if host is None:  # one machine: Unix sockets in a private directory
            address = f"ipc://{self._tmp.name}/{name}"
            sock.bind(address)
            return address
        port = sock.bind_to_random_port("tcp://*")
        return f"tcp://{host}:{port}"

    def header(self, rank: int, device: str) -> dict:
        return {"rank": rank, "world_size": self.world_size, "init_method": self.init_method,
                "backend": self.backend, "device": device, "cmd_addr": self.cmd_addrs[rank],
                "result_addr": self.result_addr}

    def start(self) -> None:
        """Launch the ranks and wait until every one has joined the process group."""
        self.launch()
        self.wait_started()

    def launch(self) -> None:
        """Start the ranks without waiting for them (wait_started does)."""
        self._launch()

    def wait_started(self) -> None:
        if not self.started:
            self.wait("hello", range(self.world_size), envs.WORKER_START_TIMEOUT_S.get())
            self.started = True

    # ---- subclasses ----------------------------------------------------------------------
    def _launch(self) -> None:
        raise NotImplementedError

    def _dead_workers(self) -> dict[int, str]:
        """{rank: description} of the ranks that have exited."""
        raise NotImplementedError

    def _dead_worker(self, errored: int | None = None) -> str | None:
        """A rank that has exited, preferring one other than `errored` (which failed in a
        collective because a peer died), or None."""
        dead = self._dead_workers()
        others = [d for r, d in dead.items() if r != errored]
        return (others or list(dead.values()) or [None])[0]

    def _stop_workers(self) -> None:
        raise NotImplementedError

    # ---- messages ------------------------------------------------------------------------
    def send(self, ranks: Iterable[int], msg: dict) -> None:
        self._check_usable()
        data = pack(msg)
        for rank in ranks:
            self.commands[rank].send(data)

    def wait(self, kind: str, ranks: Iterable[int], timeout_s: float | None = None
             ) -> dict[int, dict]:
        """The `kind` reply of each rank in `ranks`. WorkerError (and the pool torn down) when
        a rank reports an error, exits, stops sending heartbeats, or timeout_s passes."""
        self._check_usable()
        pending, replies = set(ranks), {}
        self._wait_start = time.monotonic()
        deadline = None if timeout_s is None else self._wait_start + timeout_s
        while pending:
            if self.results.poll(POLL_MS):
                # Stop once answered: a later reply (the next micro-batch's) stays queued.
                while pending and self.results.poll(0):
                    self._take(unpack(self.results.recv()), kind, pending, replies)
                continue
            problem = self._dead_worker() or self._silent_worker(kind)
            if problem is None and deadline is not None and time.monotonic() > deadline:
                problem = (f"no {kind!r} reply from worker rank(s) {sorted(pending)} within "
                           f"{timeout_s:g} s")
            if problem is not None:
                self.fail(problem)
        return replies

    def _take(self, msg: dict, kind: str, pending: set[int], replies: dict[int, dict]) -> None:
        rank, t = msg.get("rank", -1), msg.get("t")
        if 0 <= rank < self.world_size:
            self._last_beat[rank] = time.monotonic()
        if t == "error":
            # A rank whose peer died fails in its collective: name the dead one first.
            time.sleep(0.2)
            dead = self._dead_worker(errored=rank)
            reported = f"worker rank {rank} failed: {msg.get('msg')}"
            self.fail(f"{dead} ({reported})" if dead else reported)
        if t == kind and rank in pending:
            pending.discard(rank)
            replies[rank] = msg

    def _silent_worker(self, kind: str) -> str | None:
        if kind == "hello":  # still starting: imports and process-group set-up
            return None
        limit = envs.WORKER_TIMEOUT_S.get()
        now = time.monotonic()
        for rank, last in enumerate(self._last_beat):
            # Beats queue up while nobody waits: count silence from the start of this wait.
            last = max(last, self._wait_start)
            if now - last > limit:
                return (f"worker rank {rank} sent no heartbeat for {now - last:.1f} s "
                        f"(SLIPSTREAM_WORKER_TIMEOUT_S={limit:g}): hung or stopped")
        return None

    def fail(self, problem: str) -> None:
        """Record the failure, stop every rank, raise WorkerError."""
        self.failure = problem
        logger.error("distributed engine: %s; stopping all workers", problem)
        self.close()
        raise WorkerError(problem)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise WorkerError(f"the distributed engine failed earlier: {self.failure}")
        if self.closed:
            raise WorkerError("the worker pool is shut down")

    def close(self) -> None:
        """Ask the ranks to exit, stop those that do not, release the sockets. Idempotent."""
        if self.closed:
            return
        self.closed = True
        data = pack({"t": "shutdown"})
        for sock in self.commands:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._stop_workers()
        for sock in [*self.commands, self.results]:
            sock.close(0)
        self.ctx.term()
        if self._tmp is not None:
            self._tmp.cleanup()


class MpWorkerPool(WorkerPool):
    """Ranks as child processes of this one, rank r on GPU r (or on the CPU, with gloo)."""

    launcher = "mp"

    def _launch(self) -> None:
        self.procs = []
        for rank in range(self.world_size):
            device = f"cuda:{rank}" if self.backend == "nccl" else "cpu"
            proc = subprocess.Popen([sys.executable, "-m", "slipstream.parallel.worker"],
                                    stdin=subprocess.PIPE, env=_worker_env(self.world_size))
            proc.stdin.write(json.dumps(self.header(rank, device)).encode() + b"\n")
            proc.stdin.flush()  # stdin stays open: its EOF tells the worker we are gone
            self.procs.append(proc)
        atexit.register(self.close)

    def _dead_workers(self) -> dict[int, str]:
        dead = [(rank, proc.poll()) for rank, proc in enumerate(self.procs)
                if proc.poll() is not None]
        # A rank killed by a signal first: its peers then exit on their own failed collective.
        dead.sort(key=lambda rank_code: rank_code[1] >= 0)
        return {rank: f"worker rank {rank} (pid {self.procs[rank].pid}) exited with code {code}"
                for rank, code in dead}

    def _stop_workers(self) -> None:
        procs = getattr(self, "procs", [])
        deadline = time.monotonic() + 2.0
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


def _worker_env(world_size: int) -> dict[str, str]:
    """The worker's environment: on a CPU, the cores shared out between the ranks."""
    env = dict(os.environ)
    if envs.OMP_NUM_THREADS.name not in env:
        env[envs.OMP_NUM_THREADS.name] = str(max(1, (os.cpu_count() or 1) // world_size))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- pools kept between engines (tests: one set of processes for many models) ------------

_IDLE: list[WorkerPool] = []
_KEEP = [False]


def acquire_pool(world_size: int, device: str, backend: str) -> WorkerPool:
    """A started pool of at least world_size ranks: a kept idle one, or a new one."""
    for pool in list(_IDLE):
        if pool.closed or pool._dead_worker() is not None:
            _IDLE.remove(pool)
            pool.close()
        elif pool.world_size >= world_size and pool.device == device \
                and pool.launcher == backend:
            _IDLE.remove(pool)
            pool.wait_started()
            return pool
    pool = new_pool(world_size, device, backend)
    pool.start()
    return pool


def new_pool(world_size: int, device: str, backend: str) -> WorkerPool:
    if backend == "ray":
        from slipstream.parallel.ray_workers import RayWorkerPool

        return RayWorkerPool(world_size, device)
    if backend != "mp":
        raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
    return MpWorkerPool(world_size, device)


def keep(pool: WorkerPool) -> None:
    """Offer a pool (started or only launched) to the next engine, inside keep_pools."""
    _IDLE.append(pool)


def release_pool(pool: WorkerPool) -> None:
    """Done with a pool: keep it for the next engine (inside keep_pools) or close it."""
    if _KEEP[0] and not pool.closed and pool.failure is None:
        _IDLE.append(pool)
    else:
        pool.close()


class keep_pools:  # noqa: N801 - used as a context manager, like a function
    """Within it, engines hand their worker pool back for reuse instead of closing it: worker
    processes (and their process group) start once for many engines. Closes them at exit."""

    def __enter__(self):
        _KEEP[0] = True
        return self

    def __exit__(self, *exc) -> None:
        _KEEP[0] = False
        while _IDLE:
            _IDLE.pop().close()
