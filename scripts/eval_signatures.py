"""How often a model completes a function signature into code that parses, through slipstream.

    python scripts/eval_signatures.py                      # the default model and the embedded one
    python scripts/eval_signatures.py --model x.gguf --count 30 --json out.json

The signatures come from slipstream's own source (written in 2026, so no published model has
seen it): each is a `def` line (with its one-line docstring, if any); greedy completion, cut at
the end of the function body, must parse with `ast`. Deterministic.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_model.corpus import SourceFile  # noqa: E402
from default_model.evaluate import parses, signature_prompts  # noqa: E402

from slipstream import LLM, SamplingParams  # noqa: E402
from slipstream.assets import default_model_path  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "slipstream"


def package_sources() -> list[SourceFile]:
    return [SourceFile(str(p.relative_to(PACKAGE)), p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))]


def function_body(text: str, hit_limit: bool) -> str:
    """The generated body: lines up to the first one indented less than the body's first line
    (where the function ends); a last line cut by the token limit is dropped."""
    lines = text.split("\n")
    head, rest = lines[0], lines[1:]
    body = [line for line in rest if line.strip()]
    if not body:
        return head
    indent = len(body[0]) - len(body[0].lstrip())
    kept = [head]
    for line in rest:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            return "\n".join(kept)
        kept.append(line)
    return "\n".join(kept[:-1] if hit_limit and len(kept) > 1 else kept)


def evaluate(model: str | None, prompts, max_tokens: int) -> dict:
    llm = LLM(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    results = []
    for p, out in zip(prompts, outs, strict=True):
        hit_limit = out.outputs[0].finish_reason == "length"
        body = function_body(out.outputs[0].text, hit_limit)
        ok = bool(body.strip()) and parses(p.prompt + body)
        results.append({"file": p.file, "name": p.name, "prompt": p.prompt, "completion": body,
                        "parses": ok})
    passed = sum(r["parses"] for r in results)
    return {"model": model or "default", "num_prompts": len(results), "num_parse": passed,
            "fraction": passed / max(1, len(results)), "results": results}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append",
                   help="model to evaluate (repeatable; default: the default model and the "
                        "embedded demo model)")
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    prompts = signature_prompts(package_sources(), args.count)
    models = args.model or [None, str(default_model_path())]
    reports = [evaluate(m, prompts, args.max_tokens) for m in models]
    for r in reports:
        print(f"{r['model']}: {r['num_parse']}/{r['num_prompts']} completions parse "
              f"({100 * r['fraction']:.0f}%)")
        for ex in r["results"][:2]:
            print(f"--- {ex['file']} :: {ex['name']} ({'parses' if ex['parses'] else 'fails'})")
            print(ex["prompt"] + ex["completion"])
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")
    return reports


if __name__ == "__main__":
    main()
