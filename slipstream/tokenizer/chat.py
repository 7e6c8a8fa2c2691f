"""A small multi-turn Conversation for the `slipstream chat` loop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slipstream.tokenizer.tokenizer import Tokenizer


@dataclass
class Conversation:
    """A growing multi-turn chat (the `slipstream chat` loop keeps one)."""

    system_prompt: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.system_prompt and not self.messages:
            self.messages.append({"role": "system", "content": self.system_prompt})

    def add_user(self, content: str) -> None:
        self.messages.append({"role": "user", "content": content})

    def add_assistant(self, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content})

    def prompt_token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The whole conversation rendered with a generation prompt, as token ids."""
        return tokenizer.encode_chat(self.messages, add_generation_prompt=True)

    def reset(self) -> None:
        self.messages = self.messages[:1] if self.system_prompt else []
