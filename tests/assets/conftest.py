"""Fixtures for the default-model pipeline tests: the scripts/ dir on sys.path, one tiny run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    """(output dir, metrics) of the whole pipeline at --tiny scale on this machine's stdlib."""
    import train_default_model

    out = tmp_path_factory.mktemp("default_model_run")
    metrics = train_default_model.main(
        ["--tiny", "--output-dir", str(out / "models"), "--archive", str(out / "models.tar.gz"),
         "--device", "cpu"])
    return out, metrics
