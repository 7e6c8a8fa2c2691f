"""`slipstream build --model DIR --output ENGINE_DIR [engine flags]`."""
from __future__ import annotations

import argparse
import json


def add_build_parser(sub) -> None:
    from slipstream.engine.args import EngineArgs

    p = sub.add_parser(
        "build", help="prepare a model for this GPU, precision and limits as an engine directory",
        description="Load, quantize, tune and plan memory once, and write the result as an "
                    "engine directory: `LLM(ENGINE_DIR)`, `slipstream serve --model ENGINE_DIR`, "
                    "`generate` and `bench` then start without conversion or tuning. Run it on "
                    "the machine that will serve (GPU model and versions are checked at load).")
    p.add_argument("--output", "-o", required=True, help="engine directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing engine there")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_build)


def run_build(ns: argparse.Namespace) -> int:
    from slipstream.build.builder import build
    from slipstream.build.manifest import read_manifest
    from slipstream.engine.args import EngineArgs

    args = EngineArgs.from_cli_args(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model"}
    out = build(args.model, ns.output, overwrite=ns.overwrite, **kwargs)
    manifest = read_manifest(out)
    summary = {"engine": str(out), **manifest["settings"], **manifest["limits"],
               "num_blocks": manifest["memory_plan"]["num_blocks"],
               "build_startup_s": manifest["build_startup_phases"]}
    print(json.dumps(summary, indent=2))
    return 0
