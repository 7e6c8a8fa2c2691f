"""Tokenizer wrapper: HF-identical encoding (BOS only where HF adds it), decode, EOS ids from
generation_config.json, chat templates, message validation and the CLI's Conversation."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from slipstream.tokenizer.chat import Conversation
from slipstream.tokenizer.messages import normalize_messages
from slipstream.tokenizer.tokenizer import load_tokenizer
from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

TEXT = "hello world 😀 你好 café"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": [{"type": "text", "text": "how "}, {"type": "text", "text": "are"}]},
]


@pytest.mark.parametrize("add_bos", [True, False])
def test_encode_matches_hf(tmp_path, add_bos):
    path = make_tiny_tokenizer(tmp_path / "tok", add_bos=add_bos)
    tok = load_tokenizer(path)
    hf = AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(TEXT)
    assert ids == hf(TEXT)["input_ids"]
    assert (ids[0] == tok.bos_token_id) is add_bos
    assert tok.encode(TEXT, add_special_tokens=False) == hf(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == ("<s>" if add_bos else "") + TEXT


def test_special_ids_vocab_and_tokens(tokenizer):
    assert tokenizer.vocab_size == len(tokenizer.hf) == len(tokenizer)
    # generation_config.json lists 5 and </s> (1); the tokenizer's own EOS is not repeated.
    assert tokenizer.eos_token_ids == (5, 1)
    assert tokenizer.eos_token_id == 5
    assert {0, 1, 2, 5} <= tokenizer.all_special_ids
    ids = tokenizer.encode("hello", add_special_tokens=False)
    assert "".join(tokenizer.convert_ids_to_tokens(ids)) == "hello"
    assert tokenizer.convert_ids_to_tokens([0, 1]) == ["<s>", "</s>"]


def test_eos_without_generation_config(tmp_path):
    tok = load_tokenizer(make_tiny_tokenizer(tmp_path / "tok"))
    assert tok.eos_token_ids == (1,)


def test_chat_template_applied(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES)
    assert text == (
        "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>hello<|end|>"
        "<|user|>how are<|end|><|assistant|>"
    )
    no_prompt = tokenizer.apply_chat_template(MESSAGES[:2], add_generation_prompt=False)
    assert no_prompt == "<|system|>be brief<|end|><|user|>hi<|end|>"
    # The template writes its own special tokens: encode_chat adds no BOS on top.
    ids = tokenizer.encode_chat(MESSAGES[1:2])
    assert ids[0] == tokenizer.hf.convert_tokens_to_ids("<|user|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|user|>hi<|end|><|assistant|>"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = load_tokenizer(make_tiny_tokenizer(tmp_path / "tok", chat_template=False))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        load_tokenizer(tmp_path / "empty")


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "non-empty"),
        ("hello", "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
        (["hi"], "dict"),
    ],
)
def test_bad_messages(tokenizer, bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_messages(bad)
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(bad)


def test_conversation_grows_and_resets(tokenizer):
    conv = Conversation(system_prompt="be brief")
    conv.add_user("hi")
    ids = conv.prompt_token_ids(tokenizer)
    expected = "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    conv.add_assistant("hello")
    conv.add_user("more")
    assert len(conv.messages) == 4
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "be brief"}]


def test_decode_takes_the_rust_path_and_matches_hf(tokenizer):
    """decode() skips HF's Python wrapper for a plain fast tokenizer; the text must be HF's
    own (no space clean-up) for any ids, special tokens kept or skipped."""
    import random

    assert tokenizer._backend_decode is not None
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 10))]
        ids += rng.sample(special, k=min(len(special), rng.randrange(0, 2)))
        rng.shuffle(ids)
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
