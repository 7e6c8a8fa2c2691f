"""What the engine core sends its workers each step, and what the output rank sends back:
plain msgpack dicts (never pickle).

Workers keep a mirror of each running request (prompt, sampling params, output tokens) so the
runner and sampler see the same `Request` fields as in one process; a step message carries only
what changed: requests seen for the first time, new output tokens, finished ids.

A multi-step decode goes as one step message with "steps": n > 1: every rank runs the n decode
steps back to back, feeding each step's tokens in on the device, and the output rank replies
once with n tokens per request. "feed": rows of the previous multi-step decode's last tokens,
still on the ranks, that stand for the seqs' placeholder input tokens (pipeline_decode), or
None.

Each step message is numbered ("mb": 0, 1, ...); the output rank's reply carries the number of
the step it answers. With pipeline parallelism several steps (micro-batches) are in flight at
once, and the engine checks that the replies come back in the order it sent the steps.
"""
from __future__ import annotations

from slipstream.engine.core_proc import decode_request, encode_request
from slipstream.engine.request import Request
from slipstream.scheduler.output import RunnerOutput, ScheduledSeq, SchedulerOutput
from slipstream.structured.grammar import RequestGrammar
from slipstream.structured.manager import StructuredOutputManager


class StepEncoder:
    """Driver side: SchedulerOutput -> step message, remembering what the workers know."""

    def __init__(self) -> None:
        self._outputs_sent: dict[str, int] = {}  # request id -> output tokens sent
        self.num_sent = 0  # step messages encoded: the next one's number

    def encode(self, sched: SchedulerOutput, num_steps: int = 1,
               feed_rows: list[int] | None = None) -> dict:
        done = list(sched.finished_request_ids)
        for rid in done:
            self._outputs_sent.pop(rid, None)
        new, seqs = [], []
        for seq in sched.seqs:
            request = seq.request
            sent = self._outputs_sent.get(seq.request_id)
            if sent is None:
                new.append(encode_request(_fresh_copy(request)))
                sent = 0
            seqs.append([seq.request_id, seq.token_ids, seq.start_pos, seq.block_ids,
                         seq.needs_sample, seq.num_lookahead, seq.num_spec_tokens,
                         request.output_token_ids[sent:]])
            self._outputs_sent[seq.request_id] = request.num_output_tokens
        self.num_sent += 1
        return {"t": "step", "mb": self.num_sent - 1, "done": done, "new": new, "seqs": seqs,
                "steps": num_steps, "feed": feed_rows}


def _fresh_copy(request: Request) -> Request:
    """The request as first added (encode_request sends init fields; outputs follow as deltas)."""
    return Request(request.request_id, request.prompt_token_ids, request.sampling_params,
                   request.eos_token_ids, request.priority, request.arrival_time)


class StepDecoder:
    """Worker side: step message -> SchedulerOutput over mirrored requests.

    grammars: on ranks that sample (the last stage), the manager that compiles structured
    output constraints. Each constrained request gets its own grammar, advanced over the output
    tokens the steps bring, so the sampler masks its logits as in one process (the engine
    core's grammar decides stops and ends)."""

    def __init__(self, grammars: StructuredOutputManager | None = None) -> None:
        self.requests: dict[str, Request] = {}
        self._grammars = grammars

    def decode(self, msg: dict) -> SchedulerOutput:
        for rid in msg["done"]:
            self.requests.pop(rid, None)
        for data in msg["new"]:
            request = decode_request(data)
            self._attach_grammar(request)
            self.requests[request.request_id] = request
        seqs = []
        for rid, tokens, start, blocks, sample, lookahead, spec, new_outputs in msg["seqs"]:
            request = self.requests[rid]
            request.output_token_ids.extend(new_outputs)
            if request.grammar is not None and new_outputs:
                request.grammar.accept(new_outputs, None)
            request.num_computed_tokens = start
            seqs.append(ScheduledSeq(request, tokens, start, blocks, sample, lookahead, spec))
        return SchedulerOutput(seqs=seqs, finished_request_ids=list(msg["done"]))

    def _attach_grammar(self, request: Request) -> None:
        """Compile (or take from the cache) a constrained request's grammar; the engine core
        compiled it already, so it is valid, and this waits for it."""
        params = request.sampling_params.structured_outputs
        if params is None or self._grammars is None:
            return
        request.grammar = RequestGrammar(self._grammars.compile(params).result(),
                                         request.eos_token_ids)

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown()


def encode_runner_output(out: RunnerOutput, micro_batch: int) -> dict:
    return {"t": "out", "mb": micro_batch, "sampled": out.sampled_token_ids,
            "logprobs": out.logprobs, "prompt_logprobs": out.prompt_logprobs}


def decode_runner_output(msg: dict) -> RunnerOutput:
    return RunnerOutput(sampled_token_ids=msg["sampled"], logprobs=msg["logprobs"],
                        prompt_logprobs=msg["prompt_logprobs"])
