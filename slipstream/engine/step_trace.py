"""Per-step trace (SLIPSTREAM_STEP_TRACE=FILE): one JSON line per engine step, no extra syncs.

Each line: wall time of the step, prefill tokens, decode sequences, tokens sampled, decode steps on the
device, running / waiting counts, KV usage and preemptions so far. `summarize` groups the steps
by kind, to see whether time goes to mixed (eager) steps, graph decode or the host.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict

from slipstream import envs


class StepTrace:
    def __init__(self, path: str | None = None):
        path = path if path is not None else envs.STEP_TRACE.get()
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self._last = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, sched_out, runner_out, num_steps: int, stats: dict) -> None:
        """Write one line for the step that just ended (call after its outputs are read)."""
        now = time.perf_counter()
        prefill = sum(s.num_tokens for s in sched_out.seqs if s.num_tokens > 1 or not s.needs_sample)
        decode = sum(1 for s in sched_out.seqs if s.num_tokens == 1 and s.needs_sample)
        sampled = sum(len(t) for t in runner_out.sampled_token_ids.values())
        line = {"dt_ms": round(1e3 * (now - self._last), 3), "prefill_tokens": prefill,
                "decode_seqs": decode, "sampled": sampled, "steps": num_steps,
                "running": stats["num_running"], "waiting": stats["num_waiting"],
                "kv_usage": round(stats["kv_cache_usage"], 4), "preemptions": stats["num_preemptions"]}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._last = now

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def summarize(lines: list[dict]) -> dict[str, dict[str, float]]:
    """{kind: {steps, time_s, tokens, tok_per_s, mean_batch}}; kind = mixed | prefill | decode-kN."""
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in lines:
        if row["prefill_tokens"] and row["decode_seqs"]:
            kind = "mixed"
        elif row["prefill_tokens"]:
            kind = "prefill"
        else:
            kind = f"decode-k{row['steps']}"
        g = groups[kind]
        g["steps"] += 1
        g["time_s"] += row["dt_ms"] / 1e3
        g["tokens"] += row["sampled"]
        g["batch"] += row["decode_seqs"]
    out = {}
    for kind, g in sorted(groups.items()):
        out[kind] = {"steps": int(g["steps"]), "time_s": round(g["time_s"], 3),
                     "output_tokens": int(g["tokens"]),
                     "tok_per_s": round(g["tokens"] / g["time_s"], 1) if g["time_s"] else 0.0,
                     "mean_decode_batch": round(g["batch"] / g["steps"], 1),
                     "mean_step_ms": round(1e3 * g["time_s"] / g["steps"], 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Summarize a SLIPSTREAM_STEP_TRACE file")
    parser.add_argument("trace")
    ns = parser.parse_args(argv)
    with open(ns.trace, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(summarize(lines), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
