"""Incremental detokenizer: new token ids -> the new stable text, with stop strings.

Decodes only a short window of tokens per update (a prefix offset and a read offset, like
vLLM), waits while the window ends in an incomplete UTF-8 character, and holds back the tail
that could still become a stop string, so streamed deltas never have to be taken back.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slipstream.sampling_params import SamplingParams
    from slipstream.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Trailing prompt tokens decoded as context: tokenizers such as SentencePiece drop the leading
# space of the first token in a decode, which would glue the first output word to the prompt.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One request's output text. `text` is the decoded output so far (truncated at a stop
    string), `stop_matched` the stop string that ended it (None while none has)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        # With include_stop_str_in_output nothing before a stop string's end is ever cut, so
        # there is nothing to hold back.
        self._max_hold = 0 if self._include_stop or not self._stops else max(map(len, self._stops)) - 1
        self._ids: list[int] = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0  # window start: context for the tokens after read_offset
        self._read_offset = len(self._ids)  # tokens before this are decoded
        self._text = ""
        self.stop_matched: str | None = None
        self.num_tokens = 0  # output tokens seen
        self._emitted = 0  # characters of `text` already returned
        self._finalized = False

    @property
    def finished(self) -> bool:
        return self.stop_matched is not None or self._finalized

    @property
    def text(self) -> str:
        """The output text so far (tokens added by `defer` are decoded now)."""
        if not self.finished:
            self._append(self._decode_new(final=False))
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str:
        """Add output tokens; return the text that became stable (possibly "").

        stop_terminated: the last token is the EOS / stop token id that ends the request; it
        is left out of the text unless include_stop_str_in_output.
        """
        if self.finished:
            return ""
        self._add_ids(new_token_ids, stop_terminated)
        self._append(self._decode_new(final=False))
        return self._release()

    def defer(self, new_token_ids: list[int], stop_terminated: bool = False) -> None:
        """update() without decoding yet, for callers that read `text` now and then rather than
        every delta: one decode per read instead of one per step (per-step decodes were most of
        an offline batch's host time between GPU steps). Stop strings must see every delta,
        so with stop strings this is update()."""
        if self._stops:
            self.update(new_token_ids, stop_terminated)
            return
        if self.stop_matched is None and not self._finalized:  # not finished (inlined: per step)
            self.num_tokens += len(new_token_ids)
            if stop_terminated and not self._include_stop:
                new_token_ids = new_token_ids[:-1]
            self._ids.extend(new_token_ids)

    def _add_ids(self, new_token_ids: list[int], stop_terminated: bool) -> None:
        self.num_tokens += len(new_token_ids)
        end = len(new_token_ids) - (stop_terminated and not self._include_stop)
        self._ids.extend(new_token_ids[:max(end, 0)])

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy with the same text so far, to go on with other tokens (the
        hypotheses of a beam search share their settled start)."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        return twin

    def finalize(self) -> str:
        """The request ended without a stop string: release everything still held back,
        including an incomplete character (as the replacement character, like decode())."""
        if self.finished:
            return ""
        self._append(self._decode_new(final=True))
        self._finalized = True
        return self._release()

    # -- decoding ------------------------------------------------------------------------

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A context that ends mid-character would swallow the first output bytes.
        if ctx and self._decode(ctx).endswith(_REPLACEMENT):
            return []
        return ctx

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens after read_offset, or "" while it ends mid-character."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (
            len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT)
        ):
            # More bytes may complete the character; decode the same window again later.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window_text[len(prefix_text) :]

    # -- stop strings and hold-back ------------------------------------------------------

    def _append(self, delta: str) -> None:
        if not delta:
            return
        start = len(self._text)
        self._text += delta
        match = self._find_stop(start)
        if match is not None:
            pos, stop = match
            self._text = self._text[: pos + len(stop) if self._include_stop else pos]
            self.stop_matched = stop

    def _find_stop(self, new_start: int) -> tuple[int, str] | None:
        """The earliest stop string occurrence that ends in the text added at new_start."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = self._text.find(stop, max(0, new_start - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest tail of text that is the start of some stop string."""
        for n in range(min(self._max_hold, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

    def _release(self) -> str:
        end = len(self._text)
        if not self.finished:
            end -= self._held_back()
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
