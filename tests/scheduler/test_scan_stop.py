"""scan_stop: the chunked stop check multi-step decode uses equals appending the tokens one by
one and checking each (the rules in priority order), on random requests and token chunks."""
from __future__ import annotations

import random

from slipstream.engine.request import Request, RequestStatus
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.scheduler import scan_stop


def one_by_one(request: Request, tokens: list[int], max_seq_len: int):
    """The oracle: append a token, then EOS / stop id (after min_tokens), then length."""
    params = request.sampling_params
    for i, token in enumerate(tokens):
        request.output_token_ids.append(token)
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return i + 1, RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return i + 1, RequestStatus.FINISHED_STOPPED, token
        if (params.max_tokens is not None and num_output >= params.max_tokens) or \
                request.num_tokens >= max_seq_len:
            return i + 1, RequestStatus.FINISHED_LENGTH, None
    return len(tokens), None, None


def random_request(rng: random.Random) -> tuple[Request, int]:
    max_tokens = rng.choice([None, rng.randint(1, 30)])
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
        min_tokens=rng.randint(0, max_tokens or 10) if rng.random() < 0.5 else 0,
        stop_token_ids=rng.sample(range(8), rng.randint(0, 2)))
    prompt = [rng.randrange(8) for _ in range(rng.randint(1, 10))]
    request = Request("r", prompt, params, eos_token_ids=tuple(rng.sample(range(8), rng.randint(0, 2))))
    limit = max_tokens if max_tokens is not None else 40
    request.output_token_ids = [rng.randrange(8) for _ in range(rng.randint(0, limit - 1))]
    max_seq_len = request.num_tokens + rng.randint(1, 40)
    return request, max_seq_len


def test_scan_stop_equals_the_token_by_token_check():
    rng = random.Random(0)
    outcomes = set()
    for _ in range(3000):
        request, max_seq_len = random_request(rng)
        tokens = [rng.randrange(8) for _ in range(rng.randint(1, 9))]
        oracle = Request("o", request.prompt_token_ids, request.sampling_params,
                         eos_token_ids=request.eos_token_ids)
        oracle.output_token_ids = list(request.output_token_ids)
        expect_n, expect_status, expect_reason = one_by_one(oracle, tokens, max_seq_len)
        n, status = scan_stop(request, tokens, max_seq_len)
        assert (n, status) == (expect_n, expect_status), (request, tokens, max_seq_len)
        if status == RequestStatus.FINISHED_STOPPED:
            assert request.stop_reason == expect_reason
        outcomes.add(status)
    assert outcomes == {None, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH}
