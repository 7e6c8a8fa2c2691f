"""PoolingModelRunner: a step of whole prompts -> one pooled vector per request.

The scheduler batches pooling requests like prefills (no chunking, no prefix cache; each
request asks for one token, so it finishes after its step and its blocks are freed). The
runner pools the hidden states instead of sampling: the vector comes back in
`PoolingRunnerOutput.pooled`, with a placeholder token that ends the request.
Decoders use a KV cache just large enough for one step's tokens; encoders (BERT) none.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slipstream.runner.input_batch import prepare_inputs
from slipstream.runner.model_runner import ModelRunner
from slipstream.scheduler.output import RunnerOutput, SchedulerOutput

_PLACEHOLDER_TOKEN = 0  # the one "sampled" token that ends a pooling request


@dataclass
class PoolingRunnerOutput(RunnerOutput):
    pooled: dict[str, list[float]] = field(default_factory=dict)


class PoolingModelRunner(ModelRunner):
    @property
    def uses_kv_cache(self) -> bool:
        return getattr(self.model, "uses_kv_cache", True)

    @property
    def takes_token_types(self) -> bool:
        """Whether the model reads token type ids (BERT: the segments of a text pair)."""
        return getattr(self.model, "takes_token_types", False)

    @property
    def is_classifier(self) -> bool:
        return hasattr(self.model, "pooling_head")

    def determine_num_blocks(self) -> int:
        """Blocks for one step's worth of whole prompts (nothing is kept after a request)."""
        sched = self.config.scheduler
        return -(-sched.max_num_tokens // self.block_size) + sched.max_num_seqs

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.uses_kv_cache:
            super().initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    def warmup(self) -> None:
        """Nothing to capture; the first batch compiles what it needs."""

    def capture_cuda_graphs(self) -> None:
        """Pooling steps run eagerly (no decode steps to replay)."""

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput,
                      while_gpu_runs: Callable[[], None] | None = None,
                      feed=None) -> PoolingRunnerOutput:
        out = PoolingRunnerOutput()
        if sched.is_empty:
            if while_gpu_runs is not None:
                while_gpu_runs()
            return out
        vectors = self.pool_step(sched)
        if while_gpu_runs is not None:
            while_gpu_runs()
        vectors = vectors.cpu()  # the step's one host sync; the per-request options are tiny
        for seq, vector in zip(sched.seqs, vectors, strict=True):
            rid = seq.request_id
            out.sampled_token_ids[rid] = [_PLACEHOLDER_TOKEN]
            out.pooled[rid] = vector.tolist() if self.is_classifier else self._finish(seq, vector)
        return out

    def pool_step(self, sched: SchedulerOutput) -> torch.Tensor:
        """Pooled [S, H] (classifier: logits [S, labels]) of the step's whole prompts."""
        from slipstream.pooling.pooler import pool

        for seq in sched.seqs:
            if seq.start_pos != 0 or not seq.needs_sample:
                raise RuntimeError(f"pooling request {seq.request_id} was not scheduled whole")
        inputs = prepare_inputs(sched.seqs, self.block_size, self.device)
        extra = {}
        types = token_type_ids(sched.seqs, inputs.positions) if self.takes_token_types else None
        if types is not None:
            extra["token_type_ids"] = types
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                            **extra)
        pooled = pool(hidden, inputs.query_start_loc_cpu, self.config.pooler.pooling_type)
        if self.is_classifier:
            return self.model.pooling_head(pooled).float()
        return pooled

    def _finish(self, seq, vector: torch.Tensor) -> list[float]:
        from slipstream.pooling.pooler import finish_embedding

        params = seq.request.pooling_params
        return finish_embedding(vector, params, self.config.pooler).tolist()


def token_type_ids(seqs, positions: torch.Tensor) -> torch.Tensor | None:
    """[T] token types of a step: 1 from each text pair's second segment on (the request's
    pooling_params["token_type_start"]), else 0; None when no request of the step is a pair."""
    starts = [(seq.request.pooling_params or {}).get("token_type_start") for seq in seqs]
    if all(s is None for s in starts):
        return None
    lengths = [seq.num_tokens for seq in seqs]
    bounds = torch.tensor([s if s is not None else lengths[i] for i, s in enumerate(starts)])
    per_token = torch.repeat_interleave(bounds, torch.tensor(lengths)).to(positions.device)
    return (positions >= per_token).long()


def attach_pooled(outputs: list, runner_out: RunnerOutput) -> None:
    """Copy each request's pooled vector onto its EngineCoreOutput (EngineCore._apply)."""
    pooled = getattr(runner_out, "pooled", None)
    if not pooled:
        return
    for out in outputs:
        out.pooled = pooled.get(out.request_id)
