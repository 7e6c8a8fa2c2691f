"""The offline API validates as the server does: each bad input is a ValueError naming the field,
nothing is cut to fit or converted, and the engine keeps serving afterwards."""

from __future__ import annotations

import pytest

from slipstream import LLM, SamplingParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir):
    return LLM(
        str(tiny_chat_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_tokens=64,
    )


def _params_changed_after_construction(**changes) -> SamplingParams:
    params = SamplingParams(max_tokens=2)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([1] * 40, SamplingParams(max_tokens=30), "max_tokens"),  # 70 > 64: no silent cut
        ("", SamplingParams(max_tokens=2), "prompt"),
        ([1.7, 2.2], SamplingParams(max_tokens=2), "prompt"),
        ({"prompt_token_ids": ["12", "13"]}, SamplingParams(max_tokens=2), "prompt"),
        ({"prompt_token_ids": [True, 3]}, SamplingParams(max_tokens=2), "prompt"),
        ([1, 2], {"max_tokens": 2}, "sampling_params"),
        ([1, 2], [{"max_tokens": 2}], "sampling_params"),
        ([1, 2], _params_changed_after_construction(n=0), "n"),
        ([1, 2], _params_changed_after_construction(stop=5), "stop"),
        ([1, 2], _params_changed_after_construction(temperature="hot"), "temperature"),
    ],
    ids=[
        "beyond_context",
        "empty_text",
        "float_ids",
        "string_ids",
        "bool_ids",
        "dict_params",
        "list_of_dict_params",
        "n_zero_later",
        "stop_int_later",
        "temperature_later",
    ],
)
def test_bad_offline_input_is_a_value_error_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("stop", 5),
        ("stop", {"a": 1}),
        ("stop", [5]),
        ("stop_token_ids", 3),
        ("stop_token_ids", [1.5]),
        ("skip_special_tokens", "no"),
        ("include_stop_str_in_output", 1),
        ("seed", 2**63),
        ("seed", 1.0),
    ],
)
def test_sampling_params_take_no_conversions(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_prompt_that_just_fits_runs_and_seeds_do_not_overflow(llm):
    """prompt + max_tokens == max_model_len is fine; the largest seed with n=2 is too."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, n=2, seed=2**63 - 1, temperature=1.0)
    out = llm.generate([1] * (MAX_MODEL_LEN - 4), params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
