"""`slipstream bench serve`: an online serving benchmark against any OpenAI-compatible server.

Requests arrive as a Poisson process (--request-rate, gamma-distributed gaps with --burstiness)
or as fast as --max-concurrency allows; every request streams, so TTFT, TPOT, ITL and end-to-end
latency are measured as a client sees them; against a slipstream server, TTFT is also split
into its parts from the server's /metrics (bench/server_timings.py). Prints a table and writes
JSON (--output-json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from slipstream import envs
from slipstream.bench import report, server_timings

_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city name").split()
_SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    sent_s: float | None = None  # when it was sent, from the start of the timed run

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="online serving benchmark against a running "
                              "OpenAI-compatible server", description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=envs.OPENAI_API_KEY.get() or None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128, help="prompt length (tokens with "
                   "--tokenizer, else words)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--tokenizer", default=None, help="local tokenizer dir: exact-length prompts")
    p.add_argument("--prompt-token-ids", action="store_true",
                   help="send random token ids as prompts (completions only; exact lengths, "
                        "for servers without a tokenizer)")
    p.add_argument("--max-token-id", type=int, default=30000,
                   help="--prompt-token-ids draws ids from [max/30, max)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers that reject unknown fields)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2e:5000")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--label", default=None, help="workload name in the report (e.g. W6)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=bench_serve_main)
    return p


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in _SLO_KEYS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {_SLO_KEYS}, got {item!r}")
        slos[key] = float(value)
    return slos


def make_prompts(args: argparse.Namespace) -> list[str] | list[list[int]]:
    rng = random.Random(args.seed)
    if args.prompt_token_ids:  # exact lengths with no tokenizer anywhere (dummy-weight models)
        hi = args.max_token_id
        return [[rng.randrange(hi // 30, hi) for _ in range(args.input_len)]
                for _ in range(args.num_prompts)]
    if args.tokenizer:
        from slipstream.tokenizer.tokenizer import load_tokenizer  # lazy: transformers, only here

        tok = load_tokenizer(args.tokenizer)
        special = set(tok.all_special_ids)
        ids = [i for i in range(min(len(tok), 32000)) if i not in special]
        return [tok.decode([rng.choice(ids) for _ in range(args.input_len)])
                for _ in range(args.num_prompts)]
    return [" ".join(rng.choice(_WORDS) for _ in range(args.input_len))
            for _ in range(args.num_prompts)]


def _body(args: argparse.Namespace, model: str, prompt: str | list[int]) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": model, "max_tokens": args.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _has_tokens(event: dict) -> bool:
    """Does this chunk carry generated output? (Not the usage chunk, not a role-only delta.)"""
    choices = event.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    if "delta" not in c:
        return c.get("text") is not None  # completions: one chunk per engine step
    delta = c["delta"] or {}
    return bool(delta.get("content")) or (delta.get("content") == "" and not delta.get("role"))


async def send_request(client: httpx.AsyncClient, path: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                if event.get("usage"):
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                    res.output_tokens = event["usage"]["completion_tokens"]
                if _has_tokens(event):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
        res.e2e_s = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness) with mean 1/rate (Poisson at 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def _run(args: argparse.Namespace,
               prompts: list[Any]) -> tuple[list[RequestResult], float, str, dict | None]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000,
                          max_keepalive_connections=args.max_concurrency or 1000)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 timeout=args.timeout, limits=limits) as client:
        model = args.model or await _first_model(client)
        for prompt in prompts[: args.num_warmups]:
            await send_request(client, *_body(args, model, prompt))
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(prompt: Any) -> RequestResult:
            sent = time.perf_counter() - start
            if gate is None:
                res = await send_request(client, *_body(args, model, prompt))
            else:
                async with gate:
                    res = await send_request(client, *_body(args, model, prompt))
            res.sent_s = sent
            return res

        timings_before = await server_timings.scrape(client)
        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), args.request_rate,
                                                     args.burstiness, args.seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        parts = server_timings.breakdown(timings_before, await server_timings.scrape(client))
        return results, duration, model, parts


async def _first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def summarize_results(results: list[RequestResult], duration_s: float,
                      slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if _meets(r, slos)]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s, "output_tok_s": out_tokens / duration_s,
        "total_tok_s": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": report.summarize([r.ttft_s for r in ok]),
        "tpot_ms": report.summarize([r.tpot_s for r in ok]),
        "itl_ms": report.summarize([g for r in ok for g in r.itl_s]),
        "e2e_ms": report.summarize([r.e2e_s for r in ok]),
        "goodput": {"slo_ms": slos, "req_s": len(good) / duration_s if slos else None},
        "errors": sorted({r.error for r in results if r.error})[:5],
        # Per request, in send order: to find which requests make a tail (e.g. TTFT p99).
        "requests": [{"sent_s": _round(r.sent_s), "ok": r.ok, "ttft_ms": _ms(r.ttft_s),
                      "e2e_ms": _ms(r.e2e_s), "output_tokens": r.output_tokens}
                     for r in results],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    for key, limit_ms in slos.items():
        value = values[key]
        if value is None:
            if key == "tpot":
                continue  # a one-token answer has no time per output token
            return False
        if value * 1e3 > limit_ms:
            return False
    return True


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    slos = parse_goodput(args.goodput)
    if args.prompt_token_ids and args.endpoint == "chat":
        raise ValueError("--prompt-token-ids works with --endpoint completions only")
    prompts = make_prompts(args)
    results, duration, model, ttft_parts = asyncio.run(_run(args, prompts))
    result = {
        "mode": "serve", "workload": args.label or f"serve-{args.endpoint}",
        "model": {"shape": model, "name": model}, "base_url": args.base_url,
        "endpoint": args.endpoint, "num_requests": args.num_prompts,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "input_len": args.input_len, "output_len": args.output_len,
        **summarize_results(results, duration, slos),
        # The server's view of TTFT in parts (a slipstream server's /metrics; else None).
        "ttft_parts": ttft_parts,
    }
    result["meta"] = report.run_meta()
    return result


def serve_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    rate = r["request_rate"]
    rows = [("model", r["model"]["name"]), ("endpoint", r["endpoint"]),
            ("request rate (req/s)", "inf" if rate is None else rate),
            ("max concurrency", r["max_concurrency"]),
            ("successful / failed requests", f"{r['completed']} / {r['failed']}"),
            ("duration (s)", r["duration_s"]),
            ("total input / output tokens",
             f"{r['total_input_tokens']} / {r['total_output_tokens']}"),
            ("request throughput (req/s)", r["request_throughput"]),
            ("output throughput (tok/s)", r["output_tok_s"]),
            ("total token throughput (tok/s)", r["total_tok_s"])]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_ms", "E2E")):
        s = r[key]
        rows.append((f"{name} mean / median / p99 (ms)",
                     " / ".join(report.format_value(s.get(k)) for k in ("mean", "median", "p99"))))
    rows += server_timings.breakdown_rows(r.get("ttft_parts"))
    if r["goodput"]["req_s"] is not None:
        rows.append((f"goodput (req/s) {r['goodput']['slo_ms']}", r["goodput"]["req_s"]))
    return rows


def bench_serve_main(args: argparse.Namespace) -> int:
    result = run_bench_serve(args)
    report.write_json(result, args.output_json)
    if args.output_json:
        print(f"[bench] wrote {args.output_json}", flush=True)
    for err in result["errors"]:
        print(f"[bench] error: {err}", flush=True)
    print(report.format_table(serve_rows(result), "slipstream bench serve"), flush=True)
    return 0 if result["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.bench.serve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_serve_parser(sub)
    return bench_serve_main(parser.parse_args(["serve", *(argv or [])]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
