"""`slipstream serve` command line: flags (engine + server) and the entry point.

`add_serve_parser(subparsers)` registers the subcommand; `python -m slipstream.serve` runs it
standalone. The serving itself is in serve/server.py.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from slipstream import envs
from slipstream.engine.args import EngineArgs
from slipstream.sampling_params import MAX_LOGPROBS
from slipstream.serve.tool_parsers import PARSERS


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                                   description=__doc__)
    add_serve_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_model_positional(parser)
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=envs.API_KEY.get() or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $SLIPSTREAM_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: 'default' for the default "
                        "model, else the --model directory's name or GGUF file's stem)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT directories) served as the "
                        "model NAME")
    g.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help="largest logprobs / top_logprobs a request may ask for")
    g.add_argument("--max-tokens-cap", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context)")
    g.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted")
    g.add_argument("--max-prompts", type=int, default=32,
                   help="most prompts in one batched /v1/completions request")
    g.add_argument("--tool-call-parser", default="hermes", choices=sorted(PARSERS),
                   help="how the model writes tool calls, for tool_choice 'auto' "
                        "(default: hermes, <tool_call>{...}</tool_call>)")
    g.add_argument("--engine-startup-timeout", type=float, default=1800.0)
    add_hardening_args(parser)
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--no-access-log", dest="access_log", action="store_false")


def add_hardening_args(parser: argparse.ArgumentParser) -> None:
    """Flags against slow or numerous clients and a dead or hung engine (docs/robustness.md)."""
    g = parser.add_argument_group("robustness")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers (408, then close)")
    g.add_argument("--body-timeout", type=float, default=10.0,
                   help="seconds between two reads of an incomplete request body (408)")
    g.add_argument("--max-connections", type=int, default=1000,
                   help="open connections; beyond it a connection's request gets 429")
    g.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="requests served at once (streams count until they end); beyond: 429")
    g.add_argument("--engine-hang-timeout", type=float, default=60.0,
                   help="seconds the engine may hold requests without sending anything before "
                        "it counts as hung and is restarted (0: never)")
    g.add_argument("--max-engine-restarts", type=int, default=5,
                   help="restarts of a dead or hung engine in a row before the server exits 1")
    g.add_argument("--engine-restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart, doubled for each one in a row")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may wait for its next output (its first token "
                        "included) before it fails with 504; default: no limit")


def run_serve(args: argparse.Namespace) -> int:
    """Serve until a signal (returns 0) or until the engine dies (returns 1)."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The engine process reads its level from the environment it inherits (envs.LOG_LEVEL),
    # which has no CRITICAL: ERROR is the closest it takes.
    engine_level = "ERROR" if args.log_level == "critical" else args.log_level.upper()
    os.environ.setdefault(envs.LOG_LEVEL.name, engine_level)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    from slipstream.serve.server import serve  # lazy: fastapi and uvicorn load to serve, not for --help

    try:
        return asyncio.run(serve(config, args))
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, ValueError) as exc:  # the engine failed to start, or a bad adapter
        logging.getLogger("slipstream.serve").error("%s", exc)
        return 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="slipstream serve", description=__doc__)
    add_serve_args(parser)
    sys.exit(run_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
