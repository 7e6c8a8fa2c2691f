"""torch's intra-op thread count on a CPU engine: the physical cores this process may use, less
those other processes keep busy.

An OpenMP team larger than the free cores is the CPU path's worst enemy: every parallel region
(each matmul) waits at its barrier for a thread the OS has parked behind another process, and a
10 ms step becomes hundreds of milliseconds (measured on a 2-core machine with one busy
neighbour: a [32, 576] x [576, 1536] matmul 15x slower on 2 threads than on 1). SMT siblings
share one core's arithmetic units, so they count once.

Precedence: EngineArgs.cpu_threads (`--cpu-threads`), else OMP_NUM_THREADS if set, else a
torch.set_num_threads() the user made before the engine started, else the automatic choice
`max(1, physical cores - round(1-minute load average of other processes) - reserve)`.
The choice is made once per process and logged once.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch

from slipstream import envs

logger = logging.getLogger(__name__)

_chosen: int | None = None  # what we set in this process, once


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _parse_cpu_list(text: str) -> set[int]:
    """"0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def physical_cores(cpus: Iterable[int] | None = None,
                   siblings: Callable[[int], str | None] | None = None) -> int:
    """Cores among the CPUs this process may run on (sched_getaffinity), SMT siblings counted
    once (/sys/devices/system/cpu/cpuN/topology/thread_siblings_list)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            cpus = range(os.cpu_count() or 1)
    cpus = set(cpus)
    if siblings is None:
        def siblings(cpu: int) -> str | None:
            return _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    cores: set[frozenset[int]] = set()
    for cpu in cpus:
        text = siblings(cpu)
        group = _parse_cpu_list(text) & cpus if text else set()
        cores.add(frozenset(group or {cpu}))
    return max(1, len(cores))


def own_cpu_share() -> float:
    """Mean number of CPUs this process kept busy since it started (its part of the load
    average; the rest is other processes'). 0.0 where /proc cannot tell."""
    stat, uptime = _read("/proc/self/stat"), _read("/proc/uptime")
    if not stat or not uptime:
        return 0.0
    try:
        fields = stat.rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        age = float(uptime.split()[0]) - int(fields[19]) / ticks  # now - starttime
    except (IndexError, ValueError, OSError):
        return 0.0
    return cpu / age if age > 1.0 else 0.0


def torch_default_threads() -> set[int]:
    """Counts torch may start with on its own (OpenMP: the CPUs of the affinity mask; some
    builds: the physical cores); any other count was set by the user."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return {cpus, physical_cores()}


def busy_cores(loadavg: Callable[[], tuple[float, float, float]] | None = None,
               own: Callable[[], float] | None = None) -> int:
    """Cores other processes keep busy: the 1-minute load average less this process's own
    share, rounded."""
    try:
        load = (loadavg or os.getloadavg)()[0]
    except OSError:
        return 0
    return max(0, round(load - min((own or own_cpu_share)(), load)))


def auto_threads(reserve: int = 0, *, cores: int | None = None, busy: int | None = None) -> int:
    """The automatic count: free physical cores less `reserve` (a core kept for a front-end
    process), at least 1."""
    cores = physical_cores() if cores is None else cores
    busy = busy_cores() if busy is None else busy
    return max(1, cores - busy - reserve)


def choose_threads(requested: int | None = None, reserve: int = 0) -> tuple[int | None, str]:
    """(thread count to set or None to leave torch's, why)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {requested}")
        return requested, "cpu_threads"
    env = envs.OMP_NUM_THREADS.get()
    if env:
        return None, f"OMP_NUM_THREADS={env}"
    current = torch.get_num_threads()
    if current != _chosen and current not in torch_default_threads():
        return None, "torch.set_num_threads() before start-up"
    cores, busy = physical_cores(), busy_cores()
    n = auto_threads(reserve, cores=cores, busy=busy)
    extra = f", {reserve} kept for the front end" if reserve else ""
    return n, f"{cores} physical cores, {busy} busy with other processes{extra}"


def configure_cpu_threads(requested: int | None = None, reserve: int = 0) -> int:
    """Set torch's intra-op threads for a CPU engine (once per process unless `requested`
    changes it); returns the count in force."""
    global _chosen
    if _chosen is not None and requested in (None, _chosen) \
            and torch.get_num_threads() == _chosen:
        return _chosen
    n, why = choose_threads(requested, reserve)
    if n is None:
        logger.info("CPU engine: torch uses %d threads (%s)", torch.get_num_threads(), why)
        _chosen = torch.get_num_threads()
        return _chosen
    torch.set_num_threads(n)
    _chosen = n
    logger.info("CPU engine: torch uses %d threads (%s; set --cpu-threads or OMP_NUM_THREADS "
                "to choose)", n, why)
    return n


def _reset_for_tests() -> None:
    global _chosen
    _chosen = None


__all__ = ["auto_threads", "busy_cores", "choose_threads", "configure_cpu_threads",
           "own_cpu_share", "physical_cores"]
