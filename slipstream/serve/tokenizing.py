"""Tokenization and chat-template rendering off the event loop, behind a cheap length bound.

Encoding a few megabytes of text takes seconds; on the event loop it would stall `/health` and
every stream for that long. Here it runs in a thread pool sized to the host (HF tokenizers
release the GIL while they encode). Before that, a text whose byte length proves it cannot fit
the context is rejected at once: a token never stands for more than
`tokenizer.max_input_bytes_per_token` bytes, so such a text has more tokens than the limit.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from slipstream.serve.errors import APIError

T = TypeVar("T")


def pool_size() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class PromptTokenizer:
    """The server's tokenizer calls, each awaited without blocking the loop."""

    def __init__(self, tokenizer: Any, max_tokens: int, workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens  # the context length: no prompt may reach it
        per_token = getattr(tokenizer, "max_input_bytes_per_token", None)
        self.max_bytes = None if per_token is None else per_token * max_tokens
        self._pool = ThreadPoolExecutor(max_workers=workers or pool_size(), thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def check_bound(self, text: str, param: str) -> None:
        """400 for a text that is certainly longer than the context (no tokenizing)."""
        if self.max_bytes is None or len(text) <= self.max_bytes // 4:
            return  # at most 4 bytes a character: short enough whatever it holds
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_bytes:
            raise APIError(
                f"This model's maximum context length is {self.max_tokens} tokens, but the "
                f"{param} is {size} bytes long: more than {self.max_tokens} tokens of this "
                f"tokenizer (at most {self.max_bytes} bytes) could hold.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        self.check_bound(text, param)
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_pair(self, text_1: str, text_2: str, param: str) -> tuple[list[int], int | None]:
        """A cross-encoder's input: (token ids, where token type 1 starts or None)."""
        from slipstream.pooling.pairs import encode_pair

        self.check_bound(text_1 + text_2, param)
        return await self._run(encode_pair, self.tokenizer, text_1, text_2)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                          **template_kwargs) -> list[int]:
        """Render and encode in the pool; the bound applies to the rendered text.
        template_kwargs reach the chat template (e.g. tools=...)."""
        return await self._run(self._encode_chat, messages, add_generation_prompt,
                               template_kwargs)

    def _encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                     template_kwargs: dict) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)
        self.check_bound(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)
