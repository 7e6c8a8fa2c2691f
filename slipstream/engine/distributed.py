"""DistributedRunner: the EngineCore's model runner when the model runs on worker ranks.

It has the ModelRunner methods EngineCore calls, and carries each out on every rank of a
worker pool (parallel/workers.py): load, size the KV cache (the smallest rank's count), warm
up, capture, and each step: the SchedulerOutput goes to every rank as one msgpack message, and
the output rank answers with the sampled tokens. The scheduler, KV manager and detokenizer
stay in the engine core's process, unchanged.

With one stage, steps are synchronous (each read before the next is scheduled), except a
multi-step decode (decode_steps > 1): `launch_decode_steps` sends one message for its n steps,
which every rank runs back to back, and `collect_decode_steps` reads the n tokens per request.
With pipeline_decode the engine core sends the next multi-step decode before reading the one
sent, so the ranks never wait for the host between them. With pipeline_parallel_size P > 1
the engine core keeps up to P steps (micro-batches) in flight (parallel/micro_batches.py):
`launch_step` sends one, `collect_step` reads the oldest reply; their steps are single
steps. Async scheduling and speculative decoding stay off (EngineArgs turns them off).
"""
from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable

from slipstream.config import EngineConfig
from slipstream.engine.core_proc import config_to_dict
from slipstream.engine.step_timer import StepTimer
from slipstream.parallel.messages import StepEncoder, decode_runner_output
from slipstream.parallel.state import output_rank
from slipstream.parallel.workers import acquire_pool, release_pool
from slipstream.scheduler.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class DistributedRunner:
    def __init__(self, config: EngineConfig):
        p = config.parallel
        self.config = config
        self.tp_size, self.pp_size = p.tensor_parallel_size, p.pipeline_parallel_size
        self.ranks = list(range(self.tp_size * self.pp_size))
        self.output_rank = output_rank(self.tp_size, self.pp_size)
        self.timer = StepTimer(config.device, enabled=False)
        self.draft_kv_bytes_per_block = 0
        self.max_decode_batch = 0  # the ranks' largest multi-step decode batch (capture)
        self.num_blocks = 0
        self._kv_bytes = self._weight_bytes = 0
        self._encoder = StepEncoder()
        # Steps sent and not read yet, oldest first: a multi-step decode sent ahead
        # (pipeline_decode) and then dropped by the engine core still gets its reply.
        self._unread: deque[int] = deque()
        self.pool = acquire_pool(len(self.ranks), config.device, p.distributed_executor_backend)
        self._finalizer = weakref.finalize(self, release_pool, self.pool)

    def _all(self, msg: dict, reply: str = "done", ranks: list[int] | None = None
             ) -> dict[int, dict]:
        ranks = self.ranks if ranks is None else ranks
        self.pool.send(ranks, msg)
        replies = self.pool.wait(reply, ranks)
        # Each rank answers in order: replies to steps sent before were read past (dropped).
        self._unread.clear()
        return replies

    # ---- set-up --------------------------------------------------------------------------
    def load_model(self) -> None:
        """Every rank of the pool takes part in making the layout's groups; those outside the
        layout stay idle."""
        msg = {"t": "load", "config": config_to_dict(self.config), "tp": self.tp_size,
               "pp": self.pp_size}
        replies = self._all(msg, "loaded", list(range(self.pool.world_size)))
        active = [replies[r] for r in self.ranks]
        self._kv_bytes = sum(r["kv_bytes_per_block"] for r in active)
        self._weight_bytes = sum(r["weight_bytes"] for r in active)

    def weight_bytes(self) -> int:
        """The model's parameter bytes over all ranks."""
        return self._weight_bytes

    def kv_cache_bytes_per_block(self) -> int:
        """K and V of one block over all ranks (each holds its heads of its stage's layers)."""
        return self._kv_bytes

    def determine_num_blocks(self) -> int:
        """The smallest rank's count: a block id means the same slot on every rank."""
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        return min(r["n"] for r in self._all({"t": "num_blocks"}, "num_blocks").values())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._all({"t": "init_kv", "n": num_blocks})
        self.num_blocks = num_blocks

    def initialize_host_cache(self) -> int:
        """No host KV tier on worker ranks (EngineArgs refuses kv_cache_host_memory)."""
        return 0

    def warmup(self) -> None:
        self._all({"t": "warmup"})

    def capture_cuda_graphs(self) -> None:
        replies = self._all({"t": "capture"}).values()
        self.max_decode_batch = min(r["max_decode_batch"] for r in replies)

    # ---- steps ---------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput,
                      while_gpu_runs: Callable[[], None] | None = None,
                      feed=None) -> RunnerOutput:
        """Run the step on every rank; the output rank's sampled tokens (and logprobs)."""
        if feed is not None:
            raise ValueError("distributed engines take input tokens from the host only")
        if sched.is_empty:
            if while_gpu_runs is not None:
                while_gpu_runs()
            return RunnerOutput()
        with self.timer.phase("forward"):
            micro_batch = self.launch_step(sched)
        if while_gpu_runs is not None:
            while_gpu_runs()
        with self.timer.phase("sample"):
            return self.collect_step(micro_batch)

    def launch_step(self, sched: SchedulerOutput, num_steps: int = 1,
                    feed_rows: list[int] | None = None) -> int:
        """Send a non-empty step to every rank without waiting; its number for collect_step."""
        msg = self._encoder.encode(sched, num_steps, feed_rows)
        self.pool.send(self.ranks, msg)
        self._unread.append(msg["mb"])
        return msg["mb"]

    def collect_step(self, micro_batch: int) -> RunnerOutput:
        """The output rank's reply to step `micro_batch`. Replies come in the order the steps
        were sent; those of older steps the engine core dropped unread are skipped."""
        while True:
            reply = self.pool.wait("out", [self.output_rank])[self.output_rank]
            due = self._unread.popleft() if self._unread else None
            if reply["mb"] != due:
                self.pool.fail(f"worker rank {self.output_rank} answered step {reply['mb']} "
                               f"where step {due} was due")
            if due == micro_batch:
                return decode_runner_output(reply)

    def launch_decode_steps(self, sched: SchedulerOutput, num_steps: int, feed=None
                            ) -> _SentSteps:
        """One message for `num_steps` decode steps of a pure-decode batch (the scheduler has
        reserved blocks for every step); every rank runs them back to back and the output
        rank replies once. feed: (tokens, rows) where tokens is the last row of the previous
        multi-step decode's _SentSteps (pipeline_decode): those tokens stay on the ranks."""
        feed_rows = None
        if feed is not None:
            last, feed_rows = feed
            if not isinstance(last, _LastTokens) or last.micro_batch != self._encoder.num_sent - 1:
                raise ValueError("distributed engines feed input tokens only from the "
                                 "multi-step decode sent just before")
        return _SentSteps(self.launch_step(sched, num_steps, feed_rows))

    def collect_decode_steps(self, sched: SchedulerOutput, tokens: _SentSteps) -> RunnerOutput:
        """The n tokens per request of a multi-step decode sent by launch_decode_steps."""
        with self.timer.phase("graph"):
            return self.collect_step(tokens.micro_batch)

    def timelines(self) -> dict[int, list[tuple[int, float, float]]]:
        """Per rank, (step number, start, end) of its latest steps (time.monotonic, one clock
        for every process of a machine): when stages ran which micro-batch."""
        replies = self._all({"t": "timeline"}, "timeline")
        return {rank: [tuple(s) for s in r["steps"]] for rank, r in replies.items()}

    def shutdown(self) -> None:
        """Stop the workers (or hand them back to a kept pool)."""
        self._finalizer()


class _LastTokens:
    """The last step's tokens of multi-step decode `micro_batch`, kept on the ranks."""

    def __init__(self, micro_batch: int):
        self.micro_batch = micro_batch


class _SentSteps:
    """A multi-step decode sent to the ranks and not read yet. `on_device[-1]` names its last
    step's tokens, which the engine core feeds to the decode it sends next (pipeline_decode),
    as it does with a LaunchedTokens in one process."""

    def __init__(self, micro_batch: int):
        self.micro_batch = micro_batch
        self.on_device = {-1: _LastTokens(micro_batch)}
