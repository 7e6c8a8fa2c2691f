"""Which runner a checkpoint gets, and how a pooling model pools (from the checkpoint).

A checkpoint whose architecture is an encoder or a headless / classification model is a
pooling model; `runner="pooling"` also turns a causal LM into an embedder (last-token pooling,
the Qwen3-Embedding recipe). sentence-transformers checkpoints say how they pool in
`1_Pooling/config.json` and whether they normalise in `modules.json`; those win over the
architecture's default.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("last", "mean", "cls")

# Architectures that can only pool, and the pooling each uses unless the checkpoint says.
POOLING_ARCHITECTURES: dict[str, str] = {
    "BertModel": "cls",
    "BertForSequenceClassification": "cls",
    **{f"{family}Model": "last" for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
    **{f"{family}ForSequenceClassification": "last"
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
}
ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")

_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "last"  # last / mean / cls
    normalize: bool = True  # embeddings: L2-normalised unless a request says otherwise
    # Matryoshka models accept `dimensions` (truncate, then normalise); others refuse it.
    matryoshka: bool = False


def is_classifier_architecture(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def resolve_runner(runner: str, architecture: str) -> str:
    """"generate" or "pooling"; ValueError for a runner name or a combination that cannot work."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    pooling_only = architecture in POOLING_ARCHITECTURES
    if runner == "auto":
        return "pooling" if pooling_only else "generate"
    if runner == "generate" and pooling_only:
        raise ValueError(f"{architecture} has no language-model head: it runs with "
                         "runner='pooling' (llm.embed / llm.classify / llm.score)")
    return runner


def resolve_pooler(model_path: str | Path, architecture: str, hf_config: dict[str, Any],
                   pooling_type: str | None, normalize: bool | None) -> PoolerConfig:
    """The pooler of a checkpoint: explicit arguments, else sentence-transformers files, else
    the architecture's default (CLS for BERT, last token for decoders)."""
    st_type, st_normalize = _sentence_transformers_pooling(Path(model_path))
    kind = pooling_type or st_type or POOLING_ARCHITECTURES.get(architecture, "last")
    if kind not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {kind!r}")
    if normalize is None:
        normalize = True if st_normalize is None else st_normalize
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    return PoolerConfig(pooling_type=kind, normalize=bool(normalize), matryoshka=matryoshka)


def _sentence_transformers_pooling(path: Path) -> tuple[str | None, bool | None]:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    kind = None
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            cfg_file = path / m.get("path", "1_Pooling") / "config.json"
            if cfg_file.is_file():
                cfg = json.loads(cfg_file.read_text())
                kind = next((v for k, v in _ST_MODES.items() if cfg.get(k)), None)
    return kind, normalize
