"""HF FP8 checkpoint layouts: layers left float (`modules_to_not_convert` / `ignored_layers`),
block-wise scales (`weight_block_size`, Qwen3 / DeepSeek FP8) and Meta's `fbgemm_fp8`.

Each test writes a tiny_llama_dir checkpoint in the layout under test and a reference holding the values
the engine should end up with; measure of equality (unless stated): the 16 greedy tokens of 4
prompts and, teacher-forced, the logprob of each of them, bit for bit (CPU reference math).
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slipstream.quantization import fp8, fp8_layouts
from slipstream.quantization.base import UnquantizedLinearMethod
from slipstream.quantization.fp8 import Fp8LinearMethod
from slipstream.quantization.utils import (
    FP8_DTYPE,
    FP8_MAX,
    check_checkpoint_method,
    detect_quant_method,
    quantize_fp8_per_channel,
)
from tests.helpers import rel_err
from tests.quantization.checkpoint_io import (
    greedy_and_scores,
    llama_hf_config,
    load_llm,
    quantized_layers,
    save_checkpoint,
    teacher_forced,
)

LINEAR = re.compile(r"(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj)\.weight$")
# Not multiples of either block dim in the tiny_llama_dir model (hidden 64, kv 32, intermediate 128), and
# rows != cols so a transposed block grid shows.
BLOCK = (48, 40)

# module name -> its tensors ({leaf: tensor}), or None: keep the float weight.
Convert = Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None]


def write_checkpoint(src: Path, out: Path, quant_config: dict | None, convert: Convert) -> Path:
    """src's checkpoint with every linear layer's weight replaced by convert(module, weight)."""
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        m = LINEAR.match(name)
        converted = convert(m.group(1), t) if m else None
        if converted is None:
            tensors[name] = t
        else:
            tensors.update({f"{m.group(1)}.{leaf}": v for leaf, v in converted.items()})
    return save_checkpoint(src, out, tensors, quant_config)


def per_channel(keep_float: frozenset[str] = frozenset(), scale_shape: str = "[N]",
                scale_dtype: torch.dtype = torch.float32) -> Convert:
    """fp8 weight + per-channel weight_scale ([N] as AutoFP8 writes it, [N, 1] as fbgemm does)."""
    def convert(module: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if module in keep_float:
            return None
        _, scale = quantize_fp8_per_channel(w)
        scale = scale.to(scale_dtype).float()  # representable in the checkpoint's dtype
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        stored = scale[:, None] if scale_shape == "[N, 1]" else scale
        return {"weight": q, "weight_scale": stored.to(scale_dtype)}

    return convert


def _float_weight(weights: dict[str, torch.Tensor], layer: str, leaf: str = ".weight"
                  ) -> torch.Tensor:
    """A slipstream layer's weight from {checkpoint module + leaf: weight} (fused shards in order)."""
    parent, _, name = layer.rpartition(".")
    subs = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return torch.cat([weights[f"{parent}.{sub}{leaf}"] for sub in subs.get(name, [name])])


def _make_float(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """Turn a loaded fp8 layer into the float one the checkpoint's list asks for."""
    layer.quant_method = UnquantizedLinearMethod()
    layer._parameters.pop("weight_scale", None)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)


# --- modules_to_not_convert / ignored_layers -------------------------------------------------------

# Entries as checkpoints write them: full module names (q/k/v of layer 0: the fused qkv_proj
# is float), a module prefix (layer 1's whole MLP) and a name without its leading parts.
NOT_CONVERTED = ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                 "model.layers.0.self_attn.v_proj", "model.layers.1.mlp", "layers.0.self_attn.o_proj"]
FLOAT_MODULES = frozenset({"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                           "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj",
                           "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj",
                           "model.layers.1.mlp.down_proj"})
FLOAT_LAYERS = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj")


