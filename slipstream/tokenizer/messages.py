"""Chat messages: validation and normalisation before a chat template renders them.
OpenAI-style content parts become plain text.
"""
from __future__ import annotations

from typing import Any

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
