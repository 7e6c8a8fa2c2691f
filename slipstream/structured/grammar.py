"""RequestGrammar: one request's position in its compiled grammar (an xgrammar matcher).

The scheduler advances it with every token it appends (`accept`; a step's single tokens of all
requests together, `accept_batch`); the sampler asks it for the next token's bitmask
(`fill_bitmask`; one row per verification row of drafts, `fill_bitmask_along`). It also
proposes the continuation the grammar forces as draft tokens (`forced_drafts`); the scheduler
advances it over the accepted ones only, with `accept`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from slipstream.engine.request import RequestStatus

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(
        self, compiled: Any, stop_token_ids: tuple[int, ...], encode: Callable[[str], list[int]] | None = None
    ) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        # Only a stop token can end the grammar: the others need no is_terminated() call.
        self._stop_ids = frozenset(self._matcher.stop_token_ids)
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self._scratch: torch.Tensor | None = None  # one bitmask row for forced_drafts
        self._encode = encode  # the tokenizer's text -> ids, for forced strings

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

    def fill_bitmask_along(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts) of `bitmask`: row + j is the next-token mask after the
        first j drafts, as a plain step there would see it. The matcher ends where it started.
        Past a draft the grammar rejects (its row never samples it, so no later row is kept)
        or ends on (the scheduler stops there), rows repeat the last mask."""
        matcher = self._matcher
        matcher.fill_next_token_bitmask(bitmask, row)
        advanced, live = 0, True
        for j, token in enumerate(drafts, 1):
            if live and not matcher.is_terminated() and matcher.accept_token(token):
                advanced += 1
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, row + j)
                    continue
            live = False
            bitmask[row + j].copy_(bitmask[row + j - 1])
        if advanced:
            matcher.rollback(advanced)

    def forced_drafts(self, limit: int) -> list[int]:
        """Up to `limit` draft tokens from the grammar alone: while its mask allows exactly
        one token, that token (a forced one, always accepted); elsewhere the string the grammar
        forces (xgrammar's jump-forward string) as the tokenizer splits it, a guess at the
        model's tokenization that the masked verification accepts or replaces. The matcher
        ends where it started."""
        matcher, drafts = self._matcher, []
        while len(drafts) < limit and not matcher.is_terminated():
            only = self._only_allowed()
            tokens = [only] if only is not None else self._jump_forward()
            if not tokens:
                break
            for token in tokens[: limit - len(drafts)]:
                if not matcher.accept_token(token):
                    break
                drafts.append(token)
            else:
                continue
            break
        if drafts:
            matcher.rollback(len(drafts))
        return drafts

    def _jump_forward(self) -> list[int]:
        """The forced string's tokens: the tokenizer's split where the mask (just filled by
        _only_allowed) allows its first token, else xgrammar's (a tokenizer that prefixes a
        space, say)."""
        if self._encode is not None:
            text = self._matcher.find_jump_forward_string()
            if not text:
                return []
            tokens = self._encode(text)
            if tokens and self._allowed(tokens[0]):
                return tokens
        return self._matcher.find_jump_forward_tokens()

    def _allowed(self, token: int) -> bool:
        words = self._scratch.numpy()[0].view(np.uint32)
        return token < self._vocab_size and bool((int(words[token >> 5]) >> (token & 31)) & 1)

    def _only_allowed(self) -> int | None:
        """The one token the next mask allows, or None (none or several)."""
        if self._scratch is None:
            self._scratch = torch.empty(1, -(-self._vocab_size // 32), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(self._scratch, 0)
        words = self._scratch.numpy()[0].view(np.uint32)
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        word = int(words[nonzero[0]])
        if word & (word - 1):
            return None
        return int(nonzero[0]) * 32 + word.bit_length() - 1


def accept_batch(grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
    """Advance each grammar over its token in one xgrammar call (a step's constrained rows);
    whether each accepted it."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)
