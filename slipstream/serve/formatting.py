"""Shared output formatting: stream deltas per choice, logprobs in both OpenAI shapes, usage.

Outputs from the engine are cumulative; `ChoiceCursor` remembers what a stream already sent so
each chunk carries only the new text, tokens and logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.outputs import CompletionOutput, RequestOutput
from slipstream.serve.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI reports very unlikely tokens like this


def stable_text(c: CompletionOutput, stops: list[str]) -> str:
    """Text that can be sent now: while running, hold back a tail that may start a stop string."""
    text = c.text
    if c.finish_reason is not None or not stops:
        return text
    longest = max(len(s) for s in stops) - 1
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return text[:-n]
    return text


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool


class ChoiceCursor:
    """What one choice of a stream has sent so far."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_tokens = 0
        self.started = False
        self.done = False

    def advance(self, c: CompletionOutput, stops: list[str]) -> Delta | None:
        if self.done:
            return None
        text = stable_text(c, stops)
        new_text = text[self.num_chars:] if len(text) > self.num_chars else ""
        new_ids = c.token_ids[self.num_tokens:]
        finished = c.finish_reason is not None
        if not new_text and not new_ids and not finished and self.started:
            return None
        lps = c.logprobs[self.num_tokens:] if c.logprobs is not None else None
        delta = Delta(new_text, list(new_ids), lps, public_reason(c.finish_reason),
                      c.stop_reason, not self.started)
        self.num_chars = max(self.num_chars, len(text))
        self.num_tokens = len(c.token_ids)
        self.started = True
        self.done = finished
        return delta


def public_reason(reason: str | None) -> str | None:
    # "abort" only reaches a client that is already gone; anything unknown reads as "stop".
    return None if reason is None else (reason if reason in ("stop", "length") else "stop")


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


class TokenText:
    """Token id -> its text, cached (logprobs decode the same ids again and again)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None and self._tokenizer is None:
            return f"token_id:{token_id}"
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 100_000:
                self._cache[token_id] = text
        return text


def _clamp(lp: float | None) -> float:
    if lp is None or lp != lp or lp < _MIN_LOGPROB:
        return _MIN_LOGPROB
    return float(lp)


def _top(entry: dict[int, float], num: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:num]


def completion_logprobs(token_text: TokenText, token_ids: list[int],
                        logprobs: list[dict[int, float] | None], num_top: int,
                        text_offset: int) -> CompletionLogprobs:
    """The /v1/completions shape; an entry of None (the first prompt token) has no logprob."""
    out = CompletionLogprobs()
    offset = text_offset
    for tid, entry in zip(token_ids, logprobs):
        tok = token_text(tid)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(entry.get(tid)))
        top: dict[str, float] = {}
        for t, lp in _top(entry, num_top):
            top.setdefault(token_text(t), _clamp(lp))  # distinct ids may share a text
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_text: TokenText, token_ids: list[int],
                  logprobs: list[dict[int, float]], num_top: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        tok = token_text(tid)
        tops = [TopLogprob(token=token_text(t), logprob=_clamp(lp),
                           bytes=list(token_text(t).encode("utf-8")))
                for t, lp in _top(entry, num_top)]
        content.append(TokenLogprob(token=tok, logprob=_clamp(entry.get(tid)),
                                    bytes=list(tok.encode("utf-8")), top_logprobs=tops))
    return ChatLogprobs(content=content)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
