"""Pipeline parallelism's micro-batches: the engine core keeps up to P steps in flight, so that
each of the P stages has one to run.

Each call of `step` schedules and sends at most one micro-batch, then reads at most one reply
(the oldest): it reads when the pipe is full or when nothing new could be scheduled. A
micro-batch holds only requests whose next input is known on the host: the scheduler skips a
request whose sampled token is still in flight (it holds a PENDING_TOKEN, as with
async_scheduling, and `mark_launched` counts the step's tokens as computed), so the micro-
batches in flight sample disjoint sets of requests, and a request rejoins the next micro-batch
scheduled after its reply is read. A prompt's prefill chunks that sample nothing may follow one
another through the pipe: every stage runs the micro-batches in the order they were sent, so a
chunk's K/V is on each stage before the next chunk reads it.

Each micro-batch is capped at 1/P of the requests that could run (running and waiting, at most
max_num_seqs), so the running requests split into P groups of about the same size that take
turns: while group g's tokens are read and applied on the host, the other groups fill the pipe.
Waiting requests count only while admission goes on: when the last micro-batch had room for
more and still left requests waiting (the KV cache is full), the running ones alone are split.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from slipstream.outputs import EngineCoreOutput
from slipstream.scheduler.output import RunnerOutput, SchedulerOutput


class MicroBatches:
    """The micro-batches in flight on a pipeline of `depth` stages, oldest first."""

    def __init__(self, depth: int, scheduler, runner,
                 apply: Callable[[SchedulerOutput, RunnerOutput, int], list[EngineCoreOutput]]):
        """runner: a DistributedRunner (launch_step / collect_step); apply: the engine core's
        bookkeeping of a step read back (EngineCore._apply)."""
        self.depth = depth
        self.scheduler, self.runner, self._apply = scheduler, runner, apply
        self.in_flight: deque[tuple[SchedulerOutput, int]] = deque()
        self.max_in_flight = 0  # the most micro-batches ever in flight at once
        # The last micro-batch had seats and tokens to spare yet left requests waiting.
        self._admission_stalled = False

    def __len__(self) -> int:
        return len(self.in_flight)

    def share(self) -> int:
        """Most sequences one micro-batch takes: 1/depth of those that could run."""
        sched = self.scheduler
        could_run = sched.num_running + (0 if self._admission_stalled else sched.num_waiting)
        return max(1, -(-min(could_run, sched.config.max_num_seqs) // self.depth))

    def step(self, while_busy: Callable[[], None]) -> list[EngineCoreOutput]:
        """Launch the next micro-batch if the pipe has room, then read the oldest when the pipe
        is full or nothing was launched. while_busy: host work done once, while the ranks run."""
        launched = False
        if len(self.in_flight) < self.depth:
            sched_out = self._schedule()
            if not sched_out.is_empty:
                micro_batch = self.runner.launch_step(sched_out)
                self.scheduler.mark_launched(sched_out)
                self.in_flight.append((sched_out, micro_batch))
                self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
                launched = True
        while_busy()
        if not self.in_flight or (launched and len(self.in_flight) < self.depth):
            return []
        sched_out, micro_batch = self.in_flight.popleft()
        return self._apply(sched_out, self.runner.collect_step(micro_batch), 1)

    def _schedule(self) -> SchedulerOutput:
        sched, share = self.scheduler, self.share()
        sched_out = sched.schedule(max_seqs=share, skip_pending=True)
        self._admission_stalled = sched.num_waiting > 0 and len(sched_out.seqs) < share \
            and sched_out.num_batched_tokens < sched.config.max_num_tokens
        return sched_out
