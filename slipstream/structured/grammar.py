"""RequestGrammar: one request's position in its compiled grammar (an xgrammar matcher).

The scheduler advances it with every token it appends (`accept`; a step's single tokens of all
requests together, `accept_batch`); the sampler asks it for the next token's bitmask
(`fill_bitmask`). Speculative decoding will check draft tokens with `accept` and undo the
rejected ones with `rollback`.
"""

from __future__ import annotations

import logging
from typing import Any

from slipstream.engine.request import RequestStatus

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(self, compiled: Any, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        # Only a stop token can end the grammar: the others need no is_terminated() call.
        self._stop_ids = frozenset(self._matcher.stop_token_ids)

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def accept(self, tokens: list[int], status: RequestStatus | None) -> tuple[int, RequestStatus | None]:
        """Advance over `tokens` (those the scheduler appends, `status` the one they leave);
        returns how many to keep and the status after them: a grammar that has ended (its stop
        token accepted) finishes the request with "stop"."""
        matcher = self._matcher
        for i, token in enumerate(tokens):
            if not matcher.accept_token(token):
                # Only a token the mask allowed is sampled; a rejection means the mask and the
                # matcher disagree, and the output could not parse any more.
                logger.warning("grammar rejected token %d; ending the request", token)
                return i, RequestStatus.FINISHED_STOPPED
            if token in self._stop_ids and matcher.is_terminated():
                return i + 1, RequestStatus.FINISHED_STOPPED
        return len(tokens), status

    def ends_on(self, token: int) -> bool:
        """Whether accepting `token` ends the grammar (a stop token: the mask allows one only
        where the grammar may end)."""
        return token in self._stop_ids

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected draft tokens)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def matcher(self) -> Any:
        return self._matcher

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [R, ceil(V / 32)] mask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def accept_batch(grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
    """Advance each grammar over its token in one xgrammar call (a step's constrained rows);
    whether each accepted it."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)
