"""Benchmark reports: latency statistics, run metadata, the JSON file and the printed table.

The table is printed last because a GPU run's reply carries only the tail of its output.
`python -m slipstream.bench.report DIR` prints one summary table over every JSON in DIR.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from slipstream import envs

# Every field BENCHMARKS.md asks a throughput run to record (tests check these).
THROUGHPUT_FIELDS = (
    "mode", "workload", "model", "dtype", "quantization", "engine", "dataset", "num_requests",
    "total_input_tokens", "total_output_tokens", "wall_time_s", "output_tok_s", "total_tok_s",
    "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "peak_gpu_memory_gib", "kv_cache", "baseline",
    "ratio_vs_baseline", "meta",
)
LATENCY_FIELDS = (
    "mode", "workload", "model", "dtype", "quantization", "engine", "batch_size", "input_len",
    "output_len", "num_iters", "decode_tok_s", "ttft_ms", "e2e_ms", "copy_bandwidth_gbps",
    "sol_bound_tok_s", "sol_pct", "startup_s", "peak_gpu_memory_gib", "meta",
)
ENGINE_FIELDS = ("max_num_tokens", "max_batch_size", "max_model_len", "block_size", "cuda_graphs")
META_FIELDS = ("git_commit", "source_digest", "gpu", "date", "torch", "transformers")


def summarize(values_s: list[float | None]) -> dict[str, float | None]:
    """Seconds -> {mean, median, p99} in milliseconds (None where nothing was measured)."""
    vals = np.asarray([v for v in values_s if v is not None], dtype=np.float64) * 1e3
    if vals.size == 0:
        return {"mean": None, "median": None, "p99": None, "count": 0}
    return {
        "mean": float(vals.mean()),
        "median": float(np.median(vals)),
        "p99": float(np.percentile(vals, 99)),
        "count": int(vals.size),
    }


def _git_commit(repo: Path) -> tuple[str, bool | None]:
    env_commit = envs.COMMIT.get()
    if env_commit:
        return env_commit, None
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo, capture_output=True, text=True, timeout=10).stdout
        return sha, bool(dirty.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def source_digest(package_dir: Path) -> str:
    """sha256 over the package's .py files: names the code that ran even without a .git."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        h.update(str(path.relative_to(package_dir)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def run_meta() -> dict[str, Any]:
    """Git commit, code digest, GPU name, date and library versions of this run."""
    import torch

    package_dir = Path(__file__).resolve().parents[1]
    commit, dirty = _git_commit(package_dir.parent)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "source_digest": source_digest(package_dir),
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": sys.version.split()[0],
        "argv": sys.argv[1:],
    }


def write_json(result: dict[str, Any], path: str | Path | None) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")


