"""EAGLE / EAGLE-3 proposer: a one-layer draft head that runs autoregressively on the target's
hidden states (features) rather than on tokens alone. Chains of k drafts; with
`speculative_token_tree`, the chain plus next-ranked leaves at each depth (a draft tree).

At position t the head takes the embedding of token t + 1 and the feature of position t and
predicts the feature of position t + 1, whose logits give the draft for token t + 2; each
draft step feeds its own predicted feature back. The head keeps a paged KV cache for its layer
on the target's block ids (like the draft model), so the target's tables, preemption and
rollback cover it; the KV budget is split by bytes per block.

Layouts (safetensors only), as published:
- EAGLE (EAGLE-1/2): `fc.weight` [H, 2H] (+ `fc.bias`), one Llama decoder layer
  `layers.0.*` without its input norm, optional `embed_tokens.weight`; the feature is the
  target's final normed hidden state and the target's LM head reads the head's output.
- EAGLE-3: `fc.weight` [H, 3H] over three target layers' hidden states (the inputs of layers
  `eagle_config.eagle_aux_hidden_state_layer_ids`, default 2, L / 2 and L - 3), a layer
  `midlayer.*` whose attention reads [input_layernorm(embedding), hidden_norm(feature)]
  (2H wide), `norm.weight`, its own `lm_head.weight` over a draft vocabulary and `d2t`
  (draft id + d2t[draft id] = target id).

A request whose first step hit the prefix cache has no features for the hit tokens: its head
attends to whatever head K/V those shared blocks hold (drafts may be worse, never wrong:
verification is exact).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from slipstream.config import EngineConfig
from slipstream.dtypes import resolve_dtype
from slipstream.engine.request import Request
from slipstream.kernels import get_ops
from slipstream.kernels.reference import rms_norm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.runner.input_batch import prepare_inputs
from slipstream.scheduler.output import ScheduledSeq
from slipstream.speculative import tree as trees
from slipstream.speculative.hidden import StepHidden


@dataclasses.dataclass
class _Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    eagle3: bool
    aux_layers: tuple[int, ...]


def _shape(cfg: dict, eagle3: bool, target_layers: int) -> _Shape:
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    aux = ()
    if eagle3:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = target_layers
        aux = tuple(ids) if ids else (min(2, n - 1), n // 2, max(n - 3, 0))
        if any(not 0 <= i < n for i in aux):
            raise ValueError(f"EAGLE-3 head: auxiliary layers {aux} outside the target's {n} layers")
    return _Shape(
        hidden,
        heads,
        cfg.get("num_key_value_heads", heads),
        cfg.get("head_dim") or hidden // heads,
        cfg.get("rms_norm_eps", 1e-6),
        eagle3,
        aux,
    )


class EagleHead(nn.Module):
    """The head's weights and one forward over a flat batch (attention on its paged cache)."""

    def __init__(self, t: dict[str, torch.Tensor], shape: _Shape, cfg: dict):
        super().__init__()
        self.shape = shape
        p = "midlayer." if shape.eagle3 else "layers.0."
        self.w = {k: v for k, v in t.items()}
        self.layer = p
        self.rotary = RotaryEmbedding(
            shape.head_dim,
            cfg.get("max_position_embeddings", 4096),
            cfg.get("rope_theta", 10000.0),
            cfg.get("rope_scaling"),
        )

    def to_device(self, device: torch.device, dtype: torch.dtype) -> EagleHead:
        self.w = {
            k: (v.to(device) if k in ("d2t", "t2d") else v.to(device, dtype)) for k, v in self.w.items()
        }
        self.rotary.to(device)
        return self

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's concatenated layer features [N, 3H] to one [N, H]."""
        return self._lin("fc", features)

    def forward(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta,
        ops,
    ) -> torch.Tensor:
        """The predicted feature [N, H] of the next positions."""
        s, p, eps = self.shape, self.layer, self.shape.eps
        if s.eagle3:
            residual = feature
            x = torch.cat(
                [
                    rms_norm(embeds, self.w[p + "input_layernorm.weight"], eps),
                    rms_norm(feature, self.w[p + "hidden_norm.weight"], eps),
                ],
                dim=-1,
            )
        else:
            x = residual = self._lin("fc", torch.cat([embeds, feature], dim=-1))
        n = x.shape[0]
        q = self._lin(p + "self_attn.q_proj", x).view(n, s.heads, s.head_dim)
        k = self._lin(p + "self_attn.k_proj", x).view(n, s.kv_heads, s.head_dim)
        v = self._lin(p + "self_attn.v_proj", x).view(n, s.kv_heads, s.head_dim)
        q, _ = ops.rotary_and_cache_write(
            q, k, v, positions, self.rotary.cos_sin_cache, kv[0], kv[1], meta.slot_mapping
        )
        attn = ops.paged_attention(q, kv[0], kv[1], meta, s.head_dim**-0.5)
        h = residual + self._lin(p + "self_attn.o_proj", attn.reshape(n, -1))
        y = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], eps)
        gate_up = F.silu(self._lin(p + "mlp.gate_proj", y)) * self._lin(p + "mlp.up_proj", y)
        return h + self._lin(p + "mlp.down_proj", gate_up)


