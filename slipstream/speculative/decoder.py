"""SpeculativeDecoder: the engine's speculation hook. After each step it asks the proposer for
draft tokens for the running requests that decode next (`request.spec_token_ids`); the
scheduler feeds them beside the last token, the sampler verifies them (sampling/speculative.py)
and the scheduler rolls back the slots of rejected ones. It also keeps the statistics."""

from __future__ import annotations

import logging

from slipstream.config import EngineConfig
from slipstream.engine.request import Request, RequestStatus
from slipstream.sampling.penalties import has_penalties
from slipstream.scheduler.output import RunnerOutput, SchedulerOutput
from slipstream.speculative import tree
from slipstream.speculative.adaptive import choose_k
from slipstream.speculative.config import SpeculativeConfig
from slipstream.speculative.step_cost import StepCostEstimator

logger = logging.getLogger(__name__)

# Per-token acceptance assumed before any draft is verified, and the weight of each new step
# in the running estimate (an exponential moving average over steps). Each step's estimate
# counts a trial per draft position a verification reached: its accepted drafts, and the
# first rejected one unless all up to its depth were accepted (the maximum-likelihood a of a
# chain whose drafts are each right with probability a; a tree's nodes at one depth compete
# for one position).
_PRIOR_ACCEPTANCE = 0.7
_EMA_WEIGHT = 0.1
# With adaptive k at 0 (acceptance too low to pay), one proposal round in this many drafts
# k = 1 anyway, so the estimate can recover when the text turns predictable again.
_PROBE_EVERY = 32


