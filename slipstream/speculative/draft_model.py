"""Draft-model proposer: a small model with the target's vocabulary proposes k tokens greedily.

Its paged KV cache shares the target's block ids (same block size and count; the runner splits
the memory budget by bytes per block), so the target's block tables, allocation, preemption and
rollback cover it with no second allocator. Per request it remembers how many leading tokens
its cache holds; each proposal first feeds the tokens past those (the prompt on the first call,
then the tokens accepted since), then k - 1 single-token steps on its own greedy drafts, with
the drafts' token ids kept on the device until one read at the end.

A prefix-cache hit shares target blocks whose draft K/V may never have been written, so a
request's draft always computes its sequence from the start (the values it writes into a
shared block are the ones any other request's draft would write there: the same tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from slipstream.config import EngineConfig, ModelConfig, QuantConfig
from slipstream.engine.request import Request
from slipstream.models.loader import load_model
from slipstream.runner.input_batch import prepare_inputs
from slipstream.scheduler.output import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftState:
    num_valid: int  # leading tokens of the request whose draft K/V is written
    fed: list[int]  # draft tokens fed after them (their K/V is written too)
    num_preemptions: int  # a preemption frees the blocks: start over


def draft_model_path(config: EngineConfig) -> str:
    """The draft checkpoint: speculative_config["model"], else the embedded default model's
    own draft when the target is that model."""
    spec = config.speculative
    if spec.model is not None:
        return spec.model
    from slipstream.assets import DEFAULT_MODEL_DIR, default_draft_model_path

    if Path(config.model_path).resolve() == DEFAULT_MODEL_DIR.resolve():
        return str(default_draft_model_path())
    raise ValueError(
        "speculative_config: method 'draft_model' needs 'model' (a draft checkpoint "
        "with the target's vocabulary) unless the target is the embedded default "
        "model, whose draft ships beside it"
    )


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    path = draft_model_path(config)
    model = ModelConfig.from_dir(path)
    if model.vocab_size != config.model.vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {path} has a vocabulary of "
            f"{model.vocab_size} tokens, the target {config.model.vocab_size}; "
            "they must share one tokenizer"
        )
    return config.replace(model_path=path, model=model, quant=QuantConfig())


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, config: EngineConfig):
        self.config = draft_engine_config(config)
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.model = load_model(self.config)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv = None  # the scheduler's KVCacheManager (set by the engine)
        self._states: dict[str, _DraftState] = {}

    # ---- memory --------------------------------------------------------------------------
    def _kv_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        m = self.config.model
        return (num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def kv_bytes_per_block(self) -> int:
        _, bs, heads, dim = self._kv_shape(1)
        return 2 * self.config.model.num_hidden_layers * bs * heads * dim * self._dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self._kv_shape(num_blocks)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self._dtype, device=self.device),
                torch.zeros(shape, dtype=self._dtype, device=self.device),
            )
            for _ in range(self.config.model.num_hidden_layers)
        ]

    # ---- proposing -----------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Per request id, k greedy draft tokens (a request whose draft slots do not fit the
        free blocks gets none)."""
        wanted = [(r, k) for r, k in wanted if self.kv.allocate_slots(r, 1 + k)]
        if not wanted:
            return {}
        steps = [self._catch_up([r for r, _ in wanted])]
        alive = list(range(len(wanted)))
        for j in range(1, max(k for _, k in wanted)):
            prev_rows = {i: n for n, i in enumerate(alive)}
            alive = [i for i in alive if wanted[i][1] > j]
            steps.append(
                self._decode_step([wanted[i][0] for i in alive], j, steps[-1], [prev_rows[i] for i in alive])
            )
        drafts = self._read(steps, wanted)
        for request, _ in wanted:
            d = drafts[request.request_id]
            self._states[request.request_id] = _DraftState(
                request.num_tokens, d[:-1], request.num_preemptions
            )
        return drafts

    def _catch_up(self, requests: list[Request]) -> torch.Tensor:
        """Feed each request's tokens past its valid draft K/V; the first draft token each."""
        seqs = []
        for r in requests:
            start = self._num_valid(r)
            seqs.append(
                ScheduledSeq(
                    r,
                    r.token_ids_slice(start, r.num_tokens),
                    start,
                    self.kv.get_block_ids(r.request_id),
                    True,
                )
            )
        return self._forward_argmax(seqs)

    def _decode_step(
        self, requests: list[Request], j: int, prev: torch.Tensor, rows: list[int]
    ) -> torch.Tensor:
        """Draft token j + 1 from draft token j (position num_tokens - 1 + j), on the device."""
        seqs = [
            ScheduledSeq(r, [0], r.num_tokens - 1 + j, self.kv.get_block_ids(r.request_id), True)
            for r in requests
        ]
        fed = prev.index_select(0, torch.tensor(rows, device=prev.device))
        return self._forward_argmax(seqs, fed)

    def _forward_argmax(
        self, seqs: list[ScheduledSeq], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = prepare_inputs(seqs, self.block_size, self.device)
        if input_ids is not None:
            inputs.input_ids = input_ids
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices]).argmax(dim=-1)

    @staticmethod
    def _read(steps: list[torch.Tensor], wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """One host read of every step's draft tokens, regrouped per request."""
        flat = torch.cat(steps).tolist()
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in wanted}
        alive, offset = list(range(len(wanted))), 0
        for j in range(len(steps)):
            alive = [i for i in alive if wanted[i][1] > j]
            for n, i in enumerate(alive):
                drafts[wanted[i][0].request_id].append(flat[offset + n])
            offset += len(alive)
        return drafts

    def _num_valid(self, request: Request) -> int:
        """Leading tokens whose draft K/V still holds: those fed before, up to the first fed
        draft token the target did not accept."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return 0
        valid = state.num_valid
        for token in state.fed:
            if valid >= request.num_tokens or request.token_ids_slice(valid, valid + 1)[0] != token:
                break
            valid += 1
        return min(valid, request.num_tokens - 1)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)
