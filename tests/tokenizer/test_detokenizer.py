"""IncrementalDetokenizer: streamed deltas equal a full decode (multi-byte text split across
tokens, random ids, special tokens), stop strings spanning tokens, hold-back and finalize."""
from __future__ import annotations

import random

import pytest

from slipstream.sampling_params import SamplingParams
from slipstream.tokenizer.detokenizer import IncrementalDetokenizer
from tests.tokenizer.tiny_tokenizer import byte_token_ids

TEXTS = [
    "hello world 😀 你好世界 naïve café 🎉🚀",
    "👍🏽🇫🇷 emoji sequences and 中文 mixed with ascii",
    "plain ascii only, nothing special here.",
]


def stream(tokenizer, prompt, tokens, params, rng=None, finalize=True):
    """Feed tokens in chunks of 1..3 (random) or one by one; returns (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 3) if rng else 1
        deltas.append(detok.update(tokens[i : i + n]))
        i += n
    if finalize:
        deltas.append(detok.finalize())
    return deltas, detok


def mixed_token_ids(tokenizer, text, rng):
    """Text encoded as a random mix of BPE tokens and single-byte tokens."""
    out = []
    for word in text.split(" "):
        piece = word + " "
        use_bytes = rng.random() < 0.5
        out += byte_token_ids(tokenizer, piece) if use_bytes else tokenizer.encode(piece, False)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_without_partial_characters(tokenizer, text):
    rng = random.Random(0)
    for trial in range(20):
        tokens = mixed_token_ids(tokenizer, text, rng)
        prompt = tokenizer.encode("prompt: ")
        deltas, detok = stream(tokenizer, prompt, tokens, SamplingParams(), rng if trial % 2 else None)
        assert "".join(deltas) == tokenizer.decode(tokens) == text + " "
        assert detok.text == text + " "
        # Valid text never needs a replacement character, even mid-stream.
        assert all("\ufffd" not in d for d in deltas)


def test_every_byte_split_of_an_emoji_waits_for_the_whole_character(tokenizer):
    tokens = byte_token_ids(tokenizer, "😀")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert [detok.update([t]) for t in tokens] == ["", "", "", "😀"]


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_token_ids_concatenate_to_full_decode(tokenizer, skip_special):
    """Any id sequence (invalid UTF-8, special tokens) streams to exactly decode(all)."""
    rng = random.Random(1 if skip_special else 2)
    params = SamplingParams(skip_special_tokens=skip_special)
    for _ in range(150):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 8))]
        tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas, detok = stream(tokenizer, prompt, tokens, params, rng)
        expected = tokenizer.decode(tokens, skip_special_tokens=skip_special)
        assert "".join(deltas) == expected
        assert detok.text == expected


def test_skip_special_tokens(tokenizer):
    tokens = tokenizer.encode("hi", False) + [tokenizer.eos_token_ids[-1]]
    kept, _ = stream(tokenizer, [], tokens, SamplingParams(skip_special_tokens=False))
    skipped, _ = stream(tokenizer, [], tokens, SamplingParams(skip_special_tokens=True))
    assert "".join(kept) == "hi</s>"
    assert "".join(skipped) == "hi"


def test_stop_terminated_leaves_the_last_token_out(tokenizer):
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    eos = tokenizer.hf.eos_token_id
    text = detok.update(tokenizer.encode("ok", False)) + detok.update([eos], stop_terminated=True)
    assert text + detok.finalize() == "ok"
    included = IncrementalDetokenizer(tokenizer, [], params.clone(include_stop_str_in_output=True))
    included.update(tokenizer.encode("ok", False) + [eos], stop_terminated=True)
    included.finalize()
    assert included.text == "ok</s>"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_trimmed(tokenizer, include):
    text = "hello world, the quick brown fox"
    tokens = byte_token_ids(tokenizer, text)  # one byte per token: "o w" spans three tokens
    params = SamplingParams(stop=["o w", "zzz"], include_stop_str_in_output=include)
    deltas, detok = stream(tokenizer, [], tokens, params, finalize=False)
    expected = "hello w" if include else "hell"
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert detok.stop_matched == "o w"
    assert detok.update(tokenizer.encode("more", False)) == "" and detok.finalize() == ""


def test_earliest_stop_string_wins_and_emoji_stop(tokenizer):
    tokens = byte_token_ids(tokenizer, "abc 😀 def")
    params = SamplingParams(stop=["def", "😀"])
    deltas, detok = stream(tokenizer, [], tokens, params, finalize=False)
    assert "".join(deltas) == "abc " and detok.stop_matched == "😀"


def test_hold_back_releases_text_that_cannot_start_a_stop(tokenizer):
    params = SamplingParams(stop=["xyz"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.update(tokenizer.encode("abc", False)) == "abc"
    assert detok.update(tokenizer.encode("x", False)) == ""  # could start "xyz"
    assert detok.update(tokenizer.encode("y", False)) == ""
    assert detok.update(tokenizer.encode("a", False)) == "xya"  # cannot any more
    assert detok.update(tokenizer.encode("xy", False)) == ""
    assert detok.finalize() == "xy"  # the request ended without a stop
    assert detok.text == "abcxyaxy" and detok.stop_matched is None


def test_random_stop_strings_match_reference_truncation(tokenizer):
    """Streamed output == full text cut at the earliest stop occurrence; never a take-back."""
    rng = random.Random(3)
    alphabet = "ab 😀中"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
        include = rng.random() < 0.5
        tokens = mixed_token_ids(tokenizer, text, rng)
        full = tokenizer.decode(tokens)
        hits = [(full.find(s), s) for s in stops if s in full]
        if hits:
            pos, stop = min(hits, key=lambda h: h[0])
            expected = full[: pos + len(stop)] if include else full[:pos]
        else:
            expected, stop = full, None
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        deltas, detok = stream(tokenizer, [], tokens, params, rng)
        assert "".join(deltas) == expected, (text, stops, include)
        assert detok.stop_matched == stop
        assert detok.text == expected


def test_prompt_context_does_not_leak_into_output(tokenizer):
    prompt = tokenizer.encode("a prompt that ends mid") + byte_token_ids(tokenizer, "😀")[:2]
    tokens = tokenizer.encode(" and then text", False)
    deltas, detok = stream(tokenizer, prompt, tokens, SamplingParams())
    assert "".join(deltas) == " and then text" == detok.text


def test_update_cost_does_not_grow_with_output_length(tokenizer, monkeypatch):
    """Each update decodes a short window, not the whole output (O(new tokens))."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    lengths: list[int] = []
    real = tokenizer.decode
    monkeypatch.setattr(
        tokenizer, "decode", lambda ids, **kw: lengths.append(len(ids)) or real(ids, **kw)
    )
    for t in tokenizer.encode("the quick brown fox " * 30, False):
        detok.update([t])
    assert max(lengths) <= 4


