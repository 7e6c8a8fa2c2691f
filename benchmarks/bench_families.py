"""Model families and sliding windows: KV blocks a long request holds, and decode speed on a GPU.

    python benchmarks/bench_families.py [--output-json OUT.json] [--cpu-only]

1. KV memory (integers only, any machine): the peak blocks a 32k-token request holds under the
   KV manager, Mistral-7B-v0.1 shape (window 4096, 32 layers, 8 KV heads of 128, bf16, blocks of
   16, prefill chunks of 2048), with the window's release of blocks and without.
2. Decode (CUDA): random weights (load_format="dummy") of reduced real shapes, 8 sequences of
   4000-token prompts, 64 new tokens each: decode ms per step, for Mistral-7B layers with a
   1024-token window against the same model without it, Gemma-2-2B and GPT-2 small.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from slipstream.engine.request import Request
from slipstream.kv_cache.manager import KVCacheManager
from slipstream.sampling_params import SamplingParams

MISTRAL = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
    rope_theta=10000.0,
)


def peak_blocks(window: int | None, tokens: int = 32768, chunk: int = 2048, block: int = 16) -> int:
    """Run one request through the KV manager as the scheduler would; the most blocks held."""
    kv = KVCacheManager(4096, block, enable_prefix_caching=True, sliding_window=window)
    req = Request("r", list(range(tokens)), SamplingParams(max_tokens=1))
    peak = 0
    while req.num_computed_tokens < tokens:
        n = min(chunk, tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        peak = max(peak, kv.num_held_blocks("r"))
    return peak


def kv_memory_rows() -> list[dict]:
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 tokens, bf16
    rows = []
    for name, window in [("full attention", None), ("window 4096, released", 4096)]:
        blocks = peak_blocks(window)
        rows.append({"case": name, "peak_blocks": blocks, "GiB": blocks * per_block / 2**30})
    return rows


def _config_dir(root: Path, arch: str, **fields) -> Path:
    import transformers

    cls = {
        "MistralForCausalLM": transformers.MistralConfig,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "GPT2LMHeadModel": transformers.GPT2Config,
    }[arch]
    config = cls(**fields)
    config.architectures = [arch]
    path = root / f"{arch}-{len(list(root.iterdir()))}"
    config.save_pretrained(path)
    return path


def decode_ms(path: Path, prompt_len: int, batch: int = 8, new: int = 64, kv_bytes: int = 6 << 30) -> float:
    from slipstream import LLM

    llm = LLM(
        str(path),
        load_format="dummy",
        max_model_len=prompt_len + new + 8,
        max_num_seqs=batch,
        max_num_tokens=2048,
        kv_cache_memory=kv_bytes,
    )
    prompts = [
        {"prompt_token_ids": [(i * 7 + j) % 1000 + 3 for j in range(prompt_len)]} for i in range(batch)
    ]

    ms = (_timed(llm, prompts, new) - _timed(llm, prompts, 1)) / (new - 1) * 1e3
    del llm
    gc.collect()  # the next case gets the GPU memory back
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ms


def _timed(llm, prompts: list[dict], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm: graphs, tuners, caches
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def decode_rows() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = [
            (
                "Mistral-7B x8 layers, full",
                "MistralForCausalLM",
                dict(MISTRAL, num_hidden_layers=8, sliding_window=None),
                4000,
            ),
            (
                "Mistral-7B x8 layers, window 1024",
                "MistralForCausalLM",
                dict(MISTRAL, num_hidden_layers=8, sliding_window=1024),
                4000,
            ),
            (
                "Gemma-2-2B x8 layers (window 4096)",
                "Gemma2ForCausalLM",
                dict(
                    vocab_size=256000,
                    hidden_size=2304,
                    intermediate_size=9216,
                    num_hidden_layers=8,
                    num_attention_heads=8,
                    num_key_value_heads=4,
                    head_dim=256,
                    max_position_embeddings=8192,
                ),
                4000,
            ),
            ("GPT-2 small", "GPT2LMHeadModel", dict(n_positions=1024), 900),
        ]
        for name, arch, fields, prompt_len in cases:
            ms = decode_ms(_config_dir(root, arch, **fields), prompt_len)
            rows.append({"case": name, "prompt": prompt_len, "decode_ms_per_step": ms})
    return rows


def _print(rows: list[dict]) -> None:
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json")
    parser.add_argument("--cpu-only", action="store_true", help="the KV-memory table only")
    args = parser.parse_args()
    result = {"kv_memory_32k_request": kv_memory_rows()}
    _print(result["kv_memory_32k_request"])
    if not args.cpu_only and torch.cuda.is_available():
        result["decode_batch8"] = decode_rows()
        _print(result["decode_batch8"])
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
