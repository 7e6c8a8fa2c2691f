"""The `slipstream` command line: generate, chat, serve, build, quantize and bench.

Every subcommand runs on the embedded default model when --model is omitted.
"""
from __future__ import annotations

import argparse
import logging
import sys

from slipstream.engine.args import EngineArgs
from slipstream.sampling_params import SamplingParams

_EPILOG = """examples:
  slipstream generate --prompt "def fibonacci(n):" --max-tokens 64
  slipstream chat
  slipstream serve --port 8000
  slipstream serve engine/ --port 8000
  slipstream build --model llama-3.1-8b/ --output engine/ --quantization fp8 --max-num-seqs 64
  slipstream bench latency --model llama-3.1-8b --batch-size 1 --input-len 128 --output-len 256
  slipstream bench throughput --model llama-3.1-8b --load-format dummy --num-requests 1000
  slipstream bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 200
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream", description="slipstream: fast LLM inference on PyTorch and Triton.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_chat(sub)
    _add_optional(sub)
    return parser


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")


def sampling_params_from_args(ns: argparse.Namespace):
    return SamplingParams(
        n=ns.n, max_tokens=ns.max_tokens, temperature=ns.temperature, top_k=ns.top_k,
        top_p=ns.top_p, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
        seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="complete one or more prompts and print the text",
                       description="Complete prompts with a local model (default: the default "
                                   "model, SmolLM2-135M-Instruct where installed).")
    p.add_argument("--prompt", action="append", default=[],
                   help="prompt text (repeatable); reads stdin when none is given")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model's chat template "
                        "and print only the reply")
    EngineArgs.add_model_positional(p)
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat in the terminal",
                       description="Chat with a model through its chat template. "
                                   "Type /exit or Ctrl-D to leave, /reset to start over.")
    p.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run_chat)


def _add_optional(sub) -> None:
    """Subcommands that live in other modules (server, benchmarks), imported only when the
    parser is built so that `import slipstream.cli` stays light."""
    try:
        from slipstream.serve.cli import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    from slipstream.build.cli import add_build_parser
    from slipstream.quantization.cli import add_quantize_parser

    add_build_parser(sub)
    add_quantize_parser(sub)
    try:
        from slipstream.bench.cli import add_bench_parsers
    except ImportError:
        return
    bench = add_bench_parsers(sub)
    try:
        from slipstream.bench.serve import add_bench_serve_parser
    except ImportError:
        return
    add_bench_serve_parser(bench)


def _make_llm(ns: argparse.Namespace):
    from slipstream.llm import LLM  # lazy: the engine loads for a run, not for --help

    args = EngineArgs.from_cli_args(ns)
    kwargs = {k: v for k, v in vars(args).items() if k != "model"}
    return LLM(args.model, **kwargs)


def run_generate(ns: argparse.Namespace) -> int:
    prompts = ns.prompt or [sys.stdin.read()]
    params = sampling_params_from_args(ns)
    llm = _make_llm(ns)
    if ns.chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outs = llm.chat(conversations, params, use_tqdm=len(prompts) > 1)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for out in outs:
        for completion in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- sample {completion.index} ---")
            print(completion.text if ns.chat else f"{out.prompt}{completion.text}")
    return 0


def run_chat(ns: argparse.Namespace) -> int:
    params = sampling_params_from_args(ns)
    llm = _make_llm(ns)
    history = [{"role": "system", "content": ns.system}] if ns.system else []
    start = len(history)
    print("slipstream chat — /exit to leave, /reset to clear the conversation")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            del history[start:]
            continue
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply}")
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    try:
        return int(ns.func(ns) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
