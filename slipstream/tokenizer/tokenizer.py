"""Tokenizer: a thin wrapper over a local Hugging Face tokenizer (never remote code).

Encoding mirrors HF's defaults (a BOS is added only where the tokenizer adds one) so greedy
output can be compared with transformers token for token; EOS ids merge generation_config.json.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from slipstream.tokenizer.messages import normalize_messages


class Tokenizer:
    """The engine's view of a tokenizer: ids <-> text, special ids, chat template."""

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: tuple[int, ...] = (),
        path: str | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        self.path = path
        self.eos_token_ids = eos_token_ids
        self.all_special_ids = frozenset(hf_tokenizer.all_special_ids)
        self.vocab_size = len(hf_tokenizer)  # base vocabulary plus added tokens
        self._backend_decode = _backend_decode(hf_tokenizer)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. add_special_tokens=True is HF's default: the tokenizer's own
        post-processor decides (Llama adds BOS, Qwen adds nothing). Use False for text that
        already carries its special tokens, such as a rendered chat template."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: it is not prefix-stable, so streamed text would drift from it.
        if self._backend_decode is not None:  # the same text, without HF's per-call overhead
            return self._backend_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    @functools.cached_property
    def max_input_bytes_per_token(self) -> int | None:
        """Most bytes of input text one token can stand for (None: unknown), so a text longer
        than this times a token limit cannot fit it. A vocabulary entry's UTF-8 length bounds
        the bytes it covers (byte-level and SentencePiece spellings only overstate them); a
        normalizer may shrink text first (NFKC: 3 bytes to 1), hence the factor 4 then."""
        try:
            longest = max(len(piece.encode("utf-8")) for piece in self.hf.get_vocab())
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            return None
        backend = getattr(self.hf, "backend_tokenizer", None)
        normalizes = backend is None or backend.normalizer is not None
        return max(longest, 1) * (4 if normalizes else 1)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the tokenizer's chat template (kwargs reach the template,
        e.g. tools=...). Raises ValueError without a template or for malformed messages."""
        if not self.has_chat_template:
            where = f" at {self.path}" if self.path else ""
            raise ValueError(
                f"the tokenizer{where} has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja); use generate() with a plain "
                "prompt, or add a template to the model directory"
            )
        text = self.hf.apply_chat_template(
            normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of a rendered chat: the template writes its own BOS, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer in a local model directory or GGUF file (no network, no remote code)."""
    from slipstream.tokenizer.gguf_tokenizer import gguf_tokenizer_file, load_gguf_tokenizer

    if (gguf := gguf_tokenizer_file(path)) is not None:
        return load_gguf_tokenizer(gguf)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path!s} does not exist")
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {path!s}: {exc}") from exc
    return Tokenizer(hf, _eos_token_ids(path, hf), str(path))


def maybe_load_tokenizer(path: str | Path | None) -> Tokenizer | None:
    """The tokenizer of the checkpoint at `path`, or None where it has no tokenizer files."""
    from slipstream.tokenizer.gguf_tokenizer import HF_TOKENIZER_FILES, gguf_tokenizer_file

    if path is None or not (gguf_tokenizer_file(path) or any(
            (Path(path) / f).is_file() for f in HF_TOKENIZER_FILES)):
        return None
    return load_tokenizer(path)


def _eos_token_ids(path: Path, hf: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """generation_config.json's EOS ids (config.json's when it is absent), then the
    tokenizer's own, without duplicates: generation stops at any of them."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(path / name)
        if cfg is not None and cfg.get("eos_token_id") is not None:
            eos = cfg["eos_token_id"]
            ids.extend(eos if isinstance(eos, list) else [eos])
            break
    if hf.eos_token_id is not None:
        ids.append(hf.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _backend_decode(hf_tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer's decode when HF's decode (without space clean-up) is nothing more;
    None for tokenizers whose class decodes its own way. Streaming decodes twice per token,
    and HF's Python wrapper around the Rust call is most of that time."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(hf_tokenizer)
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    if (not isinstance(hf_tokenizer, TokenizersBackend) or backend is None
            or cls.decode is not TokenizersBackend.decode
            or cls._decode is not TokenizersBackend._decode):
        return None
    return backend.decode
