"""EngineCore: the scheduler and the model runner in one loop, driven by `step()`.

Callers (LLM, the server's engine process, tests) add requests, call `step()` until
`has_unfinished_requests()` is False, and read EngineCoreOutputs. No tokenization here.
"""
from __future__ import annotations

import dataclasses
import logging
import time

from slipstream.config import EngineConfig
from slipstream.engine.request import Request
from slipstream.engine.step_timer import StepTimer
from slipstream.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        from slipstream.runner.model_runner import ModelRunner
        from slipstream.scheduler.scheduler import Scheduler

        self.config = config
        start = time.perf_counter()
        self.runner = ModelRunner(config)
        self.runner.load_model()
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()
        self.timer = StepTimer(config.device)
        self.runner.timer = self.timer
        cache = dataclasses.replace(config.cache, num_blocks=num_blocks)
        self.config = config.replace(cache=cache)
        self.scheduler = Scheduler(config.scheduler, cache)
        self._requests: dict[str, Request] = {}
        logger.info("engine ready in %.1f s: %d KV blocks of %d tokens on %s",
                    time.perf_counter() - start, num_blocks, cache.block_size, config.device)

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (engine unchanged) if it can never run."""
        self._validate(request)
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request

    def _validate(self, request: Request) -> None:
        if not request.prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.config.model.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        max_len = self.config.scheduler.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens but max_model_len is {max_len}: "
                "the prompt must leave room for at least one output token")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._requests.pop(rid, None)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one iteration, run the model, return per-request news."""
        with self.timer.phase("schedule"):
            sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        runner_out = self.runner.execute_model(sched_out)
        with self.timer.phase("update"):
            outputs = self.scheduler.update_from_output(sched_out, runner_out)
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is not None and request.first_scheduled_time is not None:
                out.timestamps.setdefault("first_scheduled_time", request.first_scheduled_time)
            if out.finished:
                self._requests.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()
