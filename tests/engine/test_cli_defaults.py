"""The command line's defaults are EngineArgs' own: a flag left out means the Python default."""
from __future__ import annotations

import argparse
import dataclasses

from slipstream.engine.args import EngineArgs


def test_every_engine_flag_defaults_to_the_engine_args_field() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    parsed = vars(parser.parse_args([]))
    fields = [f for f in dataclasses.fields(EngineArgs) if f.default is not dataclasses.MISSING]
    assert sum(f.name in parsed for f in fields) > 20  # the flags really are EngineArgs fields
    differ = {f.name: (parsed[f.name], f.default) for f in fields
              if f.name in parsed and parsed[f.name] != f.default}
    assert not differ, f"CLI default != EngineArgs default: {differ}"