@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])
def test_not_converted_layers_stay_float(tiny_llama_dir, prompts, tmp_path, key) -> None:
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", key: NOT_CONVERTED}
    path = write_checkpoint(tiny_llama_dir, tmp_path / "mixed", qc, per_channel(FLOAT_MODULES))
    llm = load_llm(path)
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    for name, layer in quantized_layers(llm).items():
        if name in FLOAT_LAYERS:
            assert type(layer.quant_method) is UnquantizedLinearMethod, name
            assert "weight_scale" not in layer._parameters, name
            assert torch.equal(layer.weight, _float_weight(original, name)), name
        else:
            assert isinstance(layer.quant_method, Fp8LinearMethod), name
            assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    # The same function as the all-fp8 checkpoint with those layers made float by hand.
    all_fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    want = load_llm(write_checkpoint(tiny_llama_dir, tmp_path / "all", all_fp8, per_channel()))
    for name, layer in quantized_layers(want).items():
        if name in FLOAT_LAYERS:
            _make_float(layer, _float_weight(original, name))
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(want, prompts)


def test_not_converted_names_match_whole_dotted_parts() -> None:
    qc = {"quant_method": "fp8", "modules_to_not_convert": ["model.layers.1", "o_proj",
                                                            "model.layers.*.mlp.up_proj"]}
    quantized = lambda prefix: isinstance(fp8.make_fp8(llama_hf_config(qc))(prefix), Fp8LinearMethod)  # noqa: E731
    assert not quantized("model.layers.1.mlp.down_proj")
    assert quantized("model.layers.10.mlp.down_proj")  # "layers.1" is not a prefix of "layers.10"
    assert not quantized("model.layers.3.self_attn.o_proj")
    assert quantized("model.layers.3.self_attn.qkv_proj")
    assert quantized("model.layers.3.mlp.down_proj")
    with pytest.raises(ValueError, match="only some of the modules fused into "
                                         r"model\.layers\.3\.mlp\.gate_up_proj"):
        quantized("model.layers.3.mlp.gate_up_proj")  # up_proj listed, gate_proj not


def test_partly_listed_fused_layer_is_an_error(tiny_llama_dir, tmp_path) -> None:
    qc = {"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.k_proj"]}
    path = write_checkpoint(tiny_llama_dir, tmp_path / "k", qc,
                            per_channel(frozenset({"model.layers.0.self_attn.k_proj"})))
    with pytest.raises(ValueError, match=r"only some of the modules fused into "
                                         r"model\.layers\.0\.self_attn\.qkv_proj.*k_proj: float"):
        load_llm(path)


# --- block-wise scales (weight_block_size) ---------------------------------------------------------