class SpecStats:
    """Counters of one method: drafts proposed and accepted, verifications (one per request a
    step), and tokens those verifications emitted."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0

    def as_dict(self) -> dict[str, float]:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean_len = self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": rate,
            "mean_accepted_length": mean_len,
        }


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer, max_seq_len: int):
        self.config = config
        self.proposer = proposer
        self.max_seq_len = max_seq_len
        self.enabled = True  # benchmarks switch speculation off and on in one engine
        self.acceptance = _PRIOR_ACCEPTANCE
        self.stats = SpecStats()
        self.last_k = config.num_speculative_tokens
        self._rounds_off = 0  # proposal rounds since adaptive k last drafted anything
        self.step_cost = StepCostEstimator(config.ridge_tokens)
        self._applied: list[tuple[SchedulerOutput, int]] = []  # steps read back this engine step
        self._last_step_end: float | None = None

    @property
    def method(self) -> str:
        return self.config.method

    def num_drafts_for(self, batch_size: int) -> int:
        """Draft tokens per request for a decode batch of this size (0: no speculation)."""
        cfg = self.config
        if not self.enabled or batch_size == 0:
            return 0
        if cfg.disable_by_batch_size is not None and batch_size >= cfg.disable_by_batch_size:
            return 0
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        return choose_k(
            batch_size,
            cfg.num_speculative_tokens,
            self.acceptance,
            cfg.ridge_tokens,
            self.step_cost.cost_ratio(batch_size),
        )

    def _probe_due(self, batch_size: int) -> bool:
        """Adaptive k chose 0: every _PROBE_EVERY such rounds, one with a single draft (never
        past disable_by_batch_size)."""
        cfg = self.config
        if not (self.enabled and cfg.adaptive):
            return False
        if cfg.disable_by_batch_size is not None and batch_size >= cfg.disable_by_batch_size:
            return False
        self._rounds_off += 1
        if self._rounds_off < _PROBE_EVERY:
            return False
        self._rounds_off = 0
        return True

    def wants(self, batch_size: int) -> bool:
        """Whether steps of this batch size speculate (the engine then reads every step's tokens
        before the next: no async steps or multi-step decode)."""
        return self.num_drafts_for(batch_size) > 0

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of each running request that decodes next (drafts are cleared by
        the scheduler when it schedules the request, used or not)."""
        k = self.num_drafts_for(len(running))
        if k == 0 and running and self._probe_due(len(running)):
            k = 1
        if running:
            self.last_k = k
        if k == 0:
            return
        wanted = []
        for r in running:
            room = draft_room(r, self.max_seq_len)
            if room >= 2 and _may_speculate(r):
                wanted.append((r, min(k, room - 1)))
        if not wanted:
            return
        by_id = {r.request_id: r for r, _ in wanted}
        for rid, drafts in self.proposer.propose(wanted).items():
            # A proposer returns a chain of tokens, or a tree as (tokens, parents).
            tokens, parents = drafts if isinstance(drafts, tuple) else (drafts, None)
            request = by_id[rid]
            if parents is not None and _seeded_sampling(request):
                # One draw per emitted token keeps seeded outputs as without speculation:
                # a chain (sampling/speculative.py).
                tokens, parents = tree.first_chain(tokens, parents), None
            if tokens:
                request.spec_token_ids = list(tokens)
                request.spec_parents = None if parents is None else list(parents)

    def record(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> dict[str, tuple[int, int]]:
        """Count a verified step; per request id (drafts, accepted) for its output. A proposer
        that drafts from the target's hidden states gets the step's (`observe`); one that
        learns from every verification row gets them (`observe_verification`)."""
        if runner_out.spec_hidden is not None:
            self.proposer.observe(runner_out.spec_hidden)
        if runner_out.spec_row_token_ids and hasattr(self.proposer, "observe_verification"):
            self.proposer.observe_verification(sched_out, runner_out)
        per_request = {}
        proposed = accepted = trials = 0
        for seq in sched_out.seqs:
            if not seq.num_spec_tokens or seq.request.grammar is not None:
                continue  # a constrained request's drafts are the grammar's (grammar_drafts.py)
            sampled = runner_out.sampled_token_ids.get(seq.request_id)
            if not sampled:
                continue
            n = min(len(sampled) - 1, seq.num_spec_tokens)
            per_request[seq.request_id] = (seq.num_spec_tokens, n)
            proposed += seq.num_spec_tokens
            trials += n + (n < _depth(seq))
            accepted += n
            self.stats.num_drafts += 1
            self.stats.num_emitted_tokens += n + 1
        if proposed:
            self.stats.num_draft_tokens += proposed
            self.stats.num_accepted_tokens += accepted
            self.acceptance += _EMA_WEIGHT * (accepted / trials - self.acceptance)
        return per_request

    def step_applied(self, sched_out: SchedulerOutput, num_steps: int) -> None:
        """The engine read back a step that ran num_steps decode steps without the host."""
        self._applied.append((sched_out, num_steps))

    def step_ended(self, now: float) -> None:
        """An engine step (`EngineCore.step`, proposing included) ended at `now` (seconds).

        The time since the previous one is the cost of the step read back in between: in steady
        state that holds with async steps and pipelined multi-step decode too, as each engine
        step then reads back one step. Engine steps that read back none or two (idle, the first
        async launch, leaving async mode) are not measured, nor is the one after them; nor are
        steps with a prefill chunk."""
        applied, self._applied = self._applied, []
        last, self._last_step_end = self._last_step_end, now if len(applied) == 1 else None
        if last is None or len(applied) != 1:
            return
        sched_out, num_steps = applied[0]
        seqs = sched_out.seqs
        if not seqs or any(s.num_tokens != 1 + s.num_spec_tokens or not s.needs_sample for s in seqs):
            return
        if any(s.num_spec_tokens for s in seqs):
            self.step_cost.record_verify(len(seqs), sched_out.num_batched_tokens, now - last)
        else:
            self.step_cost.record_plain(len(seqs), now - last, num_steps)

    def forget(self, request_ids) -> None:
        self.proposer.forget(request_ids)

    def get_stats(self) -> dict:
        """Flat totals (for /metrics) and per-method detail."""
        s = self.stats.as_dict()
        return {
            "spec_num_draft_tokens": s["num_draft_tokens"],
            "spec_num_accepted_tokens": s["num_accepted_tokens"],
            "spec_acceptance_rate": s["acceptance_rate"],
            "spec_mean_accepted_length": s["mean_accepted_length"],
            "spec_num_speculative_tokens": self.last_k,
            "spec_step_cost_ratio": self.step_cost.ratios(),
            "speculative": {self.method: s},
        }


def _depth(seq) -> int:
    """The most drafts a verification can accept: a chain's length, a tree's depth."""
    return max(tree.depths(seq.spec_parents)) if seq.spec_parents else seq.num_spec_tokens


def _seeded_sampling(r: Request) -> bool:
    p = r.sampling_params
    return p.seed is not None and not p.greedy


def may_draft(r: Request) -> bool:
    """Decoding next with its last token known, and nothing in its sampling other than a
    grammar that depends on the output so far token by token (penalties, a pending min_tokens,
    bad words or logits processors; logit controls are kept off the verification rows)."""
    p = r.sampling_params
    return (
        r.status == RequestStatus.RUNNING
        and r.num_pending == 0
        and r.num_tokens - r.num_computed_tokens == 1
        and not has_penalties(p)
        and r.num_output_tokens >= p.min_tokens
        and not p.has_logit_controls
    )


def _may_speculate(r: Request) -> bool:
    """may_draft, and no grammar: a constrained request's drafts are the grammar's own."""
    return r.grammar is None and may_draft(r)


def build_decoder(config: EngineConfig, max_seq_len: int):
    """The configured proposer and its decoder, or None without speculation."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from slipstream.speculative.ngram import NgramProposer

        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "draft_model":
        from slipstream.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config)
    elif spec.method in ("eagle", "eagle3"):  # the checkpoint's layout decides which
        from slipstream.speculative.eagle import EagleProposer

        proposer = EagleProposer(config)
    elif spec.method == "lookahead":
        from slipstream.speculative.lookahead import LookaheadProposer

        proposer = LookaheadProposer(spec.lookahead_window, spec.lookahead_ngram, spec.lookahead_candidates)
    elif spec.method == "medusa":
        import torch

        from slipstream.dtypes import resolve_dtype
        from slipstream.speculative.medusa import MedusaProposer

        proposer = MedusaProposer(
            spec.model,
            spec.num_speculative_tokens,
            spec.token_tree(),
            config.model.vocab_size,
            resolve_dtype(config.dtype),
            torch.device(config.device),
        )
    else:
        from slipstream.speculative.oracle import OracleProposer

        proposer = OracleProposer(
            spec.acceptance_rate, config.model.vocab_size, config.seed, spec.token_tree()
        )
    logger.info(
        "speculative decoding: %s, up to %d draft tokens a step%s",
        spec.method,
        spec.num_speculative_tokens,
        f" (adaptive, ridge {spec.ridge_tokens} tokens)" if spec.adaptive else "",
    )
    return SpeculativeDecoder(spec, proposer, max_seq_len)


def draft_room(r: Request, max_seq_len: int) -> int:
    """Tokens the request may still emit: a step's drafts plus its bonus token fit in it."""
    room = max_seq_len - r.num_tokens
    if r.sampling_params.max_tokens is not None:
        room = min(room, r.sampling_params.max_tokens - r.num_output_tokens)
    return room
