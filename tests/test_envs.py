"""slipstream/envs.py is the one place environment variables are read, and docs/configuration.md
lists every variable and every EngineArgs field."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from slipstream import envs
from slipstream.engine.args import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slipstream"
CONFIG_DOC = ROOT / "docs" / "configuration.md"


def test_no_module_reads_a_slipstream_variable_but_envs() -> None:
    pattern = re.compile(r"(environ\.get|getenv|environ\[)\(?\s*[\"']SLIPSTREAM_")
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if p.name != "envs.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_every_variable_named_in_the_package_is_defined_in_envs() -> None:
    defined = {v.name for v in envs.ALL}
    named = set()
    for p in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\bSLIPSTREAM_[A-Z0-9_]+\b", p.read_text()))
    assert named <= defined, f"undefined: {sorted(named - defined)}"


def test_configuration_doc_lists_every_variable_and_field() -> None:
    doc = CONFIG_DOC.read_text()
    missing = [v.name for v in envs.ALL if f"`{v.name}`" not in doc]
    missing += [f.name for f in dataclasses.fields(EngineArgs) if f"`{f.name}`" not in doc]
    assert missing == []


def test_unset_variables_give_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in envs.ALL:
        monkeypatch.delenv(var.name, raising=False)
        assert var.get() == var.default
        assert not var.is_set()


def test_values_are_parsed_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_PDL", "0")
    assert envs.PDL.get() is False
    monkeypatch.setenv("SLIPSTREAM_STEP_TIMING", "1")
    assert envs.STEP_TIMING.get() is True
    monkeypatch.setenv("SLIPSTREAM_LOG_LEVEL", "debug")
    assert envs.LOG_LEVEL.get() == "DEBUG"


@pytest.mark.parametrize(("name", "value"), [("SLIPSTREAM_PDL", "maybe"),
                                             ("SLIPSTREAM_KERNELS", "cuda"),
                                             ("SLIPSTREAM_LOG_LEVEL", "loud")])
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str,
                                      value: str) -> None:
    monkeypatch.setenv(name, value)
    var = next(v for v in envs.ALL if v.name == name)
    with pytest.raises(ValueError, match=name):
        var.get()
