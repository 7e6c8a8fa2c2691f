"""Start-up time: a fresh process's time from `LLM(...)` to its first generated token, built
engine against Hugging Face directory, with each start-up phase (docs/build.md).

The Llama-3.1-8B shape with random weights is written once to a local safetensors directory
(16 GB in bf16). Every measured start is a new Python process with an empty Triton cache and an
empty slipstream cache, except "unbuilt, second start", which reuses the caches of the first.
Decode speed after start (batch 1, 128 in / 256 out) is measured in the same processes.

    python benchmarks/startup.py --workdir /tmp/startup [--quantization fp8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_checkpoint(out: Path, shape: str) -> Path:
    """Random weights of `shape` as a Hugging Face safetensors directory (once)."""
    if (out / "config.json").is_file() and list(out.glob("*.safetensors")):
        return out
    from slipstream.bench.shapes import materialize_shape
    from slipstream.engine.args import EngineArgs
    from slipstream.models.loader import load_model
    from slipstream.quantization.checkpoint import checkpoint_tensors, write_safetensors

    materialize_shape(shape, out)
    config = EngineArgs(model=str(out), load_format="dummy", max_model_len=4096)
    model = load_model(config.create_engine_config())
    write_safetensors(checkpoint_tensors(model), out,
                      lambda name, t: t.detach().contiguous().cpu(), 4 << 30)
    return out


def child(ns: argparse.Namespace) -> None:
    """One measured start: LLM(...) -> first token, then a decode run; prints one JSON line."""
    start = time.perf_counter()
    from slipstream import LLM, SamplingParams

    kwargs = json.loads(ns.engine_kwargs)
    llm = LLM(ns.model, **kwargs)
    llm.generate([{"prompt_token_ids": [1] * 16}], SamplingParams(max_tokens=1), use_tqdm=False)
    first_token_s = time.perf_counter() - start
    prompt = {"prompt_token_ids": list(range(100, 228))}
    llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=256, ignore_eos=True), use_tqdm=False)
    m = out[0].metrics
    decode = 255 / (m.finished_time - m.first_token_time) if m and m.first_token_time else None
    print("RESULT " + json.dumps({"first_token_s": first_token_s,
                                  "phases": llm.engine.startup_phases,
                                  "decode_tok_s": decode, "e2e_s": time.perf_counter() - t0}))


def run_child(model: str, kwargs: dict, caches: Path, fresh: bool) -> dict:
    if fresh and caches.exists():
        shutil.rmtree(caches)
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "SLIPSTREAM_CACHE_DIR": str(caches / "slipstream")}
    proc = subprocess.run([sys.executable, __file__, "--child", "--model", model,
                           "--engine-kwargs", json.dumps(kwargs)], env=env, text=True,
                          capture_output=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def build_engine(model: str, out: Path, kwargs: dict, caches: Path) -> float:
    shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "SLIPSTREAM_CACHE_DIR": str(caches / "slipstream")}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "slipstream", "build", "--model", model, "--output",
                    str(out), "--overwrite", *flags], env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=900)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None)
    p.add_argument("--engine-kwargs", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "slipstream-startup"))
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--runs", default="unbuilt,built",
                   help="which starts: unbuilt (first and second), built (build, then a first start)")
    ns = p.parse_args()
    if ns.child:
        child(ns)
        return
    work = Path(ns.workdir)
    t0 = time.perf_counter()
    src = ns.model or str(write_checkpoint(work / ns.shape, ns.shape))
    write_s = time.perf_counter() - t0
    kwargs = {"max_model_len": ns.max_model_len, "max_num_seqs": ns.max_num_seqs}
    if ns.quantization:
        kwargs["quantization"] = ns.quantization
    if ns.kv_cache_dtype:
        kwargs["kv_cache_dtype"] = ns.kv_cache_dtype
    caches = work / "caches"
    rows = {}
    runs = set(ns.runs.split(","))
    if "unbuilt" in runs:
        rows["unbuilt, first start"] = run_child(src, kwargs, caches, fresh=True)
        rows["unbuilt, second start"] = run_child(src, kwargs, caches, fresh=False)
    build_s = None
    if "built" in runs:
        build_s = build_engine(src, work / "engine", kwargs, caches)
        rows["built, first start"] = run_child(str(work / "engine"), {}, caches, fresh=True)
    phases = ("read_weights", "quantize", "tune", "profile_memory", "warm_up", "capture_graphs")
    head = ["start", "to 1st token s", *[ph.replace("_", " ") for ph in phases], "decode tok/s"]
    built = f"build took {build_s:.1f} s" if build_s is not None else "no build"
    print(f"checkpoint written in {write_s:.0f} s; {built} "
          f"({ns.shape}, {ns.quantization or 'bf16'})")
    print(" | ".join(head))
    for name, r in rows.items():
        cells = [name, f"{r['first_token_s']:.1f}", *[f"{r['phases'][ph]:.1f}" for ph in phases],
                 f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"]
        print(" | ".join(cells))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"build_s": build_s, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