def load_eagle(path: str | Path, target_layers: int) -> tuple[EagleHead, dict]:
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files or not (path / "config.json").is_file():
        raise ValueError(
            f"speculative_config: {path} holds no EAGLE head (config.json and "
            "*.safetensors; pickled .bin heads are not loaded: convert them)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    cfg = json.loads((path / "config.json").read_text())
    eagle3 = any(k.startswith("midlayer.") for k in tensors)
    if not eagle3 and not any(k.startswith("layers.0.") for k in tensors):
        raise ValueError(
            f"speculative_config: {path}: neither an EAGLE (layers.0.*) nor an "
            f"EAGLE-3 (midlayer.*) head (first names: {sorted(tensors)[:4]})"
        )
    return EagleHead(tensors, _shape(cfg, eagle3, target_layers), cfg), cfg


class EagleProposer:
    method = "eagle"
    needs_hidden = True

    def __init__(self, config: EngineConfig):
        spec = config.speculative
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        self.block_size = config.cache.block_size
        head, _ = load_eagle(spec.model, config.model.num_hidden_layers)
        self.head = head.to_device(self.device, self.dtype)
        self.shape = head.shape
        self.ops = get_ops(str(self.device))
        self.kv = None  # the scheduler's KVCacheManager (set by the engine)
        self.kv_caches: tuple[torch.Tensor, torch.Tensor] | None = None
        self.target = None
        self._aux: dict[int, torch.Tensor] = {}
        # EAGLE-3: a step of up to max_prefill_graph_tokens tokens leaves each auxiliary
        # layer's input in a static buffer (rows 0..T-1) rather than a new tensor, so a CUDA
        # graph replay of the target, which never calls the hook, leaves it there too: the
        # hook's copy was captured with the forward.
        self._aux_rows = config.max_prefill_graph_tokens if head.shape.eagle3 else 0
        self._aux_static: dict[int, torch.Tensor] = {}
        # Per request: head K/V valid below fed_upto; features of the positions after it.
        self._fed: dict[str, int] = {}
        self._pending: dict[str, torch.Tensor] = {}
        # speculative_token_tree: the top-1 chain with next-ranked leaves (None: a chain).
        self.paths = trees.leaves_on_top_chain(spec.token_tree())
        self.width = 1 if self.paths is None else max(p[-1] for p in self.paths) + 1
        w = self.head.w.get("lm_head.weight")
        vocab = w.shape[0] if self.shape.eagle3 and w is not None else config.model.vocab_size
        if self.width > vocab:
            raise ValueError(f"speculative_token_tree: rank {self.width - 1} past the head's {vocab} tokens")

    # ---- the target ----------------------------------------------------------------------
    def attach_target(self, model) -> None:
        """Embeddings and LM head from the target where the head has none; EAGLE-3: capture
        the inputs of its auxiliary layers on every forward."""
        self.target = model
        if self.shape.eagle3:
            layers = model.model.layers
            for i in self.shape.aux_layers:
                layers[i].register_forward_pre_hook(self._capture(i))

    def _capture(self, i: int):
        def hook(_module, args):
            hidden, residual = args[0], args[1]
            x = hidden if residual is None else hidden + residual
            if x.shape[0] > self._aux_rows:
                self._aux[i] = x
                return
            buf = self._aux_static.get(i)
            if buf is None:  # the first forward (memory profile or warm-up) is eager
                buf = self._aux_static[i] = x.new_empty((self._aux_rows, x.shape[1]))
            buf[: x.shape[0]].copy_(x)

        return hook

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.head.w.get("embed_tokens.weight")
        if w is not None:
            return F.embedding(ids, w)
        return self.target.model.embed_tokens(ids).to(self.dtype)

    def _draft_ids(self, feature: torch.Tensor) -> torch.Tensor:
        """[N, width]: each row's `width` most likely target ids, the most likely first."""
        if not self.shape.eagle3:
            return _top(self.target.compute_logits(feature), self.width)
        h = rms_norm(feature, self.head.w["norm.weight"], self.shape.eps)
        ids = _top(F.linear(h, self.head.w["lm_head.weight"]), self.width)
        d2t = self.head.w.get("d2t")
        return ids if d2t is None else ids + d2t[ids]

    # ---- memory --------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        s = self.shape
        return 2 * self.block_size * s.kv_heads * s.head_dim * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        s = self.shape
        shape = (num_blocks, self.block_size, s.kv_heads, s.head_dim)
        self.kv_caches = (
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    # ---- features ------------------------------------------------------------------------
    def features(self, step: StepHidden) -> torch.Tensor:
        """[T, H]: the head's input feature of each of the step's rows."""
        if not self.shape.eagle3:
            return step.hidden
        rows = step.hidden.shape[0]
        aux = [
            self._aux_static[i][:rows] if rows <= self._aux_rows else self._aux[i]
            for i in self.shape.aux_layers
        ]
        return self.head.fuse(torch.cat(aux, -1))

    def observe(self, step: StepHidden) -> None:
        """Queue each request's new known positions' features for its next catch-up."""
        feats = self.features(step)
        for seq in step.seqs:
            rid, rows = seq.request_id, step.known_rows[seq.request_id]
            if not rows:
                continue
            new = feats[torch.tensor(rows, device=feats.device)].to(self.dtype)
            fed, pending = self._fed.get(rid), self._pending.get(rid)
            have = None if fed is None else fed + (0 if pending is None else len(pending))
            if have == seq.start_pos:
                self._pending[rid] = new if pending is None else torch.cat([pending, new])
            else:  # first sight, or recomputed after a preemption: start at this chunk
                self._fed[rid], self._pending[rid] = seq.start_pos, new

    # ---- proposing -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict:
        """Per request id, k greedy drafts: one catch-up chunk over its queued features, then
        k - 1 steps on the head's own features; one host read at the end. With a token tree,
        (tokens, parents): the chain plus, at each depth, the next-ranked tokens of that
        step's logits as leaves."""
        ready = [(r, k) for r, k in wanted if self._caught_up_to(r) == r.num_tokens - 1]
        ready = [(r, k) for r, k in ready if self.kv.allocate_slots(r, 1 + k)]
        if not ready:
            return {}
        seqs, embeds_ids, feats = [], [], []
        for r, _ in ready:
            start = self._fed[r.request_id]
            pending = self._pending.pop(r.request_id)
            seqs.append(ScheduledSeq(r, [0] * len(pending), start, self.kv.get_block_ids(r.request_id), True))
            embeds_ids += r.token_ids_slice(start + 1, start + 1 + len(pending))
            feats.append(pending)
            self._fed[r.request_id] = start + len(pending)
        ids = torch.tensor(embeds_ids, dtype=torch.long, device=self.device)
        h = self._run(seqs, self._embed(ids), torch.cat(feats))
        steps = [self._draft_ids(h)]
        alive = list(range(len(ready)))
        for j in range(1, max(k for _, k in ready)):
            keep = [n for n, i in enumerate(alive) if ready[i][1] > j]
            alive = [alive[n] for n in keep]
            rows = torch.tensor(keep, device=self.device)
            prev_ids, h = steps[-1][:, 0].index_select(0, rows), h.index_select(0, rows)
            seqs = [
                ScheduledSeq(
                    ready[i][0],
                    [0],
                    ready[i][0].num_tokens - 2 + j,
                    self.kv.get_block_ids(ready[i][0].request_id),
                    True,
                )
                for i in alive
            ]
            h = self._run(seqs, self._embed(prev_ids), h)
            steps.append(self._draft_ids(h))
        per_depth = _regroup(torch.cat(steps).tolist(), ready)
        if self.paths is None:
            return {rid: [row[0] for row in rows] for rid, rows in per_depth.items()}
        drafts = {}
        for rid, rows in per_depth.items():
            paths = [p for p in self.paths if len(p) <= len(rows)]  # breadth-first: a prefix
            drafts[rid] = ([rows[len(p) - 1][p[-1]] for p in paths], trees.parents_of(paths))
        return drafts

    def _caught_up_to(self, r: Request) -> int:
        fed, pending = self._fed.get(r.request_id), self._pending.get(r.request_id)
        return -1 if fed is None or pending is None else fed + len(pending)

    def _run(self, seqs: list[ScheduledSeq], embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """The head over a flat batch; the predicted feature of each seq's last row."""
        inputs = prepare_inputs(seqs, self.block_size, self.device)
        out = self.head(embeds, feats, inputs.positions, self.kv_caches, inputs.meta, self.ops)
        return out[inputs.logits_indices]

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._fed.pop(rid, None)
            self._pending.pop(rid, None)


def _top(logits: torch.Tensor, width: int) -> torch.Tensor:
    return logits.argmax(-1, keepdim=True) if width == 1 else logits.topk(width, dim=-1).indices


def _regroup(flat: list[list[int]], ready: list[tuple[Request, int]]) -> dict[str, list[list[int]]]:
    """Per request id, its row of ranked ids at each depth (the steps' rows, flattened)."""
    drafts: dict[str, list[list[int]]] = {r.request_id: [] for r, _ in ready}
    alive, offset, j = list(range(len(ready))), 0, 0
    while offset < len(flat):
        alive = [i for i in alive if ready[i][1] > j]
        for n, i in enumerate(alive):
            drafts[ready[i][0].request_id].append(flat[offset + n])
        offset += len(alive)
        j += 1
    return drafts
