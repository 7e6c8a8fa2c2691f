"""AWQ for the Llama family (Lin et al., 2023): per decoder layer, input-channel scales chosen to
minimise each block's OUTPUT error under INT4 round-to-nearest and folded into the op before
(the float function is unchanged), then a clipping range per weight group. The final rounding
is int4_awq's round-to-nearest (process_after_loading), or GPTQ's (gptq.py) on the same
layer-by-layer calibration inputs, AWQ's scales applied first.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from slipstream.quantization import utils as qu
from slipstream.quantization.gptq import GptqOptions, gptq_quantize, install_int4, sink_weighted_gram

logger = logging.getLogger(__name__)

SCALE_GRID = 20  # s = x_mean^a / w_mean^(1-a), a = 0, 1/20, ..., 19/20; plus s = 1 (plain RTN)
CLIP_GRID, CLIP_MAX_SHRINK = 20, 0.5  # each end of a group's range times 1 - i/20, i < 10
SEARCH_TOKENS = 32768  # calibration tokens per layer: statistics, o / down scales, clipping
BLOCK_TOKENS = 4096  # of those, the ones qkv / gate_up scales are scored on through their block
_NORM_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")

Loss = Callable[[torch.Tensor], float]  # fake-quantized weight -> output error


def fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] as the int4_awq layer computes with it: quantize_int4_groupwise, then
    dequantized with the float16 scales the checkpoint stores (float ops only: fast). A short
    last group is quantized as if zero-padded (utils.pad_to_groups); group_size None or <= 0:
    per channel."""
    n, k = w.shape
    group_size = row_group(group_size, k)
    g = qu.pad_to_groups(w.float(), group_size).reshape(n, -1, group_size)
    lo = g.amin(dim=2, keepdim=True).clamp(max=0.0)
    hi = g.amax(dim=2, keepdim=True).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8)
    zero = torch.round(-lo / scale).clamp_(0, 15)
    q = torch.round(g / scale + zero).clamp_(0, 15)
    return ((q - zero) * scale.half().float()).reshape(n, -1)[:, :k]


def row_group(group_size: int | None, k: int) -> int:
    """The group size for a row of K: None or <= 0 is per channel, one group of K."""
    return group_size if group_size and group_size > 0 else k


