"""Grammar-forced drafts: for constrained requests, the continuation their grammar forces
(JSON keys, quotes, colons, braces, enum literals) proposed as draft tokens and verified like
any other drafts, so a forced stretch costs one step instead of one step a token.

Exactness needs nothing from the drafts: verification masks row j of a constrained request
with its grammar after the first j drafts (sampling/speculative.py), so every row samples what
a plain constrained step would. A truly forced draft is the only token its row allows and is
always accepted; a jump-forward guess at the tokenization (`RequestGrammar.forced_drafts`) is
accepted where the model agrees.

Works beside a user's `speculative_config`: that proposer drafts for unconstrained requests
(it skips constrained ones) and this one for constrained requests.
"""

from __future__ import annotations

from slipstream.engine.request import Request
from slipstream.scheduler.output import RunnerOutput, SchedulerOutput
from slipstream.speculative.decoder import draft_room, may_draft

MAX_GRAMMAR_DRAFTS = 16


def check_grammar_forced_drafts(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_GRAMMAR_DRAFTS:
        raise ValueError(
            f"grammar_forced_drafts must be an integer in [0, {MAX_GRAMMAR_DRAFTS}], got {value!r}"
        )
    return value


class GrammarDrafter:
    def __init__(self, max_drafts: int, max_seq_len: int) -> None:
        self.max_drafts = max_drafts
        self.max_seq_len = max_seq_len
        self.enabled = True  # benchmarks switch the drafts off and on in one engine
        self.num_drafts = 0  # verifications
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def wants(self, running: list[Request]) -> bool:
        """Whether the next step may verify grammar drafts: its tokens must then be read
        before it is scheduled (no async step)."""
        return self.enabled and any(r.grammar is not None for r in running)

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of each constrained request that decodes next and whose grammar
        forces (or jump-forwards) a continuation."""
        if not self.enabled:
            return
        for r in running:
            if r.grammar is None or not may_draft(r):
                continue
            room = draft_room(r, self.max_seq_len)
            if room < 2:
                continue
            drafts = r.grammar.forced_drafts(min(self.max_drafts, room - 1))
            if drafts:
                r.spec_token_ids, r.spec_parents = drafts, None

    def record(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> dict[str, tuple[int, int]]:
        """Count the constrained verifications of a step; per request id (drafts, accepted)."""
        per_request = {}
        for seq in sched_out.seqs:
            if not seq.num_spec_tokens or seq.request.grammar is None:
                continue
            sampled = runner_out.sampled_token_ids.get(seq.request_id)
            if not sampled:
                continue
            accepted = min(len(sampled) - 1, seq.num_spec_tokens)
            per_request[seq.request_id] = (seq.num_spec_tokens, accepted)
            self.num_drafts += 1
            self.num_draft_tokens += seq.num_spec_tokens
            self.num_accepted_tokens += accepted
        return per_request

    def get_stats(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {
            "grammar_num_drafts": self.num_drafts,
            "grammar_num_draft_tokens": self.num_draft_tokens,
            "grammar_num_accepted_tokens": self.num_accepted_tokens,
            "grammar_acceptance_rate": rate,
        }

