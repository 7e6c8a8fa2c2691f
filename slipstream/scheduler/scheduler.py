"""Iteration-level (in-flight) scheduler: each step, a token budget shared by running decodes,
chunks of prefill and newly admitted requests; preemption by recompute when KV blocks run out.

Holds integers and token ids only; the model runner turns a SchedulerOutput into tensors.
"""
from __future__ import annotations

import copy
import heapq
import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from slipstream.config import CacheConfig, SchedulerConfig
from slipstream.engine.request import PENDING_TOKEN, Request, RequestStatus
from slipstream.kv_cache.manager import KVCacheManager
from slipstream.lora.slots import LoRASlots
from slipstream.outputs import EngineCoreOutput
from slipstream.scheduler.output import RunnerOutput, ScheduledSeq, SchedulerOutput
from slipstream.speculative.tree import prune
from slipstream.structured.grammar import accept_batch

logger = logging.getLogger(__name__)

# A request refused a LoRA slot this many schedules in a row stops later LoRA requests from
# joining pinned adapters, so pinned slots drain and it gets one (no starvation).
LORA_MAX_WAIT_STEPS = 64

# preemption_mode="auto": shorter requests are recomputed (a prefill of a few hundred tokens
# costs about what copying their K/V out and back does).
SWAP_MIN_TOKENS = 256
PREEMPTION_MODES = ("auto", "swap", "recompute")


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_lora_slots: int = 0, sliding_window: int | None = None):
        """sliding_window: every layer's widest window, when all have one (blocks behind it
        are released as requests advance: kv_cache/manager.py)."""
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building the scheduler")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            num_host_blocks=cache_config.num_host_blocks, sliding_window=sliding_window,
        )
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []  # in order of admission
        # Heap of (priority, arrival_time, tie, request); aborted entries are skipped lazily.
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._num_waiting = 0
        self._tie = itertools.count()
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        # Prompt-logprob positions already emitted / received since the last (re)start.
        self._plp_emitted: dict[str, int] = {}
        self._plp_received: dict[str, int] = {}
        self.num_preemptions = 0
        # A sequence can never outgrow the whole cache: at capacity + 1 tokens the next step
        # would need more blocks than exist, so it ends there (length) instead of hanging.
        # With a sliding window on every layer a request holds a bounded number of blocks.
        capacity = cache_config.num_blocks * cache_config.block_size
        if self.kv.peak_blocks(scheduler_config.max_model_len, self._max_chunk()) \
                <= cache_config.num_blocks:
            capacity = scheduler_config.max_model_len
        self._max_seq_len = min(scheduler_config.max_model_len, capacity + 1)
        # LoRA (slipstream/lora/slots.py): device slots pinned by running requests.
        self.lora_slots = LoRASlots(num_lora_slots) if num_lora_slots else None
        self._step_caps = (scheduler_config.max_num_seqs, False)  # schedule()'s arguments
        self._lora_waits: dict[str, int] = {}  # request id -> schedules refused a slot

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError (nothing changed) if it could never be scheduled."""
        self.check_fits(request)
        params = request.sampling_params
        if params.max_tokens is None:
            # A private copy: one SamplingParams object is often shared by many prompts.
            params = copy.copy(params)
            params.max_tokens = self.config.max_model_len - request.num_prompt_tokens
            request.sampling_params = params
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def check_fits(self, request: Request) -> None:
        """ValueError if the request could never be scheduled (add_request's check)."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt is empty, give at least one token")
        max_len = self.config.max_model_len
        if num_prompt >= max_len:
            raise ValueError(
                f"request {rid!r}: prompt has {num_prompt} tokens but max_model_len is "
                f"{max_len}; the prompt must leave room for at least one output token")
        need = self.kv.peak_blocks(num_prompt + 1, self._max_chunk())
        total = self.kv.num_total_blocks
        if need > total:
            raise ValueError(
                f"request {rid!r}: prompt of {num_prompt} tokens needs {need} KV blocks of "
                f"{self.block_size} tokens but the whole cache has {total} "
                f"({total * self.block_size} tokens)")
        if not self.config.enable_chunked_prefill and num_prompt > self.config.max_num_tokens:
            raise ValueError(
                f"request {rid!r}: prompt has {num_prompt} tokens but max_num_tokens is "
                f"{self.config.max_num_tokens} and chunked prefill is off")

    def adopt_running(self, request: Request) -> None:
        """Take in a request whose KV blocks the KV manager already holds (a beam forked
        from a running one: KVCacheManager.fork) as running, after those admitted so far."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def preempt_idle(self, request: Request) -> None:
        """Recompute-preempt a running request that has nothing to compute (a beam waiting for
        its siblings), so a waiting request can have its blocks."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def _max_chunk(self) -> int:
        """The most tokens of one request a step computes (the whole prompt without chunked
        prefill)."""
        if self.config.enable_chunked_prefill:
            return self.config.max_num_tokens
        return self.config.max_model_len

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish the given requests now and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self._num_waiting -= 1  # its heap entry is skipped once finished
            self._finish(request, status)
            aborted.append(request)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._release_lora(request)
        rid = request.request_id
        del self.requests[rid]
        self._plp_emitted.pop(rid, None)
        self._plp_received.pop(rid, None)
        self._finished_ids.append(rid)

    # ---- queries -------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def max_seq_len(self) -> int:
        """Longest a sequence may grow: max_model_len, or less when the cache holds fewer."""
        return self._max_seq_len

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        return self.requests.get(request_id)

    def get_stats(self) -> dict:
        kv = self.kv
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_total_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "host_cache_hits": kv.host_hits,
            "host_blocks_offloaded": kv.blocks_offloaded,
        }

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None, skip_pending: bool = False
                 ) -> SchedulerOutput:
        """Pick this step's work: running requests first, then waiting ones while all fits.

        Pipeline micro-batches (parallel/micro_batches.py): max_seqs caps this step's
        sequences, and skip_pending leaves out every request with a token still in flight
        (its next input is not known on the host)."""
        out = SchedulerOutput()
        self._step_caps = (max_seqs or self.config.max_num_seqs, skip_pending)
        budget = self._schedule_running(out, self.config.max_num_tokens)
        if not out.preempted_request_ids:  # memory is tight: admit nothing new this step
            self._schedule_waiting(out, budget)
        if out.seqs:
            # Held back while idle: callers skip the runner for an empty output.
            out.finished_request_ids, self._finished_ids = self._finished_ids, []
        now = time.monotonic()
        for seq in out.seqs:
            request = seq.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.first_token_time is None and seq.start_pos < request.num_prompt_tokens:
                request.prefill_chunk_times.append(now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its next tokens, preempting when blocks run out.

        Runs for every running request every step: attribute reads are hoisted and a decode
        row's common case (no drafts, blocks already there) stays in this loop."""
        seqs = out.seqs
        max_seqs, skip_pending = self._step_caps
        allocate = self.kv.allocate_slots
        running_status = RequestStatus.RUNNING
        for request in list(self.running):  # a copy: preemption removes from self.running
            if budget <= 0 or len(seqs) >= max_seqs:
                break
            if request.status != running_status:
                continue  # preempted earlier in this step
            num_pending = request.num_pending
            if num_pending and skip_pending:
                continue  # in flight in an unread micro-batch
            num_new = (len(request.prompt_token_ids) + len(request.output_token_ids)
                       - request.num_computed_tokens)
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue  # nothing to compute (no token came back for it last step)
            if num_pending:
                max_tokens = request.sampling_params.max_tokens
                if (len(request.prompt_token_ids) + len(request.output_token_ids)
                        >= self._max_seq_len or (max_tokens is not None and len(
                            request.output_token_ids) >= max_tokens)):
                    continue  # its pending token is its last: update_from_output finishes it
            drafts = self._drafts_to_verify(request, num_new, budget) \
                if request.spec_token_ids else []
            while not allocate(request, num_new + len(drafts)):
                if drafts:  # speculation gives way before anyone is preempted
                    drafts = []
                    continue
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != running_status:
                continue
            seq = self._make_seq(request, num_new, drafts)
            seqs.append(seq)
            budget -= len(seq.token_ids)
        return budget

    def _drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Speculative decoding: the request's draft tokens this step verifies beside its last
        token, cut so that accepted drafts plus the bonus token fit the budget and its
        max_tokens / max_seq_len (a decode step only: one known token left to compute)."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_pending \
                or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = self._max_seq_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        n = max(0, min(room - 1, budget - num_new))
        if request.spec_parents is not None:  # a tree: its breadth-first nodes of depth <= room - 1
            n = min(n, prune(request.spec_parents, room - 1))
        return drafts[:n]

    def mark_launched(self, scheduler_output: SchedulerOutput) -> None:
        """async_scheduling: the step is on the device and its tokens will be read later. Its
        tokens count as computed now and each sampled seq holds a PENDING_TOKEN, so the next
        schedule() already builds on them (update_from_output puts the real ids in)."""
        for seq in scheduler_output.seqs:
            request = seq.request
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if seq.needs_sample:
                request.output_token_ids.append(PENDING_TOKEN)
                request.num_pending += 1

    def _pick_victim(self) -> Request:
        """Lowest priority (largest value), then latest arrival, then latest admission."""
        idx = max(range(len(self.running)),
                  key=lambda j: (self.running[j].priority, self.running[j].arrival_time, j))
        return self.running[idx]

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Recompute-preempt `request`; returns the tokens it gave back to this step's budget."""
        self.running.remove(request)
        if self._swaps(request):
            self.kv.offload_request(request)
        self.kv.free(request)  # before resetting num_computed_tokens (see KVCacheManager.free)
        self._release_lora(request)
        # A pending token stays: update_from_output puts it in before the next schedule.
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._plp_received.pop(request.request_id, None)
        out.preempted_request_ids.append(request.request_id)
        self._push_waiting(request)
        seq = next((s for s in out.seqs if s.request is request), None)  # rare: a scan
        if seq is None:
            return 0
        out.seqs.remove(seq)
        return seq.num_tokens

    def _swaps(self, request: Request) -> bool:
        """Swap (copy to the host tier) rather than only recompute a preempted request?"""
        mode = self.config.preemption_mode
        if self.kv.host is None or mode == "recompute":
            return False
        if mode == "swap":
            return True
        if self.kv.tier_cost is not None:  # measured: copies out and back vs recomputing
            return self.kv.tier_cost.swap_pays(request.num_computed_tokens)
        return request.num_computed_tokens >= SWAP_MIN_TOKENS

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit in (priority, arrival) order; the first that does not fit stops admission.
        A request whose adapter gets no LoRA slot waits and lets the next ones by."""
        skipped: list = []
        try:
            self._admit_waiting(out, budget, skipped)
        finally:
            for entry in skipped:
                heapq.heappush(self._waiting, entry)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, skipped: list) -> None:
        hold_lora = False  # a starving LoRA request is ahead: later ones wait too
        max_seqs, skip_pending = self._step_caps
        while budget > 0 and len(self.running) < self.config.max_num_seqs \
                and len(out.seqs) < max_seqs:
            request = self._peek_waiting()
            if request is None or (skip_pending and request.num_pending):
                return  # (preempted with a token in flight: it waits for that token)
            if request.lora_int_id and (hold_lora or not self._take_lora_slot(request)):
                waits = self._lora_waits[request.request_id] = \
                    self._lora_waits.get(request.request_id, 0) + 1
                hold_lora = hold_lora or waits >= LORA_MAX_WAIT_STEPS
                skipped.append(heapq.heappop(self._waiting))
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                # Without chunked prefill a prompt goes in whole; only a resumed request too
                # long for any single step is still split (else it could never run again).
                if not self.config.enable_chunked_prefill and num_new <= self.config.max_num_tokens:
                    return
                num_new = budget
            if not self.kv.allocate_slots(request, num_new, hit_blocks):
                self._release_lora(request)
                return
            self._lora_waits.pop(request.request_id, None)
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.seqs.append(self._make_seq(request, num_new))
            budget -= num_new

    def _take_lora_slot(self, request: Request) -> bool:
        if self.lora_slots is None:
            raise ValueError(f"request {request.request_id!r} asks for a LoRA adapter but "
                             "LoRA is not enabled")
        slot = self.lora_slots.acquire(request.lora_int_id)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _release_lora(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1
        if request.is_finished:
            self._lora_waits.pop(request.request_id, None)

    def _make_seq(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        num_prompt = len(request.prompt_token_ids)
        if start >= num_prompt:  # a decode (or a resumed request's output part)
            token_ids = request.output_token_ids[start - num_prompt : end - num_prompt]
        else:
            token_ids = request.token_ids_slice(start, end)
        parents = None
        if drafts:
            token_ids += drafts
            parents = request.spec_parents[: len(drafts)] if request.spec_parents else None
        if request.spec_token_ids or request.spec_parents is not None:
            request.spec_token_ids, request.spec_parents = [], None  # for this step only
        # The live block table, not a copy: the runner reads it before the next schedule().
        return ScheduledSeq(request, token_ids, start, self.kv.get_block_ids(request.request_id),
                            end == num_prompt + len(request.output_token_ids), 0, len(drafts),
                            parents)

    def _push_waiting(self, request: Request) -> None:
        # A preempted request keeps its arrival_time, so it goes back ahead of later arrivals.
        entry = (request.priority, request.arrival_time, next(self._tie), request)
        heapq.heappush(self._waiting, entry)
        self._num_waiting += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][3].is_finished:
            heapq.heappop(self._waiting)  # aborted while waiting
        return self._waiting[0][3] if self._waiting else None

    # ---- results -------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
        grammars_advanced: bool = False,
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled ones, finish what stopped (freeing blocks).

        The constrained requests' grammars advance over their new tokens in one call after the
        loop; grammars_advanced: the caller does that itself (`grammar_tokens`, then
        `end_rejected`), e.g. in a thread while this runs."""
        outputs = []
        grammar_tokens = [] if grammars_advanced else self.grammar_tokens(scheduler_output, runner_output)
        requests = self.requests
        sampled_ids = runner_output.sampled_token_ids
        all_logprobs = runner_output.logprobs
        all_prompt_lps = runner_output.prompt_logprobs
        running_status = RequestStatus.RUNNING
        for seq in scheduler_output.seqs:
            request = seq.request
            rid = request.request_id
            if requests.get(rid) is not request:
                continue  # finished or aborted since it was scheduled
            running = request.status == running_status
            if running:
                # max: mark_launched may already have moved it past this step (async steps).
                end = _computed_after(seq, runner_output) if seq.num_spec_tokens \
                    else seq.start_pos + len(seq.token_ids) + seq.num_lookahead
                if end > request.num_computed_tokens:
                    request.num_computed_tokens = end
            elif not (seq.needs_sample and request.num_pending):
                continue  # preempted since it was scheduled
            # A request preempted after an async step was launched keeps that step's token
            # (its next one either way, and a seeded sample stays reproducible).
            new_ids = self._append_tokens(request, sampled_ids.get(rid)) \
                if seq.needs_sample else []
            if seq.num_spec_tokens and not request.is_finished:
                self.kv.trim(request, request.num_tokens)  # roll back the rejected drafts' slots
            prompt_lps = self._new_prompt_logprobs(rid, all_prompt_lps.get(rid)) \
                if all_prompt_lps else None
            if not new_ids and not prompt_lps:
                continue
            logprobs = all_logprobs.get(rid) if all_logprobs else None
            status = request.status
            finished = status.finished
            outputs.append(EngineCoreOutput(
                rid, new_ids,
                logprobs[: len(new_ids)] if logprobs is not None and new_ids else None,
                prompt_lps, status.finish_reason, request.stop_reason,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                # Timestamps matter once: with the first tokens (and again at the end).
                _timestamps(request) if new_ids and (
                    len(request.output_token_ids) - request.num_pending == len(new_ids)
                    or finished) else {},
            ))
            if finished:
                if running:
                    self.running.remove(request)
                else:
                    self._num_waiting -= 1  # its heap entry is skipped once finished
                self._finish(request, status)
        if grammar_tokens:
            outputs += self.end_rejected(grammar_tokens, advance_grammars(grammar_tokens))
        return outputs

    def grammar_tokens(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
                       ) -> list[tuple[Request, int]]:
        """(request, token) for each constrained request with one sampled token that
        update_from_output appends (one still in the scheduler: a single token always is)."""
        pairs = []
        for seq in scheduler_output.seqs:
            request = seq.request
            if request.grammar is None or not seq.needs_sample \
                    or self.requests.get(request.request_id) is not request:
                continue
            sampled = runner_output.sampled_token_ids.get(request.request_id)
            if sampled and len(sampled) == 1:
                pairs.append((request, sampled[0]))
        return pairs

    def end_rejected(self, grammar_tokens: list[tuple[Request, int]], accepted: list[bool]
                     ) -> list[EngineCoreOutput]:
        """End each request whose grammar rejected its token (its mask and its matcher
        disagreed: the output could not parse any more); their outputs."""
        outputs = []
        for (request, token), ok in zip(grammar_tokens, accepted, strict=True):
            if ok or request.is_finished:
                continue
            logger.warning("grammar rejected token %d; ending request %s", token, request.request_id)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self._num_waiting -= 1  # preempted: its heap entry is skipped once finished
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                            finish_reason=request.status.finish_reason))
        return outputs

    def _append_tokens(self, request: Request, sampled: list[int] | None) -> list[int]:
        """Append sampled tokens until one stops the request; returns those appended."""
        if not sampled:
            return []
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        # With async_scheduling the oldest placeholder is this step's token; any after it
        # belong to a step still on the device and come back only if the request goes on.
        num_pending = request.num_pending
        if num_pending:
            del request.output_token_ids[-num_pending:]
            request.num_pending = 0
        if len(sampled) == 1 and request.grammar is None:  # every row of a single step
            token = sampled[0]
            count, status = scan_stop(request, sampled, self._max_seq_len)
            request.output_token_ids.append(token)
            if status is not None:
                request.status = status
            elif num_pending > 1:
                request.output_token_ids.extend([PENDING_TOKEN] * (num_pending - 1))
                request.num_pending = num_pending - 1
            return [token]
        count, status = scan_stop(request, sampled, self._max_seq_len)
        grammar = request.grammar
        if grammar is not None:  # structured output: its end is a stop
            if len(sampled) == 1:  # advanced with the step's others (see grammar_tokens)
                if grammar.ends_on(sampled[0]):
                    status = RequestStatus.FINISHED_STOPPED
            else:
                count, status = grammar.accept(sampled[:count], status)
        appended = sampled[:count]
        request.output_token_ids.extend(appended)
        if status is not None:
            request.status = status  # blocks are freed by the caller, same call
        elif num_pending > 1:
            request.output_token_ids.extend([PENDING_TOKEN] * (num_pending - 1))
            request.num_pending = num_pending - 1
        return appended

    def _new_prompt_logprobs(self, rid: str, entries: list | None) -> list | None:
        """Drop positions already emitted before a preemption made the runner redo them."""
        if not entries:
            return None
        received = self._plp_received.get(rid, 0)
        emitted = self._plp_emitted.get(rid, 0)
        self._plp_received[rid] = received + len(entries)
        self._plp_emitted[rid] = max(emitted, received + len(entries))
        fresh = entries[max(0, emitted - received):]
        return fresh or None


