"""The msgpack codecs between the front end and the engine process round-trip exactly."""
from __future__ import annotations

from slipstream.config import EngineConfig
from slipstream.engine.args import EngineArgs
from slipstream.engine.core_proc import (
    config_from_dict,
    config_to_dict,
    decode_output,
    decode_request,
    encode_output,
    encode_request,
    pack,
    unpack,
)
from slipstream.engine.request import Request
from slipstream.outputs import EngineCoreOutput
from slipstream.sampling_params import SamplingParams


def test_config_roundtrip(tiny_chat_model_dir):
    config = EngineArgs(model=str(tiny_chat_model_dir), max_model_len=96, device="cpu",
                        kv_cache_memory=1 << 20).create_engine_config()
    again = config_from_dict(EngineConfig, unpack(pack(config_to_dict(config))))
    assert again == config
    assert isinstance(again.model.eos_token_ids, tuple)
    assert again.model.hf_config == config.model.hf_config


def test_request_roundtrip():
    params = SamplingParams(n=1, temperature=0.7, top_k=5, stop=["x"], seed=3, logprobs=2,
                            max_tokens=9, stop_token_ids=[4])
    req = Request("r-0", [1, 2, 3], params, eos_token_ids=(2, 7), priority=-4,
                  arrival_time=123.5)
    again = decode_request(unpack(pack(encode_request(req))))
    assert again.request_id == "r-0" and again.prompt_token_ids == [1, 2, 3]
    assert again.sampling_params == params
    assert again.eos_token_ids == (2, 7) and again.priority == -4
    assert again.arrival_time == 123.5 and again.output_token_ids == []


def test_output_roundtrip_keeps_int_logprob_keys():
    out = EngineCoreOutput("r-0", [5, 6], new_logprobs=[{5: -0.1, 9: -2.5}, {6: -0.3}],
                           finish_reason="length", stop_reason=None, num_cached_tokens=16,
                           timestamps={"first_scheduled_time": 1.25})
    again = decode_output(unpack(pack(encode_output(out))))
    assert again == out
    assert list(again.new_logprobs[0]) == [5, 9]
