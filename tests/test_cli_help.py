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


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_model_is_positional_or_a_flag(command):
    from slipstream.engine.args import EngineArgs

    for argv, model in [([command, "eng/"], "eng/"), ([command, "--model", "eng/"], "eng/"),
                        ([command, "eng/", "--model", "eng/"], "eng/"), ([command], None),
                        ([command, "--max-num-seqs", "4", "eng/"], "eng/")]:
        assert EngineArgs.from_cli_args(_parse(argv)).model == model, argv


@pytest.mark.parametrize("argv", [["serve", "a/", "--model", "b/"],
                                  ["generate", "--model", "b/", "--prompt", "x", "a/"]])
def test_two_different_models_are_an_error(argv, capsys):
    assert cli.main(argv) == 2  # found before any engine starts
    err = capsys.readouterr().err
    assert "given twice" in err and "(a/)" in err and "(b/)" in err
