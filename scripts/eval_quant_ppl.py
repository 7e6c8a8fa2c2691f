"""Accuracy of each quantization method on a real model: perplexity and greedy agreement.

    python scripts/eval_quant_ppl.py                       # the default model (SmolLM2 GGUF)
    python scripts/eval_quant_ppl.py --model DIR_OR_GGUF --methods none,fp8,fp8_keep
    python scripts/eval_quant_ppl.py --output-json PATH --fp8-keep-float 24

Two columns per method, through slipstream's CPU reference path in float32:
- perplexity over named text sets read from files every CPython install holds (TEXT_SETS:
  Python source from the standard library; English prose: Python's LICENSE.txt and the language
  reference's text in pydoc_data), in non-overlapping windows of --seq-len tokens;
- greedy agreement with the unquantized model: 64 prompts (32-token slices of the same texts)
  continued greedily for 64 tokens; the share of tokens before the first difference, and of
  prompts whose 64 tokens are all the same.
Rows that need a checkpoint run `slipstream quantize` first (GGUF sources included); a row that
fails is reported with its error and the others go on.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "benchmarks" / "results" / "2026-12-06-cpu" / "quant_accuracy_smollm2.json"
STDLIB = Path(os.__file__).parent
# Named text sets: (description, files relative to the stdlib, pydoc topics).
TEXT_SETS = {
    "python": ("Python source: CPython standard library modules",
               ("textwrap.py", "bisect.py", "shlex.py", "json/decoder.py", "fractions.py",
                "heapq.py"), ()),
    "prose": ("English prose: Python's LICENSE.txt and language-reference topics "
              "(pydoc_data.topics)",
              ("LICENSE.txt",), ("execmodel", "exceptions", "import", "naming")),
}
# Issue 51's targets: relative perplexity increase allowed per row.
TARGETS = {"int8_wo": 1.0, "fp8": 1.0, "fp8_keep": 1.0, "w8a8_sq": 2.0, "int4_awq": 5.0,
           "int4_gptq": 5.0}
# name -> LLM(quantization=...), checkpoint kind ("source": the model as given), kv_cache_dtype
ROWS = {
    "none": (None, "source", "auto"),
    "int8_wo": ("int8_wo", "source", "auto"),
    "fp8": ("fp8", "source", "auto"),  # at load: every projection in FP8
    "fp8_keep": (None, "fp8_keep", "auto"),  # `quantize --method fp8 --keep-float N`
    "w8a8_rtn": ("w8a8_sq", "source", "auto"),  # at load: plain per-channel W8A8, no smoothing
    "w8a8_sq": (None, "sq", "auto"),  # `quantize --method w8a8_sq` (calibrated)
    "int4_rtn": (None, "int4_rtn", "auto"),  # `quantize --method int4_awq --no-awq`
    "int4_awq": (None, "int4_awq", "auto"),  # `quantize --method int4_awq --no-gptq`
    "int4_gptq": (None, "int4_gptq", "auto"),  # `quantize --method int4_awq` (GPTQ, the default)
    "kv_fp8": (None, "source", "fp8"),
    "kv_int8": (None, "source", "int8"),
}
DEFAULT_ROWS = ("none", "int8_wo", "fp8", "fp8_keep", "w8a8_rtn", "w8a8_sq", "int4_rtn",
                "int4_awq", "int4_gptq", "kv_fp8", "kv_int8")
# checkpoint kind -> `slipstream quantize` arguments (after the calibration ones)
QUANTIZE_ARGS = {
    "fp8_keep": lambda a: ["--method", "fp8", "--keep-float", str(a.fp8_keep_float)],
    "sq": lambda a: ["--method", "w8a8_sq", "--alpha", str(a.alpha)],
    "int4_rtn": lambda a: ["--method", "int4_awq", "--no-awq", "--no-gptq", "--group-size",
                           str(a.group_size)],
    "int4_awq": lambda a: ["--method", "int4_awq", "--no-gptq", "--group-size", str(a.group_size)],
    "int4_gptq": lambda a: ["--method", "int4_awq", "--group-size", str(a.group_size)],
}


def default_model() -> str:
    from slipstream.assets.smollm2 import default_model as find

    return str(find())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint directory or GGUF file (default: the default model)")
    p.add_argument("--methods", default=",".join(DEFAULT_ROWS), help=f"subset of {','.join(ROWS)}")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--windows-per-set", type=int, default=6)
    p.add_argument("--prompts", type=int, default=64, help="greedy-agreement prompts")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--fp8-keep-float", type=int, default=24,
                   help="fp8_keep row: projections kept in 16 bits (`quantize --keep-float`)")
    p.add_argument("--alpha", type=float, default=0.5, help="w8a8_sq: SmoothQuant migration")
    p.add_argument("--group-size", type=int, default=64, help="int4 rows")
    p.add_argument("--calib-samples", type=int, default=32,
                   help="calibration texts for the quantize runs (the built-in set)")
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--output-json", default=str(DEFAULT_JSON))
    return p


# --- texts ----------------------------------------------------------------------------------------

def text_set(name: str) -> list[str]:
    """The texts of a named set, in a fixed order."""
    _, files, topics = TEXT_SETS[name]
    texts = [(STDLIB / f).read_text(encoding="utf-8") for f in files]
    if topics:
        from pydoc_data.topics import topics as pydoc_topics

        texts += [pydoc_topics[t] for t in topics]
    return texts


def windows(ids_per_text: list[list[int]], seq_len: int, count: int) -> list[list[int]]:
    """Up to `count` non-overlapping windows of seq_len + 1 ids, taken round-robin over the texts
    so that every text is represented."""
    per_text = [[ids[i:i + seq_len + 1] for i in range(0, len(ids) - seq_len, seq_len)]
                for ids in ids_per_text]
    out: list[list[int]] = []
    for rank in range(max(map(len, per_text), default=0)):
        out += [w[rank] for w in per_text if rank < len(w)]
    return out[:count]


def agreement_prompts(ids_per_text: list[list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` ids, evenly spaced over all the texts' tokens."""
    ids = [t for text in ids_per_text for t in text]
    step = max(1, (len(ids) - length) // count)
    return [ids[i * step:i * step + length] for i in range(count)]


def greedy_agreement(reference: list[list[int]], got: list[list[int]]) -> dict:
    """prefix: share of reference tokens produced before the first difference (position by
    position after a difference compares different contexts, so it is not counted);
    identical: share of sequences equal throughout."""
    if len(reference) != len(got) or not reference:
        raise ValueError("greedy_agreement needs the same, non-zero number of sequences")
    matched = total = same = 0
    for want, have in zip(reference, got, strict=True):
        n = 0
        while n < len(want) and n < len(have) and want[n] == have[n]:
            n += 1
        matched += n
        total += len(want)
        same += n == len(want) == len(have)
    return {"prefix": matched / total, "identical": same / len(reference)}


# --- one row --------------------------------------------------------------------------------------

def evaluate(model: str, quantization: str | None, kv_cache_dtype: str,
             ppl_windows: dict[str, list[list[int]]], prompts: list[list[int]],
             new_tokens: int) -> tuple[dict[str, float], list[list[int]]]:
    """Perplexity per text set and the greedy continuations of `prompts`, through slipstream."""
    from slipstream import LLM, SamplingParams

    llm = LLM(model=model, device="cpu", dtype="float32", quantization=quantization,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    ppl = {}
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for name, wins in ppl_windows.items():
        outs = llm.generate([{"prompt_token_ids": w} for w in wins], score, use_tqdm=False)
        nll = count = 0
        for w, out in zip(wins, outs, strict=True):
            for token, entry in zip(w[1:], out.prompt_logprobs[1:], strict=True):
                nll -= entry[token]
                count += 1
        ppl[name] = (nll, count)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    del llm
    gc.collect()
    nll_all = sum(n for n, _ in ppl.values())
    count_all = sum(c for _, c in ppl.values())
    result = {name: math.exp(n / c) for name, (n, c) in ppl.items()}
    result["all"] = math.exp(nll_all / count_all)
    return result, [list(o.outputs[0].token_ids) for o in outs]


def run_row(name: str, ckpts: dict[str, str | Exception], data: dict, reference: list | None,
            new_tokens: int) -> dict:
    quantization, kind, kv = ROWS[name]
    t0 = time.perf_counter()
    row: dict = {"method": name, "quantization": quantization, "kv_cache_dtype": kv}
    try:
        path = ckpts[kind]
        if isinstance(path, Exception):
            raise path
        ppl, tokens = evaluate(path, quantization, kv, data["windows"], data["prompts"],
                               new_tokens)
    except Exception as exc:  # report the failure as a row, keep measuring the others
        row.update(error=f"{type(exc).__name__}: {str(exc)[-600:]}")
    else:
        row.update(ppl=ppl["all"], ppl_by_set=ppl, tokens=tokens)
        if reference is not None:
            row["agreement"] = greedy_agreement(reference, tokens)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def quantize(model: str, kind: str, out_dir: str, args) -> dict:
    """`slipstream quantize` as a user runs it; its wall time and log tail."""
    cmd = [sys.executable, "-m", "slipstream", "quantize", "--model", model, "--output", out_dir,
           "--num-calib-samples", str(args.calib_samples), "--max-calib-len",
           str(args.calib_len), *QUANTIZE_ARGS[kind](args)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    info = {"command": " ".join(["slipstream", *cmd[3:]]), "returncode": proc.returncode,
            "seconds": round(time.perf_counter() - t0, 1)}
    if proc.returncode != 0:
        raise RuntimeError(f"quantize failed ({proc.returncode}): "
                           f"{(proc.stdout + proc.stderr)[-1500:]}")
    return info


def prepare_checkpoints(args, model: str, names: list[str], tmp: Path, result: dict
                        ) -> dict[str, str | Exception]:
    ckpts: dict[str, str | Exception] = {"source": model}
    for kind in dict.fromkeys(ROWS[n][1] for n in names):
        if kind == "source":
            continue
        try:
            result.setdefault("quantize", {})[kind] = quantize(model, kind, str(tmp / kind), args)
            ckpts[kind] = str(tmp / kind)
            if kind == "fp8_keep":
                config = json.loads((tmp / kind / "config.json").read_text())
                result["fp8_ignored_layers"] = config["quantization_config"].get(
                    "ignored_layers", [])
        except Exception as exc:
            ckpts[kind] = exc
        print(f"quantize {kind}: {'failed' if isinstance(ckpts[kind], Exception) else 'done'}",
              flush=True)
    return ckpts


def judge(rows: dict[str, dict]) -> None:
    """delta % vs the unquantized row and the target verdict, in place."""
    base = rows.get("none", {}).get("ppl")
    for name, row in rows.items():
        if base is None or "ppl" not in row:
            continue
        row["delta_pct"] = 100.0 * (row["ppl"] / base - 1.0)
        if name in TARGETS:
            row["target"] = f"<= +{TARGETS[name]:g}%"
            row["meets_target"] = row["delta_pct"] <= TARGETS[name]
    rtn, awq = (rows.get(n, {}).get("ppl") for n in ("int4_rtn", "int4_awq"))
    if rtn is not None and awq is not None:
        rows["int4_awq"]["beats_rtn"] = awq < rtn


def print_table(rows: dict[str, dict], sets: list[str]) -> None:
    head = "".join(f"{s:>9}" for s in sets)
    print(f"\n{'method':<10} {'ppl':>9} {'delta %':>8}{head} {'agree':>7} {'same':>6} {'s':>6}")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<10} FAILED: {row['error'][:200]}")
            continue
        delta = f"{row['delta_pct']:+.2f}" if "delta_pct" in row else "-"
        by_set = "".join(f"{row['ppl_by_set'][s]:>9.3f}" for s in sets)
        agree = row.get("agreement", {})
        print(f"{name:<10} {row['ppl']:>9.3f} {delta:>8}{by_set} "
              f"{agree.get('prefix', 1.0):>7.3f} {agree.get('identical', 1.0):>6.3f} "
              f"{row['seconds']:>6.1f}")


def load_data(model: str, args) -> dict:
    from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

    tok = maybe_load_tokenizer(model)
    if tok is None:
        raise SystemExit(f"{model} has no tokenizer: the text sets need one")
    ids = {name: [tok.encode(t) for t in text_set(name)] for name in TEXT_SETS}
    wins = {name: windows(ids[name], args.seq_len, args.windows_per_set) for name in TEXT_SETS}
    per_set = args.prompts // len(TEXT_SETS)
    prompts = [p for i, name in enumerate(TEXT_SETS) for p in agreement_prompts(
        ids[name], per_set + (args.prompts % len(TEXT_SETS) if i == 0 else 0), args.prompt_len)]
    return {"windows": wins, "prompts": prompts}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(names) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {list(ROWS)}")
    if "none" in names:  # the reference of the agreement column runs first
        names.remove("none")
        names.insert(0, "none")
    model = args.model or default_model()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = load_data(model, args)
    result: dict = {
        "model": str(model), "device": "cpu", "dtype": "float32", "torch": torch.__version__,
        "text_sets": {n: {"description": d, "files": list(f), "pydoc_topics": list(t),
                          "windows": len(data["windows"][n]),
                          "tokens": sum(len(w) - 1 for w in data["windows"][n])}
                      for n, (d, f, t) in TEXT_SETS.items()},
        "agreement": {"prompts": len(data["prompts"]), "prompt_len": args.prompt_len,
                      "new_tokens": args.new_tokens},
        "options": {k: getattr(args, k) for k in ("seq_len", "fp8_keep_float", "alpha",
                                                  "group_size", "calib_samples", "calib_len")},
    }
    print(json.dumps(result["text_sets"]), flush=True)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="slipstream-eval-") as tmp:
        ckpts = prepare_checkpoints(args, model, names, Path(tmp), result)
        reference = None
        for name in names:
            rows[name] = run_row(name, ckpts, data, reference, args.new_tokens)
            if name == "none" and "tokens" in rows[name]:
                reference = rows[name]["tokens"]
            print(f"{name}: {rows[name].get('ppl', rows[name].get('error'))}", flush=True)
    for row in rows.values():
        row.pop("tokens", None)
    judge(rows)
    print_table(rows, list(TEXT_SETS))
    result["rows"] = list(rows.values())
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
