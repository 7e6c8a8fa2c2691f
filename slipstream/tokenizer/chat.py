"""Chat messages: validation and normalisation before a chat template renders them, and a
small multi-turn Conversation for the CLI. OpenAI-style content parts become plain text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.tokenizer.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool", "developer")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a list of chat messages and return copies with string content.

    Each message needs a known `role` and a `content` that is a string, None (an assistant
    turn that only calls tools) or a list of {"type": "text", "text": ...} parts.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{index}].role must be one of {ROLES}, got {role!r}")
    out = dict(message)
    out["content"] = _content_text(index, message.get("content"))
    return out


def _content_text(index: int, content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"messages[{index}].content: only text parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


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
