"""Medusa proposer: extra decoding heads on the target's last hidden state, each guessing one
token further ahead, their top-k combined into a candidate tree (speculative/tree.py).

Head i maps the final (normed) hidden state h of the row that sampled the last token to the
logits of the token i + 1 places after it: a stack of residual blocks x + SiLU(W x + b), then
a linear map to the vocabulary. A tree node is a path of top-k ranks (r1, ..., rd): its token
is the r_d-th most likely of head d - 1, its parent the path without r_d.

Checkpoints in their published layouts, safetensors only (no pickle):
- FasterDecoding (Medusa's own): config.json with medusa_num_heads / medusa_num_layers and
  `medusa_lm_head.safetensors` (or any *.safetensors) with `{i}.{j}.linear.weight|bias` for
  block j of head i and `{i}.{L}.weight` for its vocabulary map (optionally prefixed
  `medusa_head.`).
- vLLM / TensorRT-LLM (`MedusaModel`): `blocks.{i}.layers.{j}.weight|bias` and
  `lm_heads.{i}.weight`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from slipstream.engine.request import Request
from slipstream.speculative import tree as trees
from slipstream.speculative.hidden import StepHidden

_FASTER = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


class MedusaHeads(nn.Module):
    """heads[i] = residual blocks then a bias-free map to the vocabulary."""

    def __init__(
        self, blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]], heads: list[torch.Tensor]
    ):
        super().__init__()
        self.blocks = nn.ModuleList()
        for head_blocks in blocks:
            layers = nn.ModuleList()
            for w, b in head_blocks:
                lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
                lin.weight.data = w
                if b is not None:
                    lin.bias.data = b
                layers.append(lin)
            self.blocks.append(layers)
        self.heads = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in heads)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def forward(self, hidden: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
        """Logits [N, vocab] (float32) of the first num_heads heads for hidden [N, H]."""
        out = []
        for layers, head in zip(self.blocks[:num_heads], self.heads[:num_heads]):
            x = hidden
            for lin in layers:
                x = x + nn.functional.silu(lin(x))
            out.append((x @ head.t()).float())
        return out


def load_medusa(path: str | Path, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    """Medusa heads from a checkpoint directory in either published layout."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = [p.name for p in path.iterdir()] if path.is_dir() else []
        raise ValueError(
            f"speculative_config: no *.safetensors Medusa heads in {path} (found {found}); "
            "pickled .pt / .bin heads are not loaded: convert them with safetensors' save_file"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    blocks, heads = _parse(tensors, path)
    config = _read_config(path)
    num_heads = config.get("medusa_num_heads", config.get("num_heads", len(heads)))
    if num_heads != len(heads):
        raise ValueError(
            f"Medusa checkpoint {path}: config says {num_heads} heads, the weights hold {len(heads)}"
        )
    model = MedusaHeads(blocks, heads)
    return model.to(device=device, dtype=dtype).eval()


def _read_config(path: Path) -> dict:
    config = path / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _parse(tensors: dict[str, torch.Tensor], path: Path):
    """(per head [(W, b)] of its residual blocks, per head its vocabulary map)."""
    block: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    head: dict[int, torch.Tensor] = {}
    for name, t in tensors.items():
        if m := _VLLM_BLOCK.match(name):
            block.setdefault((int(m[1]), int(m[2])), {})[m[3]] = t
        elif m := _VLLM_HEAD.match(name):
            head[int(m[1])] = t
        elif m := _FASTER.match(name):
            # FasterDecoding: a head is nn.Sequential(ResBlock * L, Linear); the last index
            # (a bare weight, no bias, no `linear.`) is the vocabulary map.
            block.setdefault((int(m[1]), int(m[2])), {})[m[3]] = t
            block[(int(m[1]), int(m[2]))]["plain"] = ".linear." not in name
    if not head:  # FasterDecoding: each head's highest index is its vocabulary map
        for i in sorted({i for i, _ in block}):
            last = max(j for h, j in block if h == i)
            entry = block.pop((i, last))
            if "bias" in entry or not entry.get("plain"):
                raise ValueError(
                    f"Medusa checkpoint {path}: head {i}'s last layer is not a "
                    "bias-free linear map to the vocabulary"
                )
            head[i] = entry["weight"]
    if not head or sorted(head) != list(range(len(head))):
        raise ValueError(
            f"Medusa checkpoint {path}: no Medusa head tensors recognised "
            f"(first names: {sorted(tensors)[:4]})"
        )
    blocks = []
    for i in range(len(head)):
        js = sorted(j for h, j in block if h == i)
        if js != list(range(len(js))):
            raise ValueError(f"Medusa checkpoint {path}: head {i} has blocks {js}")
        blocks.append([(block[(i, j)]["weight"], block[(i, j)].get("bias")) for j in js])
    return blocks, [head[i] for i in range(len(head))]


class MedusaProposer:
    """Drafts a tree per request from the heads applied to the target's hidden state of the
    row that sampled its last token (kept from the step that sampled it)."""

    method = "medusa"
    needs_hidden = True

    def __init__(
        self,
        path: str,
        num_speculative_tokens: int,
        token_tree,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.heads = load_medusa(path, dtype, device)
        vocab = self.heads.heads[0].shape[0]
        if vocab != vocab_size:
            raise ValueError(
                f"speculative_config: Medusa heads in {path} predict {vocab} "
                f"tokens, the target has {vocab_size}"
            )
        if num_speculative_tokens > self.heads.num_heads:
            raise ValueError(
                f"speculative_config: num_speculative_tokens "
                f"{num_speculative_tokens} exceeds the {self.heads.num_heads} "
                f"Medusa heads in {path} (one head a tree level)"
            )
        self.paths = (
            trees.tree_from_choices(token_tree)
            if token_tree is not None
            else trees.default_tree(
                num_speculative_tokens, trees.medusa_default_nodes(num_speculative_tokens)
            )
        )
        if max(len(p) for p in self.paths) > self.heads.num_heads:
            raise ValueError(
                "speculative_config: speculative_token_tree is deeper than the "
                f"{self.heads.num_heads} Medusa heads"
            )
        self.width = max(r for p in self.paths for r in p) + 1
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}  # rid -> (num_tokens, h)

    def attach_target(self, model) -> None:  # drafts from hidden states only
        pass

    def observe(self, step: StepHidden) -> None:
        """Keep, per sampled request, the hidden state of the row that sampled its token."""
        for seq in step.seqs:
            rows = step.known_rows[seq.request_id]
            if seq.needs_sample and rows:
                self._hidden[seq.request_id] = (step.num_tokens_after(seq), step.hidden[rows[-1]])

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, tuple[list[int], list[int]]]:
        """Per request id (tokens, parents) of a tree of depth <= its k; none for a request
        whose last token's hidden state was not kept (it came from a step without them)."""
        ready = [(r, k) for r, k in wanted if self._hidden.get(r.request_id, (-1,))[0] == r.num_tokens]
        if not ready:
            return {}
        depth = max(k for _, k in ready)
        hidden = torch.stack([self._hidden[r.request_id][1] for r, _ in ready])
        logits = self.heads(hidden.to(self.heads.heads[0].dtype), depth)
        top = torch.stack([lg.topk(self.width, dim=-1).indices for lg in logits]).tolist()
        drafts = {}
        for b, (request, k) in enumerate(ready):
            paths = [p for p in self.paths if len(p) <= k]  # breadth-first: a prefix
            tokens = [top[len(p) - 1][b][p[-1]] for p in paths]
            drafts[request.request_id] = (tokens, trees.parents_of(paths))
        return drafts

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._hidden.pop(rid, None)
