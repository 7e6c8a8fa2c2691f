"""Tiny pre-quantized checkpoints on disk, and what an engine makes of them: shared by the tests
of the checkpoint formats (compressed-tensors, FP8 variants)."""
from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from slipstream import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SCORE = SamplingParams(max_tokens=1, prompt_logprobs=1)


def save_checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor],
                    quant_config: dict | None) -> Path:
    """src's checkpoint (config, tokenizer) with `tensors` and `quant_config` (None: float)."""
    out.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def load_llm(path: Path, quantization: str | None = None) -> LLM:
    return LLM(str(path), quantization=quantization, kv_cache_memory=16 << 20)


def quantized_layers(llm: LLM) -> dict[str, torch.nn.Module]:
    """The model's linear layers (each has a quant_method) by module name."""
    model = llm.engine.runner.model
    return {n: m for n, m in model.named_modules() if hasattr(m, "quant_method")}


def teacher_forced(llm: LLM, prompts: list[list[int]], tokens: list[list[int]]
                   ) -> list[tuple[float, bool]]:
    """(logprob, is it the model's top-1?) of each of `tokens`, fed its prompt and predecessors."""
    scored = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, tokens)], SCORE,
                          use_tqdm=False)
    out = []
    for p, c, o in zip(prompts, tokens, scored):
        for i, tok in enumerate(c):
            candidates = o.prompt_logprobs[len(p) + i]  # the token and the top-1
            out.append((candidates[tok], max(candidates, key=candidates.get) == tok))
    return out


def greedy_and_scores(llm: LLM, prompts: list[list[int]]
                      ) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens (GREEDY), and each one's teacher-forced logprob."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [lp for lp, _ in teacher_forced(llm, prompts, tokens)]


def llama_hf_config(quant_config: dict) -> dict:
    """The parts of a Llama config.json the quant-method factories read."""
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": quant_config}


def compressed_tensors_config(weights: dict, activations: dict | None, ignore: list[str] | None,
                              fmt: str, **extra) -> dict:
    """A one-group compressed-tensors quantization_config as llm-compressor writes it."""
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations,
             "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"] if ignore is None else ignore,
            "kv_cache_scheme": None, "version": "0.10.2", **extra}


def run_quantize_cli(argv: list[str]) -> int:
    """`slipstream quantize ARGV` in this process; its exit code."""
    from slipstream.quantization.cli import add_quantize_parser

    parser = argparse.ArgumentParser()
    add_quantize_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(argv)
    return ns.func(ns)


def write_int4_layout(src: Path, dst: Path, layout: str, group: int,
                      is_projection: Callable[[str], bool]) -> Path:
    """src re-saved with every tensor `is_projection` names RTN-quantized in groups of `group`
    (-1: one group per row, GPTQ's "no groups"), in the AWQ GEMM or GPTQ (v1) layout."""
    from safetensors.torch import load_file

    from slipstream.quantization import utils as qu

    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not is_projection(name):
            tensors[name] = t
            continue
        k = t.shape[1]
        q, scales, zeros = qu.quantize_int4_groupwise(t, group if group > 0 else k)
        base = name.removesuffix(".weight")
        if layout == "awq":
            tensors[f"{base}.qweight"] = qu.pack_int32_cols(q.t().contiguous(), qu.AWQ_ORDER)
            tensors[f"{base}.qzeros"] = qu.pack_int32_cols(zeros.t().contiguous(), qu.AWQ_ORDER)
        else:  # GPTQ v1: packed along K, zeros stored minus one (mod 16), trivial g_idx
            tensors[f"{base}.qweight"] = qu.pack_int32_cols(q).t().contiguous()
            z = ((zeros.to(torch.int16) - 1) & 0xF).to(torch.uint8)
            tensors[f"{base}.qzeros"] = qu.pack_int32_cols(z.t().contiguous())
            tensors[f"{base}.g_idx"] = (torch.arange(k) // (group if group > 0 else k)).to(torch.int32)
        tensors[f"{base}.scales"] = scales.t().contiguous().half()
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if layout == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": group < 0,
         "sym": False})
    (dst / "config.json").write_text(json.dumps(config))
    return dst
