"""GPU speed of each quantization method at one model's shapes (the accuracy table's companion).

    python scripts/bench_quant_speed.py [--model DIR_OR_GGUF] [--fp8-keep-checkpoint DIR]

Each row: greedy decode of random prompts (128 in, 128 out, ignore_eos) at batch 1 and 32,
output tokens per second, bf16 measured in the same run. The fp8_keep row needs a checkpoint
written by `slipstream quantize --method fp8 --keep-float N`.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

ROWS = (("bf16", None), ("int8_wo", "int8_wo"), ("fp8", "fp8"), ("w8a8_sq", "w8a8_sq"))


def decode_rate(llm, batch: int, input_len: int, output_len: int, vocab: int) -> float:
    from slipstream import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (input_len,), generator=g).tolist()}
               for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: graphs, tuning
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * output_len / (time.perf_counter() - t0)


def main() -> None:
    from slipstream import LLM
    from slipstream.assets.smollm2 import default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--fp8-keep-checkpoint", default=None)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    model = args.model or str(default_model())
    rows = [(name, model, q) for name, q in ROWS]
    if args.fp8_keep_checkpoint:
        rows.append(("fp8_keep", args.fp8_keep_checkpoint, None))
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for name, path, quantization in rows:
        llm = LLM(model=path, quantization=quantization, device="cuda")
        vocab = llm.engine_config.model.vocab_size
        rates = {b: decode_rate(llm, b, 128, 128, vocab) for b in batches}
        results.append({"method": name, "tok_s": rates})
        print(f"{name:<10}" + "".join(f"  batch {b}: {r:9.1f} tok/s" for b, r in rates.items()),
              flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = results[0]["tok_s"]
    print(f"\n{'method':<10}" + "".join(f"{'b' + str(b) + ' x bf16':>14}" for b in batches))
    for row in results:
        print(f"{row['method']:<10}" + "".join(f"{row['tok_s'][b] / base[b]:>14.2f}"
                                              for b in batches))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "gpu": torch.cuda.get_device_name(), "rows": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
