"""Multi-LoRA throughput and batch-1 decode overhead on the Llama-3.1-8B shape (random weights).

    python benchmarks/bench_lora.py [--num-requests 2000] [--adapters 0 1 8 64] [--max-loras 16]

Adapters are rank 16 on every linear layer (q, k, v, o, gate, up, down), in the PEFT layout, with
random weights; one weights file is written and each adapter directory links to it (the engine
reads and pages each adapter on its own, so the cost is that of distinct adapters). One engine
with enable_lora runs W2's mix (input 128, output 128, ignore_eos) with the adapters spread
uniformly over the requests, then batch-1 decode of one request with and without an adapter.
A step in which no request uses an adapter runs the plain model's kernels and graphs, so the
LoRA engine's 0-adapter run is the no-LoRA baseline; --plain also runs an engine without
enable_lora first (one more start-up: over five minutes in all). Prints a table; --json writes
the figures.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from slipstream import LLM, LoRARequest, SamplingParams
from slipstream.bench.shapes import materialize_shape

_TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
            "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(root: Path, cfg: dict, count: int, rank: int) -> list[LoRARequest]:
    from safetensors.torch import save_file

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for block, names in _TARGETS.items():
            for name in names:
                k, n = dims[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, k, generator=gen) / k**0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(n, rank, generator=gen) * 0.01).bfloat16()
    weights = root / "adapter_model.safetensors"
    save_file(tensors, str(weights))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [n for names in _TARGETS.values() for n in names]}
    loras = []
    for i in range(count):
        path = root / f"adapter-{i}"
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(config))
        (path / "adapter_model.safetensors").symlink_to(weights)
        loras.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
    return loras


def w2_prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(input_len)] for _ in range(n)]


def run_w2(llm: LLM, prompts, params, loras: list[LoRARequest]) -> float:
    """Output tokens per second of one offline batch; request i uses loras[i % len] (or none)."""
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    llm.generate(prompts[:64], params, use_tqdm=False,
                 lora_request=per_prompt[:64] if per_prompt else None)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def batch1_tpot(llm: LLM, prompt: list[int], lora: LoRARequest | None, tokens: int) -> float:
    """Seconds per output token of one request decoding alone (median of three)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(3):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        times.append(out.metrics.time_per_output_token)
    return sorted(times)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 8, 64])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--plain", action="store_true", help="also run an engine without LoRA")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    model_dir = materialize_shape(args.shape)
    cfg = json.loads((model_dir / "config.json").read_text())
    root = Path(tempfile.mkdtemp(prefix="slipstream-loras-"))
    loras = write_adapters(root, cfg, max(args.adapters), args.rank)
    prompts = w2_prompts(args.num_requests, args.input_len, cfg["vocab_size"])
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine = dict(load_format="dummy", max_num_seqs=args.max_num_seqs,
                  max_num_tokens=args.max_num_tokens, max_model_len=4096)
    results: dict[str, float] = {}
    if args.plain:
        plain = LLM(str(model_dir), **engine)
        results["w2 plain engine"] = run_w2(plain, prompts, params, [])
        results["batch-1 plain engine s/token"] = batch1_tpot(plain, prompts[0], None,
                                                              args.decode_tokens)
        del plain
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    llm = LLM(str(model_dir), enable_lora=True, max_loras=args.max_loras,
              max_lora_rank=args.rank, max_cpu_loras=max(args.max_loras, max(args.adapters)),
              **engine)
    for count in args.adapters:
        results[f"w2 {count} adapters"] = run_w2(llm, prompts, params, loras[:count])
    results["batch-1 no adapter s/token"] = batch1_tpot(llm, prompts[0], None, args.decode_tokens)
    results["batch-1 one adapter s/token"] = batch1_tpot(llm, prompts[0], loras[0],
                                                         args.decode_tokens)
    _print_table(results, args.adapters)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def _print_table(results: dict[str, float], counts: list[int]) -> None:
    base = results.get("w2 0 adapters") or results.get("w2 plain engine")
    print(f"{'run':34s} {'value':>12s} {'vs no LoRA':>10s}")
    for key, value in results.items():
        if key.startswith("w2"):
            print(f"{key:34s} {value:10.0f}/s {value / base:10.2f}x")
    b0 = results["batch-1 no adapter s/token"]
    for key in [k for k in results if k.startswith("batch-1")]:
        v = results[key]
        print(f"{key:34s} {v * 1e3:9.2f} ms {v / b0:10.2f}x")
    print("targets: 8 adapters >= 0.75x, 64 adapters >= 0.60x (paged through max_loras slots), "
          "batch-1 one adapter <= 1.15x")


if __name__ == "__main__":
    main()
