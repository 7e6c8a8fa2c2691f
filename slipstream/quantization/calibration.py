"""Calibration for post-training quantization: sample texts, run the float model, record the
inputs of every linear layer (per-channel max and mean magnitude) and the prompts' token ids.

Runs through LLM.generate (one output token per sample), so the prefill path computes the stats.
"""
from __future__ import annotations

import json
import logging
import os
import sysconfig
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slipstream.assets import DEFAULT_MODEL_HELDOUT_FILES
from slipstream.layers.linear import LinearBase
from slipstream.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Built-in calibration set: mixed code and prose, since the default model is a code model.
BUILTIN_TEXTS = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The quick brown fox jumps over the lazy dog. Every sentence of this kind holds each letter.",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "Quantization stores each weight in fewer bits; a scale per channel keeps the error small.",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\nreturn sum;\n",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10 ORDER BY 2 DESC;",
    "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n",
    "A language model predicts the next token from the ones before it, one step at a time.",
    "async def fetch(session, url):\n    async with session.get(url) as response:\n"
    "        return await response.text()\n",
)
STDLIB_SAMPLES, STDLIB_CHARS = 64, 2000  # default set: this many ~2000-char stdlib excerpts
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                "lib-dynload", "pydoc_data"}
# Never calibrate on the default model's held-out files: held-out perplexity stays clean.
DEFAULT_MODEL_HELDOUT = DEFAULT_MODEL_HELDOUT_FILES


def load_calib_texts(path: str | Path | None, num_samples: int) -> list[str]:
    """Texts from a .jsonl ({"text": ...} per line), .json (list of strings) or plain text file
    (blank-line separated); when path is None, excerpts of this interpreter's standard library
    (BUILTIN_TEXTS if it has no sources). At most num_samples."""
    if path is None:
        texts = stdlib_calib_texts(max(num_samples, 1)) or list(BUILTIN_TEXTS)
    else:
        p = Path(path)
        raw = p.read_text(encoding="utf-8")
        if p.suffix == ".jsonl":
            texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        elif p.suffix == ".json":
            texts = [str(t) for t in json.loads(raw)]
        else:
            texts = [t for t in raw.split("\n\n") if t.strip()]
    if not texts:
        raise ValueError(f"no calibration texts in {path}")
    return texts[:num_samples]


def stdlib_calib_texts(num_samples: int = STDLIB_SAMPLES, chars: int = STDLIB_CHARS,
                       root: str | Path | None = None,
                       exclude: Collection[str] = DEFAULT_MODEL_HELDOUT) -> list[str]:
    """Up to num_samples excerpts of stdlib *.py files, from files spread evenly over the sorted
    list (deterministic), test directories and the `exclude` paths (relative to the stdlib root)
    skipped. Each excerpt is `chars` characters from the middle of its file, starting at a line:
    code bodies, like most of what a code model reads, rather than licence headers and imports.

    Real code of realistic length: ten short snippets under-sample the activation ranges that
    AWQ / SmoothQuant scales are computed from.
    """
    base = Path(root or sysconfig.get_paths().get("stdlib") or "")
    if not base.is_dir():
        return []
    skip = set(exclude)
    paths = [p for p in _stdlib_sources(base) if p.relative_to(base).as_posix() not in skip]
    texts: list[str] = []
    step = max(1, len(paths) // max(num_samples, 1))
    for path in paths[::step]:
        if len(texts) >= num_samples:
            break
        try:
            text = _middle_excerpt(path.read_text(encoding="utf-8"), chars)
        except (OSError, UnicodeDecodeError):
            continue
        if len(text.strip()) >= chars // 4:  # skip near-empty __init__ files
            texts.append(text)
    return texts


def _middle_excerpt(text: str, chars: int) -> str:
    """`chars` characters from the middle of text, starting at the beginning of a line."""
    start = max(0, (len(text) - chars) // 2)
    if start:
        start = text.find("\n", start) + 1 or start
    return text[start:start + chars]


def _stdlib_sources(base: Path) -> list[Path]:
    """Sorted *.py paths under base; skipped directories are pruned, never walked (a virtualenv's
    site-packages can hold 100k files)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith("config-")]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found)


class CalibrationStats(dict):
    """{linear layer name: LayerStats}, plus the token ids of the calibration prompts (AWQ runs
    them again, layer by layer)."""

    def __init__(self, prompts: list[list[int]] | None = None):
        super().__init__()
        self.prompts: list[list[int]] = prompts or []


@dataclass
class LayerStats:
    """Input statistics of one linear layer over the calibration tokens."""

    absmax: torch.Tensor  # [K] float32
    abssum: torch.Tensor  # [K] float32
    count: int = 0

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.count, 1)


def _record(stats: dict[str, LayerStats], name: str, x: torch.Tensor) -> None:
    x = x.detach().reshape(-1, x.shape[-1]).float().cpu()
    s = stats.get(name)
    if s is None:
        s = stats[name] = LayerStats(torch.zeros(x.shape[1]), torch.zeros(x.shape[1]))
    s.absmax = torch.maximum(s.absmax, x.abs().amax(dim=0))
    s.abssum += x.abs().sum(dim=0)
    s.count += x.shape[0]


def calibration_prompts(tokenizer, texts: list[str], max_len: int, vocab_size: int,
                        seed: int = 0) -> list[list[int]]:
    """Token ids per text, cut to max_len; seeded random ids when there is no tokenizer."""
    if tokenizer is None:
        logger.warning("no tokenizer: calibrating on random token ids")
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(3, vocab_size, (min(max_len, 64),), generator=g).tolist()
                for _ in texts]
    return [tokenizer.encode(t)[:max_len] or [0] for t in texts]


def collect_prompts(llm, texts: list[str], max_len: int = 512) -> CalibrationStats:
    """The calibration prompts' token ids only, no forward pass: for methods that run the model
    on them themselves (AWQ, layer by layer). Same signature as collect_linear_stats."""
    vocab = llm.engine_config.model.vocab_size
    return CalibrationStats(calibration_prompts(llm.tokenizer, texts, max_len, vocab))


@torch.no_grad()
def collect_linear_stats(llm, texts: list[str], max_len: int = 512) -> CalibrationStats:
    """Run each text through `llm` (an LLM) and return input stats per linear-layer name."""
    model: nn.Module = llm.engine.runner.model
    vocab = llm.engine_config.model.vocab_size
    prompts = calibration_prompts(llm.tokenizer, texts, max_len, vocab)
    stats = CalibrationStats(prompts)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, LinearBase)]
    handles = [module.register_forward_pre_hook(
                   lambda mod, args, name=name: _record(stats, name, args[0]))
               for name, module in linears]
    for name, module in linears:
        _watch_gated(module, name, stats)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=True)
    finally:
        for h in handles:
            h.remove()
        for _, module in linears:
            module.__dict__.pop("forward_gated", None)
    return stats


def _watch_gated(module: nn.Module, name: str, stats: dict[str, LayerStats]) -> None:
    """A gated MLP's down projection is called as forward_gated(gate_up, act), which may fuse
    the activation and bypasses forward hooks: record act(gate_up), its real input, instead
    (an instance attribute shadowing the method until collect_linear_stats removes it)."""
    gated = getattr(module, "forward_gated", None)
    if gated is None:
        return

    def forward_gated(gate_up: torch.Tensor, act):
        _record(stats, name, act(gate_up))
        return gated(gate_up, act)

    module.forward_gated = forward_gated
