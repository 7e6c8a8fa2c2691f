"""Evaluation of saved default-model checkpoints with Hugging Face transformers.

Held-out perplexity (non-overlapping windows per file), the `ast` quality check on greedy
completions of held-out function signatures, and the draft's greedy agreement with the target.
"""

from __future__ import annotations

import ast
import math
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from .corpus import SourceFile, iter_functions

IGNORE = -100


def load_checkpoint(model_dir: str | Path, device: torch.device):
    """(model in fp32, eval mode, on device; tokenizer) from an HF checkpoint directory."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval(), tok


def heldout_windows(tok, files: list[SourceFile], seq_len: int) -> torch.Tensor:
    """[N, seq_len + 1] windows (BOS-prefixed files, stride seq_len), right-padded with -100."""
    rows = []
    for f in files:
        ids = tok(f.text).input_ids
        for start in range(0, max(1, len(ids) - 1), seq_len):
            rows.append(ids[start: start + seq_len + 1])
    out = torch.full((len(rows), seq_len + 1), IGNORE, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def _logits(model, windows: torch.Tensor, pad_id: int) -> torch.Tensor:
    inputs = windows[:, :-1].clamp_min(0)
    inputs[windows[:, :-1] == IGNORE] = pad_id  # right padding: causal attention ignores it
    return model(input_ids=inputs, use_cache=False).logits.float()


@torch.no_grad()
def perplexity(model, tok, files: list[SourceFile], seq_len: int = 512,
               batch_size: int = 16) -> dict:
    """Token-level perplexity and bits per byte of the held-out files."""
    device = next(model.parameters()).device
    windows = heldout_windows(tok, files, seq_len)
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size].to(device)
        logits = _logits(model, batch, tok.pad_token_id)
        targets = batch[:, 1:]
        nll += F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE, reduction="sum").item()
        count += int((targets != IGNORE).sum())
    num_bytes = sum(len(f.text.encode()) for f in files)
    return {"perplexity": math.exp(nll / count), "loss": nll / count, "tokens": count,
            "bytes": num_bytes, "bits_per_byte": nll / math.log(2) / num_bytes}


@torch.no_grad()
def draft_agreement(target, draft, tok, files: list[SourceFile], seq_len: int = 512,
                    batch_size: int = 16, max_windows: int | None = None) -> dict:
    """How often the draft's greedy next token equals the target's, teacher-forced."""
    device = next(target.parameters()).device
    windows = heldout_windows(tok, files, seq_len)[:max_windows]
    agree, count = 0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size].to(device)
        valid = batch[:, 1:] != IGNORE
        same = _logits(target, batch, tok.pad_token_id).argmax(-1) == \
            _logits(draft, batch, tok.pad_token_id).argmax(-1)
        agree += int((same & valid).sum())
        count += int(valid.sum())
    return {"agreement": agree / count, "positions": count}


@dataclass
class SignaturePrompt:
    """A held-out function's `def` line(s), maybe with its one-line docstring, dedented."""

    file: str
    name: str
    prompt: str


def signature_prompts(files: list[SourceFile], count: int) -> list[SignaturePrompt]:
    """`count` prompts spread evenly over every eligible function of the held-out files."""
    found = []
    for source in files:
        for node, lines in iter_functions(source):
            body = node.body
            if body[0].lineno == node.lineno:  # `def f(): pass` on one line
                continue
            end = body[0].lineno - 1  # the signature ends on the line before the body
            doc = body[0]
            if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                if doc.lineno != doc.end_lineno or len(body) == 1:
                    continue  # multi-line docstrings or docstring-only bodies are skipped
                end = doc.end_lineno
            text = textwrap.dedent("\n".join(lines[node.lineno - 1: end]))
            if text.rstrip().endswith((":", '"""', "'''")) and "#" not in text:
                found.append(SignaturePrompt(source.rel_path, node.name, text.rstrip()))
    if len(found) <= count:
        return found
    return [found[i * len(found) // count] for i in range(count)]


def cut_completion(text: str, hit_limit: bool) -> str:
    """Keep the function body: stop at the first blank line or the first line at column 0.

    When generation stopped at the token limit instead, the last line may be cut mid-way, so it
    is dropped.
    """
    lines = text.split("\n")
    kept = [lines[0]]
    for line in lines[1:]:
        if not line.strip() or not line[0].isspace():
            return "\n".join(kept)
        kept.append(line)
    return "\n".join(kept[:-1] if hit_limit and len(kept) > 1 else kept)


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


@torch.no_grad()
def quality_check(model, tok, prompts: list[SignaturePrompt], max_new_tokens: int = 128,
                  batch_size: int = 50) -> dict:
    """Greedy completions of the prompts; how many (prompt + body) parse with `ast`."""
    device = next(model.parameters()).device
    results = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i: i + batch_size]
        enc = tok([p.prompt for p in chunk], return_tensors="pt", padding=True).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for p, row in zip(chunk, out[:, enc.input_ids.shape[1]:].tolist(), strict=True):
            hit_limit = tok.eos_token_id not in row and len(row) == max_new_tokens
            raw = tok.decode(row, skip_special_tokens=True)
            body = cut_completion(raw, hit_limit)
            ok = bool(body.strip()) and parses(p.prompt + body)
            results.append({**asdict(p), "completion": body, "parses": ok})
    passed = sum(r["parses"] for r in results)
    return {"num_prompts": len(results), "num_parse": passed,
            "fraction": passed / max(1, len(results)), "results": results}