def advance_grammars(grammar_tokens: list[tuple[Request, int]]) -> list[bool]:
    """Advance each request's grammar over its token, all in one xgrammar call; whether each
    accepted it. Touches the matchers only (a thread may run it beside update_from_output)."""
    return accept_batch([r.grammar for r, _ in grammar_tokens], [t for _, t in grammar_tokens])


def scan_stop(request: Request, tokens: list[int], max_seq_len: int
              ) -> tuple[int, RequestStatus | None]:
    """How many of `tokens` (sampled after request's current output) to append, and the status
    the last of them leaves: EOS or a stop token id once min_tokens are out (sets
    stop_reason), then max_tokens / max_seq_len. The same as checking token by token, with
    the scan done in set operations (multi-step decode returns 8 tokens a request).

    max_seq_len: max_model_len, or less when the whole KV cache holds fewer tokens.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    room = max_seq_len - len(request.prompt_token_ids) - num_output
    if params.max_tokens is not None and params.max_tokens - num_output < room:
        room = params.max_tokens - num_output
    eos = () if params.ignore_eos else request.eos_token_ids
    if len(tokens) == 1:  # the single-step path: every row, every step
        token = tokens[0]
        if (token in eos or token in params.stop_token_ids) \
                and num_output + 1 >= params.min_tokens:
            request.stop_reason = None if token in eos else token
            return 1, RequestStatus.FINISHED_STOPPED
        return 1, RequestStatus.FINISHED_LENGTH if room <= 1 else None
    n = min(len(tokens), max(room, 1))
    if eos or params.stop_token_ids:
        stops = {*eos, *params.stop_token_ids}
        first = max(params.min_tokens - num_output - 1, 0)  # tokens before it cannot stop
        window = tokens[first:n]
        if not stops.isdisjoint(window):
            i = next(j for j, t in enumerate(window) if t in stops)
            token = window[i]
            request.stop_reason = None if token in eos else token
            return first + i + 1, RequestStatus.FINISHED_STOPPED
    return n, RequestStatus.FINISHED_LENGTH if n >= room else None


def _computed_after(seq: ScheduledSeq, runner_output: RunnerOutput) -> int:
    """Tokens of seq's request whose K/V hold after the step: all it fed and looked ahead,
    less the draft tokens verification rejected (sampled = accepted drafts + one more)."""
    end = seq.start_pos + seq.num_tokens + seq.num_lookahead
    if seq.num_spec_tokens:
        sampled = runner_output.sampled_token_ids.get(seq.request_id) or [None]
        end -= seq.num_spec_tokens - min(len(sampled) - 1, seq.num_spec_tokens)
    return end


def _timestamps(request: Request) -> dict[str, Any]:
    stamps: dict[str, Any] = {"arrival_time": request.arrival_time}
    if request.first_scheduled_time is not None:
        stamps["first_scheduled_time"] = request.first_scheduled_time
    if request.first_token_time is not None:
        stamps["first_token_time"] = request.first_token_time
    if request.engine_arrival_time is not None:
        stamps["engine_arrival_time"] = request.engine_arrival_time
    if request.prefill_chunk_times:
        stamps["prefill_chunk_times"] = list(request.prefill_chunk_times)
    return stamps
