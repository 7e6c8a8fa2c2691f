"""Quantize / dequantize helpers shared by the quant methods (plain torch: CPU reference math).

Conventions: a linear weight is [N, K] (out, in); per-channel scales are float32 [N]; activation
scales are float32 [M, 1]; INT4 values are groupwise along K with a zero point (AWQ style).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quantization import compressed_tensors, modelopt

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MAX = 127.0
TINY = 1e-12  # all-zero rows/tokens get scale TINY instead of 0 (no division by zero)


# Rows are quantized in chunks of at most this many weights: the float32 temporaries of a large
# layer (Llama-70B's gate_up: 470M weights) stay ~256 MB each instead of several GB.
ROW_CHUNK_ELEMENTS = 1 << 26


def _row_chunks(n: int, k: int) -> Iterator[slice]:
    rows = max(1, ROW_CHUNK_ELEMENTS // max(k, 1))
    for lo in range(0, n, rows):
        yield slice(lo, min(lo + rows, n))


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: (q int8 [N, K], scale float32 [N]); w ~= q * scale."""
    q = w.new_empty(w.shape, dtype=torch.int8)
    scale = w.new_empty(w.shape[0], dtype=torch.float32)
    for rows in _row_chunks(*w.shape):
        wf = w[rows].float()
        scale[rows] = (wf.abs().amax(dim=1) / INT8_MAX).clamp_min(TINY)
        q[rows] = torch.round(wf / scale[rows, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q, scale


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 E4M3: (q [N, K], scale float32 [N]); w ~= q * scale."""
    q = w.new_empty(w.shape, dtype=FP8_DTYPE)
    scale = w.new_empty(w.shape[0], dtype=torch.float32)
    for rows in _row_chunks(*w.shape):
        wf = w[rows].float()
        scale[rows] = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(TINY)
        q[rows] = (wf / scale[rows, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] (int8 or fp8) times scale [N] -> dtype."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_per_token(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (token) activation quantization: (q [M, K], scale float32 [M, 1])."""
    qmax = FP8_MAX if qdtype == FP8_DTYPE else INT8_MAX
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(TINY)
    y = (x / scale).clamp_(-qmax, qmax)
    if qdtype == torch.int8:
        y = torch.round(y)
    return y.to(qdtype), scale


# --- INT4 groupwise (asymmetric, zero point), canonical layout: values 0..15 ---------------------

def int4_groups(k: int, group_size: int) -> int:
    """Groups along K: the last one is short when the group size does not divide K."""
    return -(-k // group_size)


def pad_to_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [..., K] with zero columns appended up to a multiple of the group size (a view of w
    when none are needed). A group's range always holds 0, so the zeros change no scale or zero
    point, and they quantize to the zero point: exactly 0 after dequantization."""
    pad = -w.shape[-1] % group_size
    return F.pad(w, (0, pad)) if pad else w


def quantize_int4_groupwise(w: torch.Tensor, group_size: int,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in 0..15, scales float32 [N, ceil(K/G)], zeros uint8 [N, ceil(K/G)]); RTN.

    w ~= (q - zero) * scale within each group of `group_size` input channels; where G does not
    divide K the last group is short (quantized as if zero-padded to G, see pad_to_groups).
    """
    n, k = w.shape
    if group_size <= 0:
        raise ValueError(f"INT4 groupwise: the group size must be positive, got {group_size}")
    groups = int4_groups(k, group_size)
    q = w.new_empty((n, k), dtype=torch.uint8)
    scale = w.new_empty((n, groups), dtype=torch.float32)
    zero = w.new_empty((n, groups), dtype=torch.uint8)
    for rows in _row_chunks(n, groups * group_size):
        g = pad_to_groups(w[rows].float(), group_size).reshape(-1, groups, group_size)
        lo = g.amin(dim=2).clamp(max=0.0)
        hi = g.amax(dim=2).clamp(min=0.0)  # the range always holds 0, so zeros stay exact
        s = ((hi - lo) / 15.0).clamp_min(1e-8)
        z = torch.round(-lo / s).clamp_(0, 15)
        qg = torch.round(g / s[..., None] + z[..., None]).clamp_(0, 15)
        q[rows] = qg.reshape(-1, groups * group_size)[:, :k]
        scale[rows], zero[rows] = s, z
    return q, scale, zero


def dequantize_int4_groupwise(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                              dtype: torch.dtype = torch.float32,
                              group_size: int | None = None) -> torch.Tensor:
    """Inverse of quantize_int4_groupwise: q [N, K], scales/zeros [N, ceil(K/G)] -> [N, K].
    uint8 zeros: w = (q - zero) * scale; float zeros (the zero point times the scale, as GGUF
    Q4_1 keeps it): w = q * scale - zero. group_size may be left out only where the groups
    divide K evenly."""
    n, k = q.shape
    groups = scales.shape[1]
    if group_size is None:
        if k % groups:
            raise ValueError(f"INT4 groupwise: {groups} groups do not divide K {k}; pass the "
                             "group size")
        group_size = k // groups
    if int4_groups(k, group_size) != groups:
        raise ValueError(f"INT4 groupwise: K {k} in groups of {group_size} needs "
                         f"{int4_groups(k, group_size)} scales a row, got {groups}")
    g = pad_to_groups(q.float(), group_size).reshape(n, groups, group_size)
    if zeros.is_floating_point():
        w = g * scales.float()[..., None] - zeros.float()[..., None]
    else:
        w = (g - zeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(n, groups * group_size)[:, :k].to(dtype).contiguous()


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K/2]: even k in the low nibble, odd k in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_rows."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


# --- AutoAWQ (GEMM) and GPTQ int32 packing -------------------------------------------------------

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def pack_int32_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8]; nibble i of each word holds column order[i]."""
    r, c = q.shape
    cols = q.to(torch.int64).reshape(r, c // 8, 8)
    word = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        word |= cols[..., col] << (4 * i)
    return _to_int32(word)


def unpack_int32_cols(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Inverse of pack_int32_cols -> uint8 [R, C]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(*packed.shape, 8, dtype=torch.uint8)
    for i, col in enumerate(order):
        out[..., col] = ((words >> (4 * i)) & 0xF).to(torch.uint8)
    return out.reshape(packed.shape[0], -1)


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 32 bits as a signed int32 (checkpoints store packed words signed)."""
    word = word & 0xFFFFFFFF
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


# --- parameters and fused-shard loading ----------------------------------------------------------

def new_param(data: torch.Tensor, output_dim: int | None = None, input_dim: int | None = None,
              weight_loader: Callable | None = None,
              dummy_value: torch.Tensor | None = None) -> nn.Parameter:
    """A frozen parameter carrying the loader attributes of QuantMethod's contract. dummy_value:
    what load_format="dummy" puts there instead of random values (shapes, group indices: random
    integers would not be a loadable checkpoint)."""
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim, p.input_dim = output_dim, input_dim
    if weight_loader is not None:
        p.weight_loader = weight_loader
    if dummy_value is not None:
        p.dummy_value = dummy_value
    return p


_DEFER_LOAD_TIME_WEIGHTS = contextvars.ContextVar("defer_load_time_weights", default=False)


@contextlib.contextmanager
def deferring_load_time_weights() -> Iterator[None]:
    """While the engine builds its model: load_time_weight() creates its tensors on the meta
    device (models/quantize_as_loaded.py gives each one storage when its layer's first tensor
    arrives and quantizes the layer when its last one is in)."""
    token = _DEFER_LOAD_TIME_WEIGHTS.set(True)
    try:
        yield
    finally:
        _DEFER_LOAD_TIME_WEIGHTS.reset(token)


def load_time_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The unquantized [n, k] weight that a method quantizes in process_after_loading: without
    storage (meta) inside deferring_load_time_weights, so the whole unquantized model never has
    to fit on the device at once; an ordinary empty tensor elsewhere (a layer built by hand)."""
    device = torch.device("meta") if _DEFER_LOAD_TIME_WEIGHTS.get() else None
    return torch.empty(n, k, dtype=dtype, device=device)


def replace_param(layer: nn.Module, name: str, data: torch.Tensor,
                  output_dim: int | None = None, input_dim: int | None = None) -> None:
    """Swap `layer.<name>` for a new parameter (frees the old storage once unreferenced)."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, new_param(data, output_dim, input_dim))


def packed_shard_loader(output_sizes: list[int], out_dim: int, pack: int = 1,
                        broadcast_scalar: bool = False) -> Callable:
    """weight_loader for a fused parameter whose output dim is packed `pack` values per element.

    broadcast_scalar: a one-element checkpoint tensor (a per-tensor scale) fills the whole shard.
    Tensor parallelism is not handled here (these checkpoints load at tp_size 1).
    """
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        dest = param.data
        if shard is not None:
            offset = sum(output_sizes[:shard]) // pack
            dest = dest.narrow(out_dim, offset, output_sizes[shard] // pack)
        if broadcast_scalar and loaded.numel() == 1:
            dest.fill_(loaded.reshape(()).item())
            return
        loaded = loaded.reshape(dest.shape) if loaded.numel() == dest.numel() else loaded
        if dest.shape != loaded.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs "
                             f"parameter slice {tuple(dest.shape)}")
        dest.copy_(loaded)

    return load


def quant_config_of(hf_config: dict | None) -> dict:
    """The checkpoint's `quantization_config` (or {} when it is not pre-quantized)."""
    return dict((hf_config or {}).get("quantization_config") or {})


# checkpoint quant_method -> slipstream method that loads it (fbgemm_fp8: Meta's FP8 Llama 3.1,
# per-channel weights and dynamic per-token activations, the fp8 method's own layout)
_CHECKPOINT_METHODS = {"int8_wo": "int8_wo", "fp8": "fp8", "fbgemm_fp8": "fp8", "awq": "int4_awq",
                       "gptq": "int4_awq", "int4_awq": "int4_awq", "w8a8_sq": "w8a8_sq"}


def detect_quant_method(hf_config: dict | None) -> str | None:
    """The method that loads a pre-quantized checkpoint (None: not quantized).

    Unknown layouts are an error rather than a silent load of packed integers as floats.
    """
    qc = quant_config_of(hf_config)
    if not qc:
        return None
    name = str(qc.get("quant_method", "")).lower()
    if name == compressed_tensors.QUANT_METHOD:  # the scheme, not the name, says which method
        return compressed_tensors.checkpoint_method(qc)
    if name == modelopt.QUANT_METHOD:  # so does ModelOpt's quant_algo
        return modelopt.checkpoint_method(qc)
    if name not in _CHECKPOINT_METHODS:
        supported = sorted([*_CHECKPOINT_METHODS, compressed_tensors.QUANT_METHOD,
                            modelopt.QUANT_METHOD])
        raise ValueError(f"checkpoint quantization_config.quant_method={name!r} is not supported; "
                         f"supported: {', '.join(supported)}")
    return _CHECKPOINT_METHODS[name]


# Checkpoint formats other engines take as a quantization name (vLLM's --quantization gptq):
# they say how the checkpoint is stored; its quantization_config says which method loads it.
CHECKPOINT_FORMATS = ("awq", "gptq", "fbgemm_fp8", "modelopt", "compressed-tensors")


def resolve_quantization(requested: str | None, hf_config: dict | None) -> str | None:
    """The method LLM(quantization=requested) runs: a method name as it is; a checkpoint format
    name (CHECKPOINT_FORMATS) as the method that loads this checkpoint, which must be stored in
    that format; None: the checkpoint's own (None when it is not pre-quantized)."""
    if requested is None or requested.lower() not in CHECKPOINT_FORMATS:
        return requested or detect_quant_method(hf_config)
    stored = str(quant_config_of(hf_config).get("quant_method", "")).lower()
    if stored != requested.lower():
        found = f"stored as {stored!r}" if stored else "not pre-quantized"
        raise ValueError(f"quantization={requested!r} names a checkpoint format, but this "
                         f"checkpoint is {found}")
    return detect_quant_method(hf_config)


def check_checkpoint_method(method: str, hf_config: dict | None) -> bool:
    """True when the checkpoint is pre-quantized for `method`; error when it is for another one."""
    found = detect_quant_method(hf_config)
    if found is None:
        return False
    if found != method:
        raise ValueError(f"quantization={method!r} asked for, but the checkpoint is already "
                         f"quantized with {found!r}; pass quantization={found!r} or None")
    return True


# --- per-input-channel scales folded into the op before each projection (AWQ, SmoothQuant) ------

ScaleFn = Callable[[str, nn.Module], torch.Tensor]


def divide_rows(linear: nn.Module, start: int, s: torch.Tensor) -> None:
    """Divide output rows start.. (and their bias) by s: the next layer's input shrinks by s."""
    w = linear.weight.data[start:]
    w.div_(s.to(w)[:, None])
    if linear.bias is not None:
        linear.bias.data[start:].div_(s.to(w))


def kv_tied_scale(s: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """o_proj's input scale [Hq*D] -> the v-row scale [Hkv*D] it comes from under GQA.

    Query heads h*rep .. h*rep+rep-1 read kv head h, so their channels must share one scale;
    anything else cannot be folded into v exactly (ValueError).
    """
    rep = num_heads // num_kv_heads
    heads = s.reshape(num_kv_heads, rep, -1)
    if not torch.equal(heads, heads[:, :1].expand_as(heads)):
        raise ValueError("o_proj scale under GQA must be equal across the query heads that share "
                         "a kv head")
    return heads[:, 0].reshape(-1)


def _fold_into_norm(norm: nn.Module, s: torch.Tensor, norm_dtype: torch.dtype | None) -> torch.Tensor:
    """norm.weight /= s; returns the scale actually applied.

    With norm_dtype (the checkpoint's float dtype), the new norm weight is rounded to it here and
    the returned scale is old / new exactly, so the linear after it can absorb the rounding:
    saving the norm in bf16 then costs nothing.
    """
    old = norm.weight.data.float()
    new = old / s
    if norm_dtype is not None:
        new = new.to(norm_dtype).float()
        s = torch.where((new != 0) & (old != 0), old / new, s)
    norm.weight.data.copy_(new.to(norm.weight))
    return s


@torch.no_grad()
def fold_layer_input_scales(layer: nn.Module, prefix: str, scale_for: ScaleFn, *,
                            gqa_o_proj: bool = False, norm_dtype: torch.dtype | None = None,
                            ) -> dict[str, torch.Tensor]:
    """One Llama decoder layer of fold_input_scales; returns {linear name: scale applied}."""
    attn, mlp = layer.self_attn, layer.mlp
    applied: dict[str, torch.Tensor] = {}

    def scale(name: str, linear: nn.Module, s: torch.Tensor) -> None:
        linear.weight.data.mul_(s.to(linear.weight)[None, :])
        applied[name] = s

    name = f"{prefix}.self_attn.qkv_proj"
    s = _fold_into_norm(layer.input_layernorm, scale_for(name, attn.qkv_proj).float(), norm_dtype)
    scale(name, attn.qkv_proj, s)
    name = f"{prefix}.mlp.gate_up_proj"
    s = _fold_into_norm(layer.post_attention_layernorm, scale_for(name, mlp.gate_up_proj).float(),
                        norm_dtype)
    scale(name, mlp.gate_up_proj, s)
    name = f"{prefix}.mlp.down_proj"
    s = scale_for(name, mlp.down_proj).float()
    scale(name, mlp.down_proj, s)
    divide_rows(mlp.gate_up_proj, mlp.gate_up_proj.output_sizes[0], s)
    v_rows = attn.qkv_proj.output_sizes[2]
    if v_rows == attn.o_proj.input_size or gqa_o_proj:
        name = f"{prefix}.self_attn.o_proj"
        s = scale_for(name, attn.o_proj).float()
        s_v = s if v_rows == attn.o_proj.input_size else kv_tied_scale(
            s, attn.attn.num_heads, attn.attn.num_kv_heads)
        scale(name, attn.o_proj, s)
        divide_rows(attn.qkv_proj, attn.qkv_proj.output_size - v_rows, s_v)
    return applied


@torch.no_grad()
def fold_input_scales(model: nn.Module, scale_for: ScaleFn, *, gqa_o_proj: bool = False,
                      norm_dtype: torch.dtype | None = None) -> None:
    """Llama family: for qkv, gate_up, down and o, s = scale_for(name, linear) multiplies the
    linear's input channels and divides the op before it (the norm weight; for down, the up half
    of gate_up, since act(gate) * up is linear in up; for o, v's rows). The float model computes
    the same function; only quantization sees s.

    o under GQA (one v row feeds several o channels) only with gqa_o_proj, and then scale_for
    must return a scale tied across the query heads of each kv head (kv_tied_scale). norm_dtype:
    see _fold_into_norm.
    """
    for i, layer in enumerate(model.model.layers):
        fold_layer_input_scales(layer, f"model.layers.{i}", scale_for, gqa_o_proj=gqa_o_proj,
                                norm_dtype=norm_dtype)