def pack_blocks(prompts: list[list[int]], seq_len: int, max_tokens: int) -> torch.Tensor:
    """[B, T] token ids: all prompts concatenated and cut into T-token blocks (AutoAWQ's packing),
    at most max_tokens in all, the blocks spread evenly over the calibration set."""
    ids = [t for p in prompts for t in p]
    if not ids:
        raise ValueError("AWQ: no calibration tokens")
    t = min(seq_len, len(ids))
    n = len(ids) // t
    b = max(1, min(n, max_tokens // t))
    return torch.tensor([ids[j * t:(j + 1) * t] for j in (i * n // b for i in range(b))])


# --- the float forward of one decoder layer, with swappable projection weights -----------------

@dataclass
class LayerInputs:
    """Float inputs and outputs of one decoder layer's projections, [B, T, *] each."""

    attn_in: torch.Tensor  # after input_layernorm: qkv's input
    ctx: torch.Tensor  # attention output: o's input
    attn_out: torch.Tensor
    mlp_in: torch.Tensor  # after post_attention_layernorm: gate_up's input
    act: torch.Tensor  # silu(gate) * up: down's input
    mlp_out: torch.Tensor


def _bias(linear: nn.Module) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of x [B, T, H, D] by cos / sin [T, R/2] (kernels.reference.apply_rotary):
    the first R dims of each head (all of them but with partial rotary)."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_ctx(attn: nn.Module, x: torch.Tensor, w_qkv: torch.Tensor,
                  cos_sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of x [B, T, H] with qkv weight w_qkv -> [B, T, Hq*D] (o's input)."""
    b, t, _ = x.shape
    a = attn.attn
    hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
    q, k, v = F.linear(x, w_qkv, _bias(attn.qkv_proj)).split(
        [attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k, v = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
    if attn.q_norm is not None:  # Qwen3: RMSNorm per head before RoPE
        q = attn.q_norm.forward_heads(q.reshape(b * t, hq, d)).reshape(b, t, hq, d)
        k = attn.k_norm.forward_heads(k.reshape(b * t, hkv, d)).reshape(b, t, hkv, d)
    cos, sin = cos_sin[:t].chunk(2, dim=-1)
    q, k = _rope(q, cos, sin).transpose(1, 2), _rope(k, cos, sin).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=a.scale,
                                         enable_gqa=hq != hkv)  # q head h reads kv h // rep
    return out.transpose(1, 2).reshape(b, t, hq * d)


def gated_act(mlp: nn.Module, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w_gate_up, _bias(mlp.gate_up_proj)).chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_inputs(layer: nn.Module, h: torch.Tensor, cos_sin: torch.Tensor,
                 weights: dict[str, torch.Tensor] | None = None,
                 ) -> tuple[LayerInputs, torch.Tensor]:
    """The float layer on the residual stream h [B, T, H]: its projections' inputs, and h after.
    weights: {projection name: weight} in place of the layer's own (a quantized one's twin)."""
    attn, mlp = layer.self_attn, layer.mlp
    w = {leaf: layer.get_submodule(leaf).weight.float() for leaf in PROJECTIONS
         if leaf not in (weights or {})}
    w.update(weights or {})
    attn_in = layer.input_layernorm(h)
    ctx = attention_ctx(attn, attn_in, w["self_attn.qkv_proj"], cos_sin)
    attn_out = F.linear(ctx, w["self_attn.o_proj"], _bias(attn.o_proj))
    h = h + attn_out
    mlp_in = layer.post_attention_layernorm(h)
    act = gated_act(mlp, mlp_in, w["mlp.gate_up_proj"])
    mlp_out = F.linear(act, w["mlp.down_proj"], _bias(mlp.down_proj))
    return LayerInputs(attn_in, ctx, attn_out, mlp_in, act, mlp_out), h + mlp_out


def quantized_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's GPTQ-rounded projections, dequantized (float32)."""
    from slipstream.quantization.int4_awq import dequantize_layer  # int4_awq imports this module

    return {leaf: dequantize_layer(layer.get_submodule(leaf), torch.float32)
            for leaf in PROJECTIONS if "qweight" in layer.get_submodule(leaf)._parameters}


# --- scale search ---------------------------------------------------------------------------------

def gram(x: torch.Tensor) -> torch.Tensor:
    """X^T X / M over the rows of x [..., K]: a linear layer's output error is quadratic in it."""
    x = x.reshape(-1, x.shape[-1]).float()
    return x.t() @ x / x.shape[0]


def gram_loss(w: torch.Tensor, sigma: torch.Tensor) -> Loss:
    """Mean squared output error of a weight wq replacing w, for inputs of Gram matrix sigma."""
    return lambda wq: (((wq - w) @ sigma) * (wq - w)).sum().item() / w.shape[0]


def mse_to(want: torch.Tensor) -> Callable[[torch.Tensor], float]:
    return lambda got: (got - want).pow(2).mean().item()


def weight_absmean(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel: mean over output rows of |w| relative to its group's max |w|."""
    n, k = w.shape
    group_size = row_group(group_size, k)
    g = qu.pad_to_groups(w.abs(), group_size).reshape(n, -1, group_size)
    g = g / g.amax(dim=2, keepdim=True).clamp_min(1e-8)
    return g.reshape(n, -1)[:, :k].mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor,
                     grid: int = SCALE_GRID) -> Iterator[torch.Tensor]:
    """s = 1 (round-to-nearest) first, then x_mean^a / w_mean^(1-a), normalised so that
    sqrt(max * min) = 1, for a on the grid."""
    yield torch.ones_like(x_mean)
    for i in range(grid):
        a = i / grid
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp_min(1e-4)
        yield s / (s.max() * s.min()).sqrt()


@dataclass(frozen=True)
class HeadTie:
    """o_proj under GQA: query heads h*rep .. h*rep+rep-1 read kv head h, so their input channels
    share one scale (it is folded into v's rows)."""

    num_heads: int
    num_kv_heads: int

    def reduce(self, v: torch.Tensor) -> torch.Tensor:  # [Hq*D] -> [Hkv*D], mean over the rep
        rep = self.num_heads // self.num_kv_heads
        return v.reshape(self.num_kv_heads, rep, -1).mean(dim=1).reshape(-1)

    def expand(self, v: torch.Tensor) -> torch.Tensor:  # [Hkv*D] -> [Hq*D]
        rep = self.num_heads // self.num_kv_heads
        return v.reshape(self.num_kv_heads, 1, -1).expand(-1, rep, -1).reshape(-1)


def search_scale(w: torch.Tensor, x_mean: torch.Tensor, loss: Loss, group_size: int,
                 tie: HeadTie | None = None, grid: int = SCALE_GRID,
                 ) -> tuple[torch.Tensor, float, float]:
    """The candidate scale whose fake-quantized weight (w * s -> RTN -> / s) gives the least loss.

    x_mean: mean |input| per input channel of w. Returns (scale, its loss, the loss of s = 1);
    s = 1 is a candidate, so the search never does worse than round-to-nearest on its tokens.
    """
    w_mean = weight_absmean(w, group_size)
    if tie is not None:
        x_mean, w_mean = tie.reduce(x_mean), tie.reduce(w_mean)
    best, best_err, rtn_err = torch.ones_like(w[0]), float("inf"), float("inf")
    for i, s in enumerate(candidate_scales(x_mean, w_mean, grid)):
        s = tie.expand(s) if tie is not None else s
        err = loss(fake_quant(w * s, group_size) / s)
        rtn_err = err if i == 0 else rtn_err
        if err < best_err:
            best, best_err = s, err
    return best, best_err, rtn_err


def search_layer_scales(layer: nn.Module, inp: LayerInputs, grams: dict[str, torch.Tensor],
                        cos_sin: torch.Tensor, group_size: int, block_tokens: int = BLOCK_TOKENS,
                        grid: int = SCALE_GRID) -> dict[str, torch.Tensor]:
    """AWQ's four scale groups of a decoder layer, each scored on its block's output: qkv
    (folded into input_layernorm) on the attention output, gate_up (into
    post_attention_layernorm) on the MLP output, o (into v's rows) and down (into up's rows) on
    their own outputs, exactly, through the Gram matrix of all the search tokens."""
    attn, mlp = layer.self_attn, layer.mlp
    b, t = inp.attn_in.shape[:2]
    sub = torch.linspace(0, b - 1, max(1, min(b, block_tokens // t))).long()  # spread blocks
    attn_in, mlp_in = inp.attn_in[sub], inp.mlp_in[sub]
    w_o, w_down = attn.o_proj.weight.float(), mlp.down_proj.weight.float()
    attn_err, mlp_err = mse_to(inp.attn_out[sub]), mse_to(inp.mlp_out[sub])
    qkv_loss = lambda w: attn_err(  # noqa: E731
        F.linear(attention_ctx(attn, attn_in, w, cos_sin), w_o, _bias(attn.o_proj)))
    gate_up_loss = lambda w: mlp_err(  # noqa: E731
        F.linear(gated_act(mlp, mlp_in, w), w_down, _bias(mlp.down_proj)))
    groups = {
        "self_attn.qkv_proj": (attn.qkv_proj, inp.attn_in, None, qkv_loss),
        "self_attn.o_proj": (attn.o_proj, inp.ctx, HeadTie(attn.attn.num_heads,
                             attn.attn.num_kv_heads), gram_loss(w_o, grams["self_attn.o_proj"])),
        "mlp.gate_up_proj": (mlp.gate_up_proj, inp.mlp_in, None, gate_up_loss),
        "mlp.down_proj": (mlp.down_proj, inp.act, None,
                          gram_loss(w_down, grams["mlp.down_proj"])),
    }
    scales = {}
    for leaf, (linear, x, tie, loss) in groups.items():
        x_mean = x.abs().reshape(-1, x.shape[-1]).mean(dim=0)
        s, err, rtn = search_scale(linear.weight.float(), x_mean, loss, group_size, tie, grid)
        logger.debug("%s: output error %.4g, round-to-nearest %.4g", leaf, err, rtn)
        scales[leaf] = s
    return scales


# --- clipping search ------------------------------------------------------------------------------

def group_grams(sigma: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [G, g, g] diagonal blocks of a [K, K] Gram matrix: each group's own inputs."""
    return torch.stack([sigma[i:i + group_size, i:i + group_size]
                        for i in range(0, sigma.shape[0], group_size)])


def clip_candidates(grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (a, b) [C] for a group's [min * a, max * b] range: every pair of 1 - i/grid,
    i < max_shrink * grid; (1, 1), no clipping, first."""
    f = torch.tensor([1 - i / grid for i in range(max(1, int(max_shrink * grid)))])
    a, b = torch.meshgrid(f, f, indexing="ij")
    return a.reshape(-1), b.reshape(-1)


def search_clip(w: torch.Tensor, sigma: torch.Tensor, group_size: int, grid: int = CLIP_GRID,
                max_shrink: float = CLIP_MAX_SHRINK, max_elems: int = 1 << 25,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) of w [N, K], the clipping range [lo, hi] ([N, G, 1] each) that lowers the
    row's output error for inputs of Gram matrix sigma [K, K]: each group's best range on its
    own partial products first (AutoAWQ's criterion), then one pass over the groups with the
    other groups' errors in the loss (the cross terms of sigma). A row never ends up worse than
    without clipping. Rows go in chunks of at most max_elems candidate weights. A short last
    group is searched zero-padded (the pad's zero inputs add no error).
    """
    group_size = row_group(group_size, w.shape[1])
    w, pad = qu.pad_to_groups(w, group_size), -sigma.shape[0] % group_size
    sigma = F.pad(sigma, (0, pad, 0, pad))
    a, b = clip_candidates(grid, max_shrink)
    rows = max(1, max_elems // (a.numel() * w.shape[1]))
    ranges = [_clip_chunk(w[r:r + rows].float(), sigma.float(), group_size, a.to(w.device),
                          b.to(w.device)) for r in range(0, w.shape[0], rows)]
    return torch.cat([lo for lo, _ in ranges]), torch.cat([hi for _, hi in ranges])


def _clip_chunk(w: torch.Tensor, sigma: torch.Tensor, g: int, a: torch.Tensor,
                b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r, k = w.shape
    c, groups = a.numel(), k // g
    wg = w.reshape(r, groups, g)
    lo = wg.amin(dim=2, keepdim=True).clamp(max=0.0)[None] * a[:, None, None, None]  # [C,R,G,1]
    hi = wg.amax(dim=2, keepdim=True).clamp(min=0.0)[None] * b[:, None, None, None]
    clipped = torch.maximum(torch.minimum(wg[None], hi), lo)
    d = fake_quant(clipped.reshape(-1, k), g).reshape(c, r, groups, g) - wg[None]  # residuals
    self_err = torch.einsum("crgk,gkl,crgl->crg", d, group_grams(sigma, g), d)
    pick = self_err.argmin(dim=0)  # [R, G]
    none = torch.zeros_like(pick)
    pick = torch.where((_row_err(d, pick, sigma) <= _row_err(d, none, sigma))[:, None], pick, none)
    pick = _cross_pass(d, self_err, sigma, pick)
    index = pick[None, :, :, None]
    return lo.expand(c, r, groups, 1).gather(0, index)[0], hi.expand(c, r, groups, 1).gather(
        0, index)[0]


def _chosen(d: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """The picked candidate's residual per (row, group): d [C, R, G, g], pick [R, G] -> [R, G, g]."""
    return d.gather(0, pick[None, :, :, None].expand(1, *d.shape[1:]))[0]


def _row_err(d: torch.Tensor, pick: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    res = _chosen(d, pick).reshape(pick.shape[0], -1)
    return ((res @ sigma) * res).sum(dim=1)


def _cross_pass(d: torch.Tensor, self_err: torch.Tensor, sigma: torch.Tensor,
                pick: torch.Tensor) -> torch.Tensor:
    """One coordinate-descent pass: each group's candidate re-chosen for the whole row's error
    given the other groups' current residuals (the current one is a candidate: never worse)."""
    _, r, groups, g = d.shape
    cur, rows = _chosen(d, pick), torch.arange(r, device=d.device)
    for j in range(groups):
        others = cur.clone()
        others[:, j] = 0
        cross = others.reshape(r, -1) @ sigma[:, j * g:(j + 1) * g]  # [R, g]
        err = self_err[:, :, j] + 2 * (d[:, :, j] * cross[None]).sum(dim=-1)  # [C, R]
        pick[:, j] = err.argmin(dim=0)
        cur[:, j] = d[pick[:, j], rows, j]
    return pick


def clip_rows(linear: nn.Module, start: int, stop: int, sigma: torch.Tensor,
              group_size: int) -> None:
    """Clamp rows start:stop of linear's weight to their searched per-group range, in place."""
    w = linear.weight.data[start:stop]
    group_size = row_group(group_size, w.shape[1])
    lo, hi = search_clip(w, sigma, group_size)
    shaped = qu.pad_to_groups(w, group_size).reshape(w.shape[0], -1, group_size)
    clipped = torch.maximum(torch.minimum(shaped, hi.to(w)), lo.to(w))
    w.copy_(clipped.reshape(w.shape[0], -1)[:, :w.shape[1]])


def projections(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's four (fused) projections under their names in `grams`."""
    return {leaf: layer.get_submodule(leaf) for leaf in PROJECTIONS}


def scaled_gram(grams: dict[str, torch.Tensor], applied: dict[str, torch.Tensor],
                leaf: str) -> torch.Tensor:
    """The Gram matrix of a projection's inputs after AWQ's scale s divided them: Gram / s s^T."""
    s = applied.get(leaf)
    return grams[leaf] if s is None else grams[leaf] / (s[:, None] * s[None, :])


def clip_layer(layer: nn.Module, grams: dict[str, torch.Tensor],
               applied: dict[str, torch.Tensor], group_size: int) -> None:
    """Clipping search for v, o, gate_up and down on their scaled inputs (Gram / s s^T). q and k
    are left alone, as in AutoAWQ: their error is seen through softmax, and clipping them for
    the linear output error measured worse on the block output."""
    qkv = layer.self_attn.qkv_proj
    for leaf, linear in projections(layer).items():
        start = qkv.output_size - qkv.output_sizes[2] if linear is qkv else 0
        clip_rows(linear, start, linear.output_size, scaled_gram(grams, applied, leaf),
                  group_size)


def gptq_hessians(inp: LayerInputs, options: GptqOptions) -> dict[str, torch.Tensor]:
    """GPTQ's H per projection (gptq.sink_weighted_gram): the attention projections' with each
    block's first token (the attention sink) weighted up, the MLP's with it left out (measured
    on SmolLM2, docs/quantization.md)."""
    attn, mlp = options.sink_weight, options.mlp_sink_weight
    return {"self_attn.qkv_proj": sink_weighted_gram(inp.attn_in, attn),
            "self_attn.o_proj": sink_weighted_gram(inp.ctx, attn),
            "mlp.gate_up_proj": sink_weighted_gram(inp.mlp_in, mlp),
            "mlp.down_proj": sink_weighted_gram(inp.act, mlp)}


def gptq_layer(layer: nn.Module, grams: dict[str, torch.Tensor],
               applied: dict[str, torch.Tensor], group_size: int | None,
               options: GptqOptions) -> None:
    """GPTQ-round the layer's four projections on their (scaled) inputs' Gram matrices and
    store them in int4_awq's layout (gptq.install_int4)."""
    group = group_size if group_size and group_size > 0 else -1
    mlp = replace(options, damp=options.mlp_damp)
    for leaf, linear in projections(layer).items():
        q, scales, zeros = gptq_quantize(linear.weight.data, scaled_gram(grams, applied, leaf),
                                         group, mlp if leaf.startswith("mlp.") else options)
        install_int4(linear, q, scales, zeros, group)


# --- the whole model ------------------------------------------------------------------------------

class LayerByLayerAwq:
    """AWQ and / or GPTQ one decoder layer at a time, in order: call it with (model, i, layer)
    for i = 0, 1, ... once layer i's float weights are in (and, for i == 0, the embedding). It
    keeps the float residual stream of the calibration blocks between calls, so only the
    current layer needs its float weights: `slipstream quantize --method int4_awq` streams a
    checkpoint through it (models/quantize_as_loaded.before_each_layer) and never holds the
    whole float model.

    Each layer is searched on the float model's inputs to it: earlier layers' quantization error
    is not propagated (as in AutoAWQ; propagating it measured worse here; GPTQ can, with
    GptqOptions.quantized_inputs). seq_len: tokens per
    packed block (default: the longest prompt, i.e. the calibration length). Memory: six
    [search_tokens, hidden or intermediate] float32 tensors for the current layer.

    awq: the scale (and, with clip and no GPTQ, clipping) search; gptq: GPTQ rounding on the
    same inputs (after AWQ's scales, when both), which leaves the layer's projections in
    int4_awq's layout; None leaves the rounding to int4_awq's round-to-nearest. Clipping is for
    round-to-nearest: before GPTQ it changes the weights GPTQ then reproduces (measured on
    SmolLM2 at group 64: AWQ + GPTQ +25.9% perplexity with clipping, +19.5% without).
    """

    def __init__(self, prompts: list[list[int]], group_size: int, *, seq_len: int | None = None,
                 search_tokens: int = SEARCH_TOKENS, block_tokens: int = BLOCK_TOKENS,
                 clip: bool = True, grid: int = SCALE_GRID, progress: bool = False,
                 awq: bool = True, gptq: GptqOptions | None = None):
        self.prompts, self.group_size, self.seq_len = prompts, group_size, seq_len
        self.search_tokens, self.block_tokens = search_tokens, block_tokens
        self.clip, self.grid, self.progress = clip, grid, progress
        self.awq, self.gptq = awq, gptq
        self.next_layer = 0
        self._h: torch.Tensor | None = None
        self._bar = None

    @torch.no_grad()
    def __call__(self, model: nn.Module, index: int, layer: nn.Module) -> None:
        if index != self.next_layer:
            raise RuntimeError(f"AWQ: decoder layer {index} arrived before layer "
                               f"{self.next_layer} (layers must be calibrated in order)")
        cos_sin = model.model.rotary_emb.cos_sin_cache.float()
        if self._h is None:
            self._start(model, cos_sin)
        prefix = f"model.layers.{index}"
        inp, h_next = layer_inputs(layer, self._h, cos_sin)
        grams = {"self_attn.qkv_proj": gram(inp.attn_in), "self_attn.o_proj": gram(inp.ctx),
                 "mlp.gate_up_proj": gram(inp.mlp_in), "mlp.down_proj": gram(inp.act)}
        applied: dict[str, torch.Tensor] = {}
        if self.awq:
            scales = search_layer_scales(layer, inp, grams, cos_sin, self.group_size,
                                         self.block_tokens, self.grid)
            applied = fold_layer(layer, prefix, scales, self._norm_dtype)
            if self.clip and self.gptq is None:  # clipped weights would be GPTQ's target
                clip_layer(layer, grams, applied, self.group_size)
        if self.gptq is not None:
            gptq_layer(layer, gptq_hessians(inp, self.gptq), applied, self.group_size,
                       self.gptq)
            if self.gptq.quantized_inputs:  # the next layer calibrates on this one's output
                h_next = layer_inputs(layer, self._h, cos_sin, quantized_weights(layer))[1]
        self._h = h_next
        self.next_layer += 1
        if self._bar is not None:
            self._bar.update()
            if self.next_layer == len(model.model.layers):
                self._bar.close()

    def _start(self, model: nn.Module, cos_sin: torch.Tensor) -> None:
        seq_len = min(self.seq_len or max(map(len, self.prompts)), cos_sin.shape[0])
        blocks = pack_blocks(self.prompts, seq_len, self.search_tokens)
        self._norm_dtype = _NORM_DTYPES.get(str(getattr(model.config, "torch_dtype", "")))
        embed = model.model.embed_tokens
        self._h = embed(blocks.to(embed.weight.device)).float()
        logger.info("%s: %d x %d calibration tokens, group size %s", self._name(), *blocks.shape,
                    self.group_size)
        if self.progress:
            self._bar = tqdm(total=len(model.model.layers), desc=self._name(), unit="layer")

    def _name(self) -> str:
        return " + ".join(n for n, on in (("AWQ", self.awq), ("GPTQ", self.gptq)) if on)


@torch.no_grad()
def awq_prepare(model: nn.Module, prompts: list[list[int]], group_size: int, **kwargs) -> None:
    """Scale and clip (AWQ) and / or GPTQ-round every decoder layer's projections of a loaded
    float model in place, layer by layer (Llama family); kwargs: LayerByLayerAwq's."""
    awq = LayerByLayerAwq(prompts, group_size, progress=True, **kwargs)
    for i, layer in enumerate(model.model.layers):
        awq(model, i, layer)


def fold_layer(layer: nn.Module, prefix: str, scales: dict[str, torch.Tensor],
               norm_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Fold {leaf name: scale} into the layer; returns the scales applied (norm rounding)."""
    applied = qu.fold_layer_input_scales(
        layer, prefix, lambda name, _: scales[name.removeprefix(f"{prefix}.")], gqa_o_proj=True,
        norm_dtype=norm_dtype)
    return {name.removeprefix(f"{prefix}."): s for name, s in applied.items()}
