"""One engine process as the front end sees it: the child, its two ZeroMQ sockets and their
private IPC directory.

Each (re)start gets fresh sockets in a fresh directory, so nothing queued for a dead engine can
reach its successor. The directory is named after the front end's pid; a front end killed
before it could remove its own leaves one behind, which the next start removes
(`remove_stale_ipc_dirs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from slipstream.config import EngineConfig
from slipstream.engine.core_proc import config_to_dict, unpack

logger = logging.getLogger("slipstream.engine.engine_proc")

IPC_PREFIX = "slipstream-ipc-"
POLL_MS = 200  # how often start-up checks that the child is still alive


def remove_stale_ipc_dirs(tmp: str | None = None) -> list[Path]:
    """Remove this user's IPC directories whose front end no longer runs; returns them."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"{IPC_PREFIX}*"):
        pid_text = path.name[len(IPC_PREFIX) :].split("-", 1)[0]
        try:
            owner = path.stat().st_uid
        except OSError:
            continue
        if not pid_text.isdigit() or owner != os.getuid() or _pid_alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d IPC directories left by killed servers", len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EngineProcess:
    """Spawned on construction; `wait_ready`, then talk through `to_engine` / `from_engine`."""

    def __init__(self, zmq_ctx: zmq.asyncio.Context, config: EngineConfig) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        self.to_engine = zmq_ctx.socket(zmq.PUSH)
        self.from_engine = zmq_ctx.socket(zmq.PULL)
        self.last_progress = time.monotonic()  # last message from the engine
        self.proc: subprocess.Popen | None = None
        try:
            self._spawn(config)
        except BaseException:
            self.close()
            raise

    def _spawn(self, config: EngineConfig) -> None:
        input_addr = f"ipc://{self.ipc_dir}/in"
        output_addr = f"ipc://{self.ipc_dir}/out"
        self.to_engine.bind(input_addr)
        self.from_engine.bind(output_addr)
        # Own session: a Ctrl-C on the terminal (or a signal to our process group) reaches the
        # front end only, which then shuts the engine down in order.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.engine.core_proc"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        header = {"config": config_to_dict(config), "input_addr": input_addr, "output_addr": output_addr}
        self.proc.stdin.write(json.dumps(header).encode() + b"\n")
        self.proc.stdin.flush()  # stdin stays open: its EOF tells the engine we are gone

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """The engine's first stats once it has loaded; RuntimeError if it fails or is late."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.from_engine.poll(POLL_MS):
                msg = unpack(await self.from_engine.recv())
                if msg["t"] == "ready":
                    self.last_progress = time.monotonic()
                    return msg["stats"]
                if msg["t"] == "fatal":
                    raise RuntimeError(f"engine failed to start: {msg['msg']}")
            elif self.exit_code() is not None:
                raise RuntimeError(
                    f"engine process exited with code {self.exit_code()} during start-up (see its log above)"
                )
        raise RuntimeError(f"engine did not start within {timeout_s:.0f} s")

    async def stop(self, graceful_s: float = 0.0, shutdown_msg: bytes | None = None) -> None:
        """Ask the engine to stop (when `graceful_s` > 0), then terminate or kill it, close the
        sockets and remove the IPC directory."""
        if self.proc is not None and self.proc.poll() is None and graceful_s > 0 and shutdown_msg:
            with contextlib.suppress(zmq.ZMQError):
                await self.to_engine.send(shutdown_msg, zmq.NOBLOCK)
            with contextlib.suppress(subprocess.TimeoutExpired, TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait, graceful_s), graceful_s)
        if self.proc is not None:
            await asyncio.to_thread(stop_process, self.proc, graceful_s > 0)
        self.close()

    def close(self) -> None:
        self.to_engine.close(0)
        self.from_engine.close(0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def stop_process(proc: subprocess.Popen, gentle: bool = True) -> None:
    """Close stdin (the engine exits on EOF), then terminate and kill if it lingers; without
    `gentle`, kill at once (a hung or stopped process answers nothing else)."""
    with contextlib.suppress(Exception):
        proc.stdin.close()
    actions = (None, proc.terminate, proc.kill) if gentle else (proc.kill,)
    for action in actions:
        if action is not None and proc.poll() is None:
            action()
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue
