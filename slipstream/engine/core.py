"""EngineCore: the scheduler and the model runner in one loop, driven by `step()`.

Callers (LLM, the server's engine process, tests) add requests, call `step()` until
`has_unfinished_requests()` is False, and read EngineCoreOutputs. No tokenization here.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from slipstream.config import EngineConfig, SchedulerConfig
from slipstream.engine.auto_limits import fit_resolved_limits, resolve_step_limits
from slipstream.engine.beam import BeamCoordinator
from slipstream.engine.frontend import validate_prompt_tokens
from slipstream.engine.request import PENDING_TOKEN, Request, RequestStatus
from slipstream.engine.startup import KernelCaches, StartupPhases, device_sync
from slipstream.engine.step_timer import StepTimer
from slipstream.engine.step_trace import StepTrace
from slipstream.models.layer_types import freeable_window, layer_sliding_windows, within
from slipstream.models.registry import check_parallel_support
from slipstream.outputs import EngineCoreOutput
from slipstream.pooling.runner import PoolingModelRunner, attach_pooled
from slipstream.runner.model_runner import ModelRunner
from slipstream.sampling.beam_search import BeamSearchParams
from slipstream.sampling.logit_controls import needs_known_tokens
from slipstream.sampling.penalties import has_penalties
from slipstream.scheduler.output import ScheduledSeq, SchedulerOutput
from slipstream.scheduler.scheduler import Scheduler, advance_grammars
from slipstream.speculative.decoder import build_decoder
from slipstream.speculative.grammar_drafts import GrammarDrafter
from slipstream.structured.waiting import GrammarWaitRoom

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        _check_sliding_window_combinations(config)
        asked = config.scheduler  # None where the user left a step limit to the engine
        config = resolve_step_limits(config)
        self.config = config
        self.runner = _make_runner(config)
        num_blocks, num_host_blocks = self._start_up(config, asked)
        config = self.config  # with the limits fitted to the KV cache
        draft = getattr(self.spec, "proposer", None) if self.spec else None
        self.timer = StepTimer(config.device)
        self.runner.timer = self.timer
        self.trace = StepTrace()
        cache = dataclasses.replace(config.cache, num_blocks=num_blocks,
                                    num_host_blocks=num_host_blocks)
        self.config = config.replace(cache=cache)
        self.scheduler = Scheduler(config.scheduler, cache,
                                   config.lora.max_loras if config.lora.enabled else 0,
                                   sliding_window=_releasable_window(config))
        self.grammar_drafts = GrammarDrafter(config.grammar_forced_drafts, self.scheduler.max_seq_len) \
            if config.grammar_forced_drafts else None
        if self.spec is not None:
            self.spec.max_seq_len = self.scheduler.max_seq_len
            if draft is not None:
                draft.kv = self.scheduler.kv
        if self._tier_cost is not None:
            self.scheduler.kv.set_tier_cost(self._tier_cost, self.scheduler.max_seq_len)
            logger.info("host KV tier: copies at %.1f GB/s, matmuls at %.1f TFLOP/s: %s",
                        self._tier_cost.copy_bytes_per_s / 1e9, self._tier_cost.flops_per_s / 1e12,
                        "copies pay from some length on" if self._tier_cost.ever_pays(
                            self.scheduler.max_seq_len) else "recomputing is always cheaper")
        self._requests: dict[str, Request] = {}
        # Requests whose outputs carried their first_scheduled_time already (once is enough).
        self._stamped: set[str] = set()
        # Structured-output requests whose grammar is still compiling (off the step loop).
        self.grammar_wait = GrammarWaitRoom(config.tokenizer_path, config.model.vocab_size)
        self.beams = BeamCoordinator(self.scheduler, self.runner)
        # A decode launched ahead (pipeline_decode): (sched_out, steps, device tokens).
        self._queued: tuple[SchedulerOutput, int, object] | None = None
        # An async step launched and not read yet (async_scheduling): (sched_out, tokens).
        self._inflight: tuple[SchedulerOutput, object] | None = None
        self._grammar_pool: ThreadPoolExecutor | None = None  # advances grammars (_read_inflight)
        # Pipeline parallelism: the micro-batches in flight on the stages (None: one stage).
        self.micro_batches = _micro_batches(self.config, self.scheduler, self.runner, self._apply)
        weight_bytes = self.runner.weight_bytes()
        kv_bytes = num_blocks * self.runner.kv_cache_bytes_per_block()
        logger.info("engine ready in %.1f s on %s: weights %.2f GiB, KV cache %.2f GiB "
                    "(%d blocks of %d tokens)", time.perf_counter() - start, config.device,
                    weight_bytes / 2**30, kv_bytes / 2**30, num_blocks, cache.block_size)
        self.startup.log()

    def _start_up(self, config: EngineConfig, asked: SchedulerConfig) -> tuple[int, int]:
        """Load, size the KV cache, warm up and capture, each phase timed (`startup_phases`),
        with kernel choices and compiled kernels reused from a build or the cache directory.
        Step limits the user left unset (None in `asked`) are fitted to the KV cache before
        the warm-up and the graphs use them."""
        self.startup = StartupPhases(sync=device_sync(config.device))
        kernels = KernelCaches(config)
        with self.startup.phase("read_weights"):
            self.runner.load_model()
            self.spec = build_decoder(config, config.scheduler.max_model_len)
        draft = getattr(self.spec, "proposer", None) if self.spec else None
        if hasattr(draft, "kv_bytes_per_block"):  # a draft model: its cache shares the budget
            self.runner.draft_kv_bytes_per_block = draft.kv_bytes_per_block()
        if getattr(draft, "needs_hidden", False):  # drafts from the target's hidden states
            draft.attach_target(self.runner.model)
            self.runner.keep_hidden = True
        with self.startup.phase("profile_memory"):
            num_blocks = self.runner.determine_num_blocks()
            self.config = fit_resolved_limits(config, asked, num_blocks)
            self.runner.config = self.config
            self.runner.initialize_kv_cache(num_blocks)
            if hasattr(draft, "initialize_kv_cache"):
                draft.initialize_kv_cache(num_blocks)
            num_host_blocks = self.runner.initialize_host_cache()
            self._tier_cost = None
            if num_host_blocks and config.cache.kv_offload_mode == "auto":
                self._tier_cost = self.runner.host_tier_cost()
        with self.startup.phase("warm_up"):
            self.runner.warmup()
        with self.startup.phase("capture_graphs"):
            self.runner.capture_cuda_graphs()
        kernels.save()
        self.startup.end()
        return num_blocks, num_host_blocks

    @property
    def startup_phases(self) -> dict[str, float]:
        """Seconds of each start-up phase, and their total (the log's and the bench's)."""
        return self.startup.as_dict()

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (engine unchanged) if it can never run."""
        self._validate(request)
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.engine_arrival_time = time.monotonic()
        if request.sampling_params.structured_outputs is not None:
            self.scheduler.check_fits(request)
            self.grammar_wait.add(request)  # joins the scheduler once its grammar is ready
        else:
            self.scheduler.add_request(request)
        self._requests[request.request_id] = request

    def add_beam_search(self, search_id: str, prompt_ids: list[int], params: BeamSearchParams,
                        eos_token_ids: tuple[int, ...] = (), priority: int = 0) -> None:
        """Start a beam search (engine/beam.py); its result comes from
        `beams.take_finished()` once the search ends. ValueError (engine unchanged) if it
        can never run."""
        if self.config.parallel.uses_workers:  # forks copy blocks in this process's cache
            raise ValueError("beam search runs in one process only: use tensor/pipeline_"
                             "parallel_size 1 without distributed_executor_backend")
        group, first = self.beams.first_beam(search_id, prompt_ids, params, eos_token_ids,
                                             priority)
        self.add_request(first)
        self._requests.pop(first.request_id)  # the coordinator owns its beams
        self.beams.start(group, first)

    def _validate(self, request: Request) -> None:
        validate_prompt_tokens(request.prompt_token_ids, self.config.model.vocab_size,
                               self.config.scheduler.max_model_len)
        if request.lora_int_id:  # reads and checks the adapter (a bad one is a ValueError)
            self.runner.add_lora(request.lora_int_id, request.lora_path)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.grammar_wait.discard(request_ids)
        for rid in request_ids:
            if self.beams.is_search(rid):
                self.beams.abort(rid)
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._forget(rid)
        if self.spec is not None:  # the proposer's per-request state
            self.spec.forget(request_ids)
        self._forget_queued_if_done()

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._stamped.discard(request_id)

    def _forget_queued_if_done(self) -> None:
        """Drop a queued decode none of whose requests is still running: nothing of it would
        be used (its GPU work completes unread, before anything queued after it)."""
        if self._queued is not None and not any(
                s.request.status == RequestStatus.RUNNING for s in self._queued[0].seqs):
            self._queued = None

    def step(self, while_gpu_runs: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """Admit requests whose grammar compiled (waiting a little for one only when nothing
        else could run), run one iteration (`_step`); with speculative decoding, then propose
        the next step's draft tokens."""
        idle = (not self.scheduler.has_unfinished_requests() and self._queued is None
                and self._inflight is None and not self.micro_batches)
        failed = []
        for request, error in self.grammar_wait.ready(wait=idle):
            if error is None:
                self.scheduler.add_request(request)
            else:
                self._forget(request.request_id)
                failed.append(_error_output(request, error))
        outputs = self._step(while_gpu_runs)
        if self.spec is not None:
            self.spec.forget([o.request_id for o in outputs if o.finished])
            if self._inflight is None and self._queued is None:
                # Beam search takes back one token per beam per step: beams never speculate.
                self.spec.propose([r for r in self.scheduler.running
                                   if not self.beams.owns(r.request_id)])
            self.spec.step_ended(time.perf_counter())  # measures the cost of verifying
        if self.grammar_drafts is not None and self._inflight is None and self._queued is None:
            self.grammar_drafts.propose([r for r in self.scheduler.running
                                         if not self.beams.owns(r.request_id)])
        return failed + outputs

    def _step(self, while_gpu_runs: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """Schedule one iteration, run the model, return per-request news.

        while_gpu_runs: host work (e.g. processing the previous step's outputs) to do once
        this step's GPU work is queued and before waiting for it; called exactly once, and
        it must not touch the engine.

        A multi-step decode of a batch the next schedule would repeat unchanged also queues
        that next one (pipeline_decode) before waiting: the following call then starts from
        it instead of scheduling, and the GPU never idles while the host updates.
        With async_scheduling a step whose requests need no host-side token work is launched
        and left unread (`_inflight`): the next call schedules and launches the following
        step, fed its input tokens on the device, before reading it.
        """
        once = _Once(while_gpu_runs)
        if self.micro_batches is not None:
            return self.micro_batches.step(once)
        inflight, self._inflight = self._inflight, None
        feed = None
        if self._queued is not None:  # never together with an async step in flight
            (sched_out, num_steps, tokens), self._queued = self._queued, None
        else:
            with self.timer.phase("schedule"):
                sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                if self.beams.active:
                    self.beams.release_idle()
                once()
                return self._read_inflight(inflight)
            feed = _feed_from(inflight, sched_out)
            # A multi-step decode is read only when all its steps are done, and the unread
            # step's tokens come back with it: after a prefill, one step first, so a request's
            # first token arrives when its prefill ends (W1: TTFT was prefill + 8 steps).
            multi_step = (self.config.scheduler.decode_steps > 1
                          and not _holds_first_tokens(inflight))
            num_steps = self._plan_decode_steps(sched_out) if multi_step else 1
            self.flush_kv_transfers()
            tokens = None
            if num_steps > 1:
                tokens = self.runner.launch_decode_steps(sched_out, num_steps, feed)
            elif self._async_ok(sched_out):
                return self._launch_async(sched_out, feed, inflight, once)
        if tokens is not None:
            self._queued = self._queue_next_decode(sched_out, tokens)
            once()
            outputs = self._read_inflight(inflight)
            runner_out = self.runner.collect_decode_steps(sched_out, tokens)
        else:
            runner_out = self.runner.execute_model(sched_out, once, feed)
            outputs = self._read_inflight(inflight)
        once()  # a path that had no GPU wait to overlap it with
        return outputs + self._apply(sched_out, runner_out, num_steps)

    def _apply(self, sched_out: SchedulerOutput, runner_out, num_steps: int,
               grammars_advanced: bool = False) -> list[EngineCoreOutput]:
        """update_from_output and the engine's own bookkeeping of a step read back."""
        spec_counts = {}
        if self.spec is not None:
            spec_counts = self.spec.record(sched_out, runner_out)
            self.spec.step_applied(sched_out, num_steps)
        if self.grammar_drafts is not None:
            spec_counts.update(self.grammar_drafts.record(sched_out, runner_out))
        with self.timer.phase("update"):
            outputs = self.scheduler.update_from_output(sched_out, runner_out, grammars_advanced)
        for out in outputs:
            out.num_draft_tokens, out.num_accepted_tokens = spec_counts.get(out.request_id, (0, 0))
        if self.config.runner == "pooling":
            attach_pooled(outputs, runner_out)
        if self.beams.active:
            with self.timer.phase("beam"):
                outputs = self.beams.on_outputs(outputs)
        if self.trace.enabled:
            self.trace.record(sched_out, runner_out, num_steps, self.scheduler.get_stats())
        stamped = self._stamped
        for out in outputs:
            rid = out.request_id
            if rid not in stamped:  # the front end keeps the first it gets (RequestMetrics)
                request = self._requests.get(rid)
                if request is not None and request.first_scheduled_time is not None:
                    out.timestamps.setdefault("first_scheduled_time", request.first_scheduled_time)
                    stamped.add(rid)
            if out.finish_reason is not None:
                self._forget(rid)
        self._forget_queued_if_done()
        return outputs

    def _launch_async(self, sched_out: SchedulerOutput, feed, inflight, once: _Once
                      ) -> list[EngineCoreOutput]:
        """Launch `sched_out` and leave its tokens unread (`_inflight`); read and apply the
        step in flight before it.

        A step with constrained rows samples only once the step before it is applied: their
        grammars must stand after their latest token. Its forward is launched first, so the
        host reads that token, advances the grammars (in a thread, beside the rest of the
        update) and fills the bitmask while the forward runs, and the mask is applied on the
        device right before the sample."""
        if not any(s.needs_sample and s.request.grammar is not None for s in sched_out.seqs):
            self._inflight = (sched_out, self.runner.launch_sampled(sched_out, feed))
            self.scheduler.mark_launched(sched_out)
            once()
            return self._read_inflight(inflight)
        launched = self.runner.launch_logits(sched_out, feed)
        self.scheduler.mark_launched(sched_out)
        outputs = self._read_inflight(inflight, grammars_aside=True)
        self._inflight = (sched_out, self.runner.sample_launched(launched))
        once()
        return outputs

    def _read_inflight(self, inflight, grammars_aside: bool = False) -> list[EngineCoreOutput]:
        """Wait for an async step's tokens (if any) and apply them. grammars_aside: advance
        the constrained requests' grammars in a thread meanwhile (xgrammar releases the GIL),
        off the host's critical path."""
        if inflight is None:
            return []
        sched_out, tokens = inflight
        runner_out = self.runner.collect_sampled(sched_out, tokens)
        pairs = self.scheduler.grammar_tokens(sched_out, runner_out) if grammars_aside else []
        if not pairs:
            return self._apply(sched_out, runner_out, 1)
        job = self._grammar_thread().submit(advance_grammars, pairs)
        outputs = self._apply(sched_out, runner_out, 1, grammars_advanced=True)
        ended = self.scheduler.end_rejected(pairs, job.result())
        for out in ended:
            self._forget(out.request_id)
        return outputs + ended

    def _grammar_thread(self) -> ThreadPoolExecutor:
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-accept")
        return self._grammar_pool

    def _async_ok(self, sched_out: SchedulerOutput) -> bool:
        """Whether this step may be left unread (async_scheduling): nothing in it needs its
        tokens on the host before the next step (logprobs, penalties, prompt logprobs). A
        grammar needs them only before the next sample (see _launch_async)."""
        if not self.config.scheduler.async_scheduling or self._speculating(sched_out):
            return False
        for seq in sched_out.seqs:
            p = seq.request.sampling_params
            if p.prompt_logprobs is not None or (seq.needs_sample and (
                    p.logprobs is not None or has_penalties(p) or needs_known_tokens(p))):
                return False
        return True

    def _queue_next_decode(self, running: SchedulerOutput, tokens):
        """Launch the multi-step decode that follows `running` (launched, tokens unread), when
        the scheduler would pick exactly its requests next; (sched_out, steps, tokens) or None.

        Requests that end by length with `running` drop out; one that stops on EOS there is
        decoded on needlessly, and update_from_output skips it. Its input tokens are the last
        ones of `running`, fed on the device."""
        cfg = self.config.scheduler
        if not cfg.pipeline_decode:
            return None
        plan = self._plan_next_decode(running.seqs)
        if plan is None:
            return None
        rows, starts, steps = plan
        kv = self.scheduler.kv
        seqs = []
        for row, start in zip(rows, starts):
            request = running.seqs[row].request
            # Blocks already taken when one does not fit stay with their requests.
            if not kv.allocate_slots(request, start + steps - request.num_computed_tokens):
                return None
            seqs.append(ScheduledSeq(request, [PENDING_TOKEN], start,
                                     kv.get_block_ids(request.request_id), True,
                                     num_lookahead=steps - 1))
        sched_out = SchedulerOutput(seqs=seqs)
        self.flush_kv_transfers()
        return sched_out, steps, self.runner.launch_decode_steps(sched_out, steps,
                                                                 (tokens.on_device[-1], rows))

    def _plan_next_decode(self, seqs: list[ScheduledSeq]):
        """(rows of `seqs` that go on, their next start positions, steps), or None."""
        sched, cfg = self.scheduler, self.config.scheduler
        live = [s for s in seqs if s.request.status == RequestStatus.RUNNING
                and sched.get_request(s.request_id) is s.request]
        if len(live) != sched.num_running or (self.spec is not None
                                               and self.spec.wants(sched.num_running)):
            return None  # other running requests (a prefill) or speculation need the scheduler
        rows, starts, steps = [], [], cfg.decode_steps
        for row, seq in enumerate(seqs):
            request, params = seq.request, seq.request.sampling_params
            if request.status != RequestStatus.RUNNING:
                continue
            num_tokens = seq.start_pos + seq.num_tokens + seq.num_lookahead + 1  # after `seqs`
            num_output = num_tokens - request.num_prompt_tokens
            room = sched.max_seq_len - num_tokens
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - num_output)
            if room <= 0:
                continue  # ends by length with `seqs`
            if not _multi_step_ok(request, num_output):
                return None
            rows.append(row)
            starts.append(num_tokens - 1)
            steps = min(steps, room)
        if steps <= 1 or not rows or len(rows) > min(self.runner.max_decode_batch,
                                                     cfg.max_num_tokens):
            return None
        if sched.num_waiting and len(rows) < cfg.max_num_seqs:
            return None  # a free seat: the scheduler would admit a waiting request
        return rows, starts, steps

    def _plan_decode_steps(self, sched_out) -> int:
        """How many decode steps this batch may run without the host (1: the normal path).

        Only pure-decode batches of greedy requests whose output needs no per-token host work
        (no logprobs, penalties, stop strings, pending min_tokens) qualify; the blocks for the
        extra steps are reserved here, and the scheduler cuts tokens after any stop.
        """
        steps = self.config.scheduler.decode_steps
        seqs = sched_out.seqs
        if steps <= 1 or not seqs or len(seqs) > self.runner.max_decode_batch \
                or self._speculating(sched_out):
            return 1
        max_len = self.config.scheduler.max_model_len
        for seq in seqs:
            request, params = seq.request, seq.request.sampling_params
            if seq.num_tokens != 1 or not seq.needs_sample or not _multi_step_ok(request):
                return 1
            left = max_len - request.num_tokens
            if params.max_tokens is not None:
                left = min(left, params.max_tokens - request.num_output_tokens)
            steps = min(steps, left)
        if steps <= 1:
            return 1
        kv = self.scheduler.kv
        for seq in seqs:
            # seq.block_ids is the live table, so it already shows the blocks added here.
            if not kv.allocate_slots(seq.request, steps):
                for s in seqs:  # blocks already taken stay with their requests
                    s.num_lookahead = 0
                return 1
            seq.num_lookahead = steps - 1
        return steps

    def _speculating(self, sched_out: SchedulerOutput) -> bool:
        """Whether this step verifies drafts, or the next would propose some: its tokens must
        then be read before the next step is scheduled."""
        if self.spec is None and self.grammar_drafts is None:
            return False
        return (any(s.num_spec_tokens for s in sched_out.seqs)
                or (self.spec is not None and self.spec.wants(self.scheduler.num_running))
                or (self.grammar_drafts is not None
                    and self.grammar_drafts.wants(self.scheduler.running)))

    def flush_kv_transfers(self) -> None:
        """Queue the host tier's pending block copies (offloads of evicted blocks, restores
        of host prefix hits) ahead of the forward that follows."""
        if self.scheduler.kv.host is not None:
            self.runner.apply_kv_transfers(self.scheduler.kv.take_transfers())

    def has_unfinished_requests(self) -> bool:
        return (self._queued is not None or self._inflight is not None
                or bool(self.micro_batches)
                or self.scheduler.has_unfinished_requests() or bool(self.grammar_wait))

    def shutdown(self) -> None:
        """Release what outlives the object: a distributed engine's worker processes."""
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False)
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def get_stats(self) -> dict:
        stats = self.scheduler.get_stats()
        if self.spec is not None:
            stats.update(self.spec.get_stats())
        if self.grammar_drafts is not None:
            stats.update(self.grammar_drafts.get_stats())
        return stats


# Proposers that keep K/V on the target's block ids and attend over all of it from their own
# (lagging) positions: the blocks behind the target's window must stay while one runs.
_KV_SHARING_PROPOSERS = ("draft_model", "eagle", "eagle3")


def _releasable_window(config: EngineConfig) -> int | None:
    """The window the KV manager frees blocks behind (models/layer_types.py freeable_window),
    or None: no window on every layer, or a proposer that still reads those blocks."""
    spec = config.speculative
    if spec is not None and spec.method in _KV_SHARING_PROPOSERS:
        return None
    return freeable_window(config.model, config.scheduler.max_model_len)


def _check_sliding_window_combinations(config: EngineConfig) -> None:
    """ValueError for what a model with sliding-window layers cannot run correctly."""
    windows = [within(w, config.scheduler.max_model_len)
               for w in layer_sliding_windows(config.model)]
    if not any(windows):
        return
    spec = config.speculative
    if spec is not None and spec.drafts_trees:
        # A tree node attends from its depth's position but sits at its breadth-first slot;
        # the kernels place the window by slot, which would hide keys the node must see.
        raise ValueError(
            f"{config.model.architecture} has sliding-window attention layers: draft trees "
            "(medusa, lookahead, speculative_token_tree) are not supported with them; use a chain "
            "method (ngram, draft_model, eagle) or no speculation")


def _make_runner(config: EngineConfig):
    """The model runner in this process (a pooling runner for a pooling model), or, for a
    model on worker ranks (tensor / pipeline parallel, or a backend named), the runner that
    drives them (engine/distributed.py)."""
    if config.parallel.uses_workers:
        if config.runner == "pooling":
            raise ValueError("pooling models run in one process: tensor and pipeline "
                             "parallelism are not supported for them")
        p = config.parallel
        check_parallel_support(config.model.architecture, p.tensor_parallel_size,
                               p.pipeline_parallel_size)
        from slipstream.engine.distributed import DistributedRunner

        return DistributedRunner(config)
    if config.runner == "pooling":
        return PoolingModelRunner(config)
    return ModelRunner(config)


def _micro_batches(config: EngineConfig, scheduler: Scheduler, runner, apply):
    """With pipeline_parallel_size P > 1, up to P steps in flight so that the stages overlap
    (parallel/micro_batches.py); None otherwise."""
    depth = config.parallel.pipeline_parallel_size
    if depth <= 1:
        return None
    from slipstream.parallel.micro_batches import MicroBatches

    return MicroBatches(depth, scheduler, runner, apply)


class _Once:
    """Calls fn (if any) the first time it is called, then never again."""

    def __init__(self, fn: Callable[[], None] | None):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _feed_from(inflight, sched_out: SchedulerOutput):
    """Device input tokens for `sched_out` from the unread async step `inflight`: per seq the
    row of its pending last token there, else -1; None when no seq has one."""
    if inflight is None:
        return None
    prev, tokens = inflight
    # Keyed by the request object (hashed by identity): cheaper than its id, every step.
    row_of = {s.request: i for i, s in enumerate(t for t in prev.seqs if t.needs_sample)}
    rows = [row_of.get(s.request, -1) if s.token_ids[-1] == PENDING_TOKEN else -1
            for s in sched_out.seqs]
    return (tokens.on_device, rows) if any(r >= 0 for r in rows) else None


def _holds_first_tokens(inflight) -> bool:
    """Whether the unread async step samples some request's first output token (every output
    token it has so far is a placeholder: see Scheduler.mark_launched)."""
    if inflight is None:
        return False
    return any(s.needs_sample and s.request.num_output_tokens <= s.request.num_pending
               for s in inflight[0].seqs)


def _multi_step_ok(request: Request, num_output_tokens: int | None = None) -> bool:
    """Whether the request's next tokens need no host work between them: sampling (greedy or
    not: the sampler runs on the device each step) with no logprobs, stop strings, penalties,
    pending min_tokens, logit controls or output constraint."""
    p = request.sampling_params
    if num_output_tokens is None:
        num_output_tokens = request.num_output_tokens
    return (p.logprobs is None and not p.stop and not has_penalties(p)
            and num_output_tokens >= p.min_tokens and not p.has_logit_controls
            and p.structured_outputs is None)


def _error_output(request: Request, error: BaseException) -> EngineCoreOutput:
    """The output that ends a request whose grammar failed to compile."""
    logger.warning("request %s: %s", request.request_id, error)
    return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                            finish_reason="error", stop_reason=str(error))