@pytest.mark.parametrize("skip_special", [True, False])
def test_deferred_tokens_give_the_streamed_text(tokenizer, skip_special):
    """defer() gives what update() streams for the same tokens (random ids, partial characters
    included): read after every chunk (a streaming server) the text is the same at each step;
    read now and then (offline), the same once finalized."""
    rng = random.Random(3)
    params = SamplingParams(skip_special_tokens=skip_special)
    for trial in range(100):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 8))]
        tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        eager = IncrementalDetokenizer(tokenizer, prompt, params)
        lazy = IncrementalDetokenizer(tokenizer, prompt, params)
        every_step = trial % 2 == 0
        i = 0
        while i < len(tokens):
            n = rng.randint(1, 9)
            eager.update(tokens[i : i + n])
            lazy.defer(tokens[i : i + n])
            if every_step:
                assert lazy.text == eager.text
            elif rng.random() < 0.3:
                _ = lazy.text  # an occasional read moves the decode window differently
            i += n
        eager.finalize()
        lazy.finalize()
        assert lazy.text == eager.text == tokenizer.decode(tokens, skip_special_tokens=skip_special)
        assert lazy.num_tokens == eager.num_tokens == len(tokens)


def test_deferred_stop_token_and_stop_strings(tokenizer):
    """defer() drops an engine stop token like update(); with stop strings it is update()."""
    ok = tokenizer.encode("ok", False)
    lazy = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    lazy.defer(ok + [tokenizer.hf.eos_token_id], stop_terminated=True)
    lazy.finalize()
    assert lazy.text == "ok" and lazy.num_tokens == len(ok) + 1
    stopper = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["k"]))
    stopper.defer(ok)
    assert stopper.stop_matched == "k" and stopper.text == "o"