def block_quantize(w: torch.Tensor, block: tuple[int, int], gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], weight_scale_inv [ceil(N/rows), ceil(K/cols)]), block by block. Each block's
    values are first scaled by a random factor, so block scales differ a lot and a block that
    lands on the wrong rows or columns shows as a large error."""
    rows, cols = block
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    scale_inv = torch.empty(-(-n // rows), -(-k // cols))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float()
            tile = tile * torch.empty(()).uniform_(0.5, 2.0, generator=gen)
            scale_inv[i, j] = (tile.abs().amax() / FP8_MAX).clamp_min(1e-12)
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (tile / scale_inv[i, j]).to(FP8_DTYPE)
    return q, scale_inv


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = block
    w = q.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] *= scale_inv[i, j]
    return w


def write_block_checkpoints(src: Path, out: Path, block: tuple[int, int] = BLOCK,
                            config_block: list[int] | None = None) -> tuple[Path, dict]:
    """(block-wise checkpoint as Qwen3-FP8 writes it, {module: its block-dequantized weight})."""
    gen = torch.Generator().manual_seed(1)
    dequantized: dict[str, torch.Tensor] = {}

    def convert(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale_inv = block_quantize(w, block, gen)
        dequantized[module] = block_dequantize(q, scale_inv, block)
        return {"weight": q, "weight_scale_inv": scale_inv}

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": config_block or list(block), "modules_to_not_convert": ["lm_head"]}
    return write_checkpoint(src, out, qc, convert), dequantized


def test_block_checkpoint_loads_requantized_per_channel(tiny_llama_dir, prompts, tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=fp8_layouts.__name__):
        path, dequantized = write_block_checkpoints(tiny_llama_dir, tmp_path / "block")
        llm = load_llm(path)
    assert detect_quant_method(json.loads((path / "config.json").read_text())) == "fp8"
    notes = [r for r in caplog.records if "requantized per output channel" in r.getMessage()]
    assert len(notes) == 1 and "[48, 40]" in notes[0].getMessage()
    for name, layer in quantized_layers(llm).items():
        assert isinstance(layer.quant_method, Fp8LinearMethod), name
        assert "weight_scale_inv" not in layer._parameters, name
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.output_size,)
        want = _float_weight(dequantized, name, leaf="")
        # Exactly the per-channel quantization of the block-dequantized weight ...
        q, scale = quantize_fp8_per_channel(want)
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, scale), name
        # ... so within one FP8 E4M3 rounding of it: half a step is at most 2^-4 of a normal
        # value, and 2^-10 * scale for subnormal ones.
        got = layer.weight.float() * layer.weight_scale[:, None]
        bound = want.abs() / 16 + layer.weight_scale[:, None] / 1024
        assert bool(((got - want).abs() <= bound).all()), name
        assert rel_err(got, want) < 0.03, name


def test_block_checkpoint_matches_requantized_and_float_models(tiny_llama_dir, prompts, tmp_path) -> None:
    path, dequantized = write_block_checkpoints(tiny_llama_dir, tmp_path / "block")
    llm = load_llm(path)
    tokens, logprobs = greedy_and_scores(llm, prompts)
    # Bit for bit: a per-channel checkpoint holding the requantized values.
    requantized = write_checkpoint(tiny_llama_dir, tmp_path / "channel", {"quant_method": "fp8"},
                                   lambda m, w: dict(zip(("weight", "weight_scale"),
                                                         quantize_fp8_per_channel(dequantized[m]))))
    assert (tokens, logprobs) == greedy_and_scores(load_llm(requantized), prompts)
    # Close to the float model of the block-dequantized weights, teacher-forced on its greedy
    # tokens (free-running greedy tokens diverge at the first flip, and FP8 noise flips the
    # near-flat top-1 of this random model often: a plain per-channel FP8 copy of it scores
    # ~0.14 / 81% against its float model). Measured here ~0.24 / 70%; loads with the block
    # grid flipped or one scale per layer score 1.5-2.3 / 6-14%.
    float_llm = load_llm(write_checkpoint(tiny_llama_dir, tmp_path / "float", None,
                                      lambda m, w: {"weight": dequantized[m]}))
    float_tokens, float_logprobs = greedy_and_scores(float_llm, prompts)
    forced = teacher_forced(llm, prompts, float_tokens)
    gap = sum(abs(lp - want) for (lp, _), want in zip(forced, float_logprobs)) / len(forced)
    top1 = sum(is_top for _, is_top in forced) / len(forced)
    assert gap < 0.5 and top1 >= 0.5, (gap, top1)


def test_requantize_in_chunks_equals_whole_shard_math() -> None:
    """Several chunks per fused shard, shards not multiples of the block rows (70 = 4 * 16 + 6,
    33 = 2 * 16 + 1), K not one of the block cols: the same as requantizing each whole shard."""
    gen = torch.Generator().manual_seed(2)
    block, sizes = (16, 24), [70, 33]
    shards = [block_quantize(torch.randn(n, 50, generator=gen), block, gen) for n in sizes]
    layer = torch.nn.Module()
    layer.output_sizes = sizes
    layer.weight = torch.nn.Parameter(torch.cat([q for q, _ in shards]), requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(torch.cat([s for _, s in shards]),
                                                requires_grad=False)
    fp8_layouts.requantize_blocks_per_channel(layer, block, chunk_rows=32)
    q, scale = quantize_fp8_per_channel(torch.cat([block_dequantize(q, s, block) for q, s in shards]))
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale)
    assert "weight_scale_inv" not in layer._parameters


def test_block_size_not_the_tensors_is_a_clear_error(tiny_llama_dir, tmp_path) -> None:
    path, _ = write_block_checkpoints(tiny_llama_dir, tmp_path / "block", config_block=[64, 64])
    with pytest.raises(ValueError, match=r"weight_scale_inv.*weight_block_size \[64, 64\]"):
        load_llm(path)


@pytest.mark.parametrize("block", [[128], [0, 128], "128x128"])
def test_bad_weight_block_size_is_a_clear_error(block) -> None:
    qc = {"quant_method": "fp8", "weight_block_size": block}
    with pytest.raises(ValueError, match="weight_block_size must be"):
        fp8.make_fp8(llama_hf_config(qc))


# --- fbgemm_fp8 (Meta's FP8 Llama 3.1) -------------------------------------------------------------

FBGEMM_FLOAT = frozenset({"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                          "model.layers.0.mlp.down_proj"})
FBGEMM_CONFIG = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                 "modules_to_not_convert": sorted(FBGEMM_FLOAT) + ["lm_head"]}


@pytest.mark.parametrize(("quantization", "scale_dtype"), [(None, torch.bfloat16),
                                                           ("fp8", torch.float32)])
def test_fbgemm_checkpoint_matches_fp8_checkpoint(tiny_llama_dir, prompts, tmp_path, quantization,
                                                  scale_dtype) -> None:
    assert detect_quant_method(llama_hf_config(FBGEMM_CONFIG)) == "fp8"
    path = write_checkpoint(tiny_llama_dir, tmp_path / "fbgemm", FBGEMM_CONFIG,
                            per_channel(FBGEMM_FLOAT, "[N, 1]", scale_dtype))
    llm = load_llm(path, quantization)
    layers = quantized_layers(llm)
    assert type(layers["model.layers.0.mlp.gate_up_proj"].quant_method) is UnquantizedLinearMethod
    qkv = layers["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv.quant_method, Fp8LinearMethod) and not qkv.quant_method.static_input_scale
    ckpt = load_file(str(path / "model.safetensors"))
    want = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"])
    assert qkv.weight_scale.dtype == torch.float32  # [N, 1] checkpoint scales land as [N]
    assert torch.equal(qkv.weight_scale, want.float().reshape(-1))
    # The same values as a `quant_method: fp8` per-channel checkpoint.
    fp8_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "modules_to_not_convert": FBGEMM_CONFIG["modules_to_not_convert"]}
    reference = write_checkpoint(tiny_llama_dir, tmp_path / "fp8", fp8_config,
                                 per_channel(FBGEMM_FLOAT, "[N]", scale_dtype))
    assert greedy_and_scores(llm, prompts) == greedy_and_scores(load_llm(reference), prompts)


def test_fbgemm_checkpoint_with_input_scale_ub_loads(tiny_llama_dir, prompts, tmp_path) -> None:
    channel = per_channel(FBGEMM_FLOAT, "[N, 1]")

    def with_ub(module: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
        tensors = channel(module, w)
        return tensors and {**tensors, "input_scale_ub": torch.tensor([1200.0])}

    path = write_checkpoint(tiny_llama_dir, tmp_path / "ub", FBGEMM_CONFIG, with_ub)
    plain = write_checkpoint(tiny_llama_dir, tmp_path / "plain", FBGEMM_CONFIG, channel)
    assert greedy_and_scores(load_llm(path), prompts) == greedy_and_scores(load_llm(plain), prompts)


def test_fbgemm_checkpoint_is_not_another_method() -> None:
    with pytest.raises(ValueError, match="already quantized with 'fp8'"):
        check_checkpoint_method("int8_wo", llama_hf_config(FBGEMM_CONFIG))
