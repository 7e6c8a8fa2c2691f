"""Models shipped inside the package: the default code model and its draft model.

Both are ordinary Hugging Face checkpoint directories trained by scripts/train_default_model.py
(see the README.md model card in each); `pip install` brings them as package data.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "default_model"
DRAFT_MODEL_DIR = ASSETS_DIR / "draft_model"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# The default model's held-out evaluation files (paths under the Python stdlib; present in
# CPython 3.10 - 3.13): never trained on (scripts/default_model/corpus.py) and never used to
# calibrate quantization (quantization/calibration.py), so held-out perplexity stays clean.
DEFAULT_MODEL_HELDOUT_FILES: tuple[str, ...] = (
    "asyncio/locks.py", "asyncio/queues.py", "base64.py", "bisect.py", "calendar.py",
    "cmd.py", "concurrent/futures/thread.py", "contextlib.py", "copy.py", "csv.py",
    "difflib.py", "filecmp.py", "fileinput.py", "fnmatch.py", "fractions.py", "ftplib.py",
    "gettext.py", "glob.py", "graphlib.py", "gzip.py", "heapq.py", "hmac.py",
    "html/parser.py", "http/cookies.py", "json/decoder.py", "json/encoder.py",
    "logging/handlers.py", "netrc.py", "numbers.py", "pprint.py", "queue.py", "quopri.py",
    "sched.py", "shlex.py", "statistics.py", "textwrap.py", "timeit.py", "tracemalloc.py",
    "urllib/robotparser.py", "xml/dom/minidom.py",
)


def _checked(path: Path, what: str) -> Path:
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the embedded {what} is missing from {path} (no {', '.join(missing)}); "
            "reinstall slipstream, or train it with `python scripts/train_default_model.py "
            f"--output-dir DIR` and copy DIR/{path.name} there, or pass --model / model= "
            "explicitly"
        )
    return path


def default_model_path() -> Path:
    """Directory of the default target model (used when no model is given)."""
    return _checked(DEFAULT_MODEL_DIR, "default model")


def default_draft_model_path() -> Path:
    """Directory of the default model's draft model (speculative decoding)."""
    return _checked(DRAFT_MODEL_DIR, "default draft model")


def has_default_model() -> bool:
    """True when both embedded models are present (tests skip on a bare checkout)."""
    try:
        default_model_path()
        default_draft_model_path()
    except FileNotFoundError:
        return False
    return True
