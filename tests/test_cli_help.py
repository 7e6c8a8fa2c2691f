"""`--help` works for the `slipstream` command and every subcommand and sub-subcommand.

The commands are discovered from the argparse parser itself, so a new subcommand is covered
without editing this file. Everything runs in-process (argparse prints the help and exits 0).
"""
from __future__ import annotations

import argparse

import pytest

from slipstream import cli
from slipstream.bench import cli as bench_cli


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every command path below `parser`, depth first: (), ("bench",), ("bench", "serve"), ..."""
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _command_paths(sub, (*prefix, name))


PATHS = list(_command_paths(cli.build_parser()))


def _help(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage:") and len(out.splitlines()) > 1
    return out


def test_the_parser_has_the_expected_commands():
    # a guard that discovery works; any further command is covered automatically
    for path in [("generate",), ("chat",), ("quantize",), ("bench",), ("bench", "latency"),
                 ("bench", "throughput"), ("bench", "serve")]:
        assert path in PATHS


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "slipstream")
def test_help_exits_zero_with_usage(path, capsys):
    out = _help(cli.main, [*path, "--help"], capsys)
    assert f"usage: slipstream {' '.join(path)}".rstrip() in " ".join(out.split())


def test_top_level_help_lists_the_bench_modes(capsys):
    out = _help(cli.main, ["--help"], capsys)
    for mode in ("bench latency", "bench throughput", "bench serve"):
        assert mode in " ".join(out.split())


@pytest.mark.parametrize("argv", [["--help"], ["latency", "--help"], ["throughput", "--help"]])
def test_standalone_bench_cli_help(argv, capsys):
    _help(bench_cli.main, argv, capsys)