def format_value(value: Any) -> str:
    """A number as the tables print it ("-" for None)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def format_table(rows: list[tuple[str, Any]], title: str) -> str:
    """Two-column table: metric | value."""
    width = max([len(k) for k, _ in rows] + [len(title)])
    lines = [f"== {title} ==", "-" * (width + 24)]
    lines += [f"{k:<{width}}  {format_value(v)}" for k, v in rows]
    lines.append("-" * (width + 24))
    return "\n".join(lines)


def _stat_rows(name: str, stats: dict[str, Any] | None) -> list[tuple[str, Any]]:
    stats = stats or {}
    return [(f"{name} mean / median / p99 (ms)",
             " / ".join(format_value(stats.get(k)) for k in ("mean", "median", "p99")))]


def throughput_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    eng, kv, base = r["engine"], r.get("kv_cache") or {}, r.get("baseline") or {}
    steps = r.get("steps") or {}
    util = kv.get("utilization")
    rows: list[tuple[str, Any]] = [
        ("workload", r["workload"]), ("model / dtype", f"{r['model']['shape']} / {r['dtype']}"),
        ("max batch / max tokens / block / graphs",
         f"{eng['max_batch_size']} / {eng['max_num_tokens']} / {eng['block_size']} / "
         f"{'on' if eng['cuda_graphs'] else 'off'}"),
        *([("CPU threads", eng["cpu_threads"])] if eng.get("cpu_threads") else []),
        ("requests", r["num_requests"]),
        ("input / output tokens", f"{r['total_input_tokens']} / {r['total_output_tokens']}"),
        ("wall time (s)", r["wall_time_s"]),
        ("output tok/s", r["output_tok_s"]), ("total tok/s", r["total_tok_s"]),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        rows += _stat_rows(name.upper(), r.get(f"{name}_ms"))
    for name, stats in (r.get("ttft_parts_ms") or {}).items():
        if stats.get("count"):
            rows += _stat_rows(f"TTFT part: {name.replace('_', ' ')}", stats)
    rows += [("peak GPU memory (GiB)", r.get("peak_gpu_memory_gib")),
             ("KV blocks (total / peak used / util)",
              f"{format_value(kv.get('num_blocks'))} / {format_value(kv.get('peak_used_blocks'))} / "
              f"{'-' if util is None else f'{100 * util:.1f}%'}"),
             ("engine steps / peak running batch",
              f"{format_value(steps.get('num_steps'))} / {format_value(steps.get('peak_running'))}")]
    if base:
        rows += [(f"baseline {base['name']} (batch {base['batch_size']}, "
                  f"{base['num_requests']} req) tok/s", base["output_tok_s"]),
                 ("ratio vs baseline", r.get("ratio_vs_baseline"))]
    return rows


def latency_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    eng = r["engine"]
    return [
        ("workload", r["workload"]), ("model / dtype", f"{r['model']['shape']} / {r['dtype']}"),
        ("batch / in / out", f"{r['batch_size']} / {r['input_len']} / {r['output_len']}"),
        ("cuda graphs", "on" if eng["cuda_graphs"] else "off"),
        *([("CPU threads", eng["cpu_threads"])] if eng.get("cpu_threads") else []),
        ("iterations", r["num_iters"]),
        *_stat_rows("TTFT", r.get("ttft_ms")),
        *_stat_rows("E2E", r.get("e2e_ms")),
        ("copy bandwidth (GB/s, r+w)", r.get("copy_bandwidth_gbps")),
        ("speed-of-light bound (tok/s)", r.get("sol_bound_tok_s")),
        ("decode tok/s (median)", (r.get("decode_tok_s") or {}).get("median")),
        ("% of speed of light", r.get("sol_pct")),
        ("start-up s (LLM(...))", (r.get("startup_s") or {}).get("llm_init")),
    ]


def speculative_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    """Rows of a run with --speculative-config: the rate without it (same run) and the gain."""
    spec = r.get("speculative")
    if not spec:
        return []
    return [("speculation", f"{spec['config']['method']} k={spec['config']['num_speculative_tokens']}"),
            ("tok/s without speculation", spec["baseline_tok_s"]),
            ("speed-up", spec["speedup"]), ("acceptance rate", spec["acceptance_rate"]),
            ("mean accepted length", spec["mean_accepted_length"])]


def print_result(r: dict[str, Any]) -> None:
    rows = throughput_rows(r) if r["mode"] == "throughput" else latency_rows(r)
    rows = rows + speculative_rows(r)
    print(format_table(rows, f"slipstream bench {r['mode']}"), flush=True)


def _median(r: dict[str, Any], key: str) -> str:
    return format_value((r.get(key) or {}).get("median"))


def summary_line(r: dict[str, Any]) -> list[str]:
    """workload, shape, requests, out tok/s, total tok/s, HF tok/s, vs HF/bound, TTFT, TPOT."""
    if r.get("mode") == "latency":
        pct = r.get("sol_pct")
        return [r["workload"], r["model"]["shape"], f"b{r['batch_size']}",
                _median(r, "decode_tok_s"), "-", "-",
                "-" if pct is None else f"{pct:.1f}% of SoL", _median(r, "ttft_ms"), "-"]
    ratio, base = r.get("ratio_vs_baseline"), r.get("baseline") or {}
    return [r["workload"], r["model"]["shape"], str(r.get("num_requests")),
            format_value(r.get("output_tok_s")), format_value(r.get("total_tok_s")),
            format_value(base.get("output_tok_s")), "-" if ratio is None else f"{ratio:.2f}x HF",
            _median(r, "ttft_ms"), _median(r, "tpot_ms")]


SUMMARY_HEADER = ["workload", "shape", "requests", "out tok/s", "total tok/s", "HF tok/s",
                  "vs HF / bound", "TTFT p50 ms", "TPOT p50 ms"]


def print_summary(results_dir: str | Path) -> int:
    """One line per JSON result in `results_dir` (sorted by name)."""
    header = SUMMARY_HEADER
    lines = [header]
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            lines.append(summary_line(json.loads(path.read_text())))
        except (KeyError, TypeError, ValueError) as exc:
            lines.append([path.stem, f"unreadable: {exc!r}"] + [""] * (len(header) - 2))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    print("== slipstream GPU suite summary ==")
    for row in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(print_summary(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))
