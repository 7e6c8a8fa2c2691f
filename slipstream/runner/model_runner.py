"""ModelRunner: SchedulerOutput -> flat batch -> model forward -> logits -> sampler -> RunnerOutput.

It owns the model and the paged KV cache (one (k_cache, v_cache) pair per layer) and sizes the
cache: from a byte budget on the CPU, from a profiling forward pass on CUDA.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from slipstream.config import EngineConfig
from slipstream.engine import startup
from slipstream.engine.auto_limits import resolve_step_limits
from slipstream.engine.request import Request
from slipstream.engine.step_timer import StepTimer
from slipstream.kernels.attention.l2_spans import budget_bytes
from slipstream.kv_cache.tier_cost import TierCost
from slipstream.models.loader import load_model
from slipstream.models.sizes import linear_parameters
from slipstream.parallel.sharding import kv_heads_per_rank
from slipstream.parallel.state import rank_info
from slipstream.quantization.kv_cache import check_kv_cache_device, prepare_kv_scales, resolve_kv_cache_dtype
from slipstream.runner.cuda_graphs import DecodeGraphs
from slipstream.runner.host_copies import HostKVCopies, measure_copy_rate, measure_matmul_rate
from slipstream.runner.input_batch import (
    BlockTableRows,
    HostBatch,
    ModelInputs,
    build_host_batch,
    inputs_from_host_batch,
    prepare_inputs,
    put_fed_tokens,
    to_device,
)
from slipstream.runner.launched import LaunchedTokens
from slipstream.runner.prefill_graphs import PrefillGraphs, prefill_sizes
from slipstream.sampling.logprobs import top_logprobs
from slipstream.sampling.sampler import Sampler, warm_up_greedy
from slipstream.sampling.speculative import verify_into
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import RunnerOutput, ScheduledSeq, SchedulerOutput
from slipstream.speculative.hidden import StepHidden, known_rows
from slipstream.speculative.tree import move_accepted_kv, path_moves

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
_PROMPT_LOGPROB_ROWS = 512  # rows of [rows, vocab] float32 logits materialised at once

KVCache = tuple[torch.Tensor, torch.Tensor]
# Input tokens still on the device: (token ids [R], per seq the row to take or -1).
_Feed = tuple[torch.Tensor, list[int]] | None
# A launched forward: the sampled seqs' logits on the device (None: none samples), their requests.
LaunchedLogits = tuple[torch.Tensor | None, list[Request]]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = resolve_step_limits(config)  # a runner built without an EngineCore
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.model: nn.Module | None = None
        self.kv_caches: list[KVCache] = []
        self.host_copies: HostKVCopies | None = None  # the host tier (initialize_host_cache)
        self.num_blocks = 0
        self._sampler = None
        self._graphs = None
        self._prefill_graphs = None
        self._use_graph_replay = False
        self.lora = None  # LoRAManager (slipstream/lora/manager.py) with enable_lora
        self._lora_graphs = None  # decode graphs captured with LoRA on
        self._kv_scales_ready = False
        # A speculative draft model's KV bytes per block: its cache shares the target's block
        # ids, so the budget is split by bytes per block (speculative/draft_model.py sets it).
        self.draft_kv_bytes_per_block = 0
        # A proposer that drafts from the target's hidden states (Medusa, EAGLE): every step
        # returns them (RunnerOutput.spec_hidden), from the prefill graphs' static buffer or
        # an eager forward; never from the decode graphs, which keep none.
        self.keep_hidden = False
        self.timer = StepTimer(config.device, enabled=False)  # EngineCore shares its own
        self._block_tables = BlockTableRows()  # running requests' block tables, kept
        if self.device.type == "cpu":  # once per process: the server's engine process set it
            from slipstream.runner.cpu_threads import configure_cpu_threads

            configure_cpu_threads(config.cpu_threads)

    # ---- set-up --------------------------------------------------------------------------
    def load_model(self) -> None:
        if not self.config.lora.enabled:
            self.model = load_model(self.config)
            return
        from slipstream.lora.manager import LoRAManager
        from slipstream.models.norm_fold import kept_norms

        with kept_norms():  # adapters read the normalised input that a folded norm never forms
            self.model = load_model(self.config)
        self.lora = LoRAManager(self.config, self.model, self.device)

    def add_lora(self, lora_int_id: int, path: str | None) -> None:
        """Register and read an adapter (ValueError when LoRA is off or the adapter is bad)."""
        if self.lora is None:
            raise ValueError("this engine was started without enable_lora: it serves no "
                             "LoRA adapters")
        self.lora.add(lora_int_id, path)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """float32 / bfloat16 / float16, or 1-byte fp8 (e4m3) / int8 with per-layer scales.
        "auto": the checkpoint's kv_cache_dtype if its config names one, else the model dtype."""
        dtype = resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.config.dtype,
                                       self.config.model.hf_config)
        check_kv_cache_device(dtype, self.device)
        return dtype

    def prepare_kv_scales(self) -> None:
        """fp8 / int8 cache: each layer's k_scale / v_scale from the checkpoint, else 1.0 (fp8)
        or a calibration run now (int8). Once, before any cache is allocated (it needs memory)."""
        if self._kv_scales_ready or self.model is None:
            return
        prepare_kv_scales(self.model, self.config, self.kv_cache_dtype)
        self._kv_scales_ready = True

    def _kv_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        m = self.config.model
        # Tensor parallel: this rank's KV heads (parallel/sharding.py; 1 replicated head when
        # there are fewer heads than ranks).
        kv_heads = kv_heads_per_rank(m.num_key_value_heads, rank_info().tp_size)
        return (num_blocks, self.block_size, kv_heads, m.head_dim)

    @property
    def num_cache_layers(self) -> int:
        """Decoder layers whose KV this runner holds (pipeline parallel: its stage's)."""
        stage = getattr(getattr(self.model, "model", None), "stage", None)
        return stage.num_layers if stage is not None else self.config.model.num_hidden_layers

    def kv_cache_bytes_per_block(self) -> int:
        """K and V of one block in every layer (fp8 / int8: 1 byte an element; the per-layer
        scales are model buffers, not cache)."""
        _, bs, heads, dim = self._kv_shape(1)
        elem = self.kv_cache_dtype.itemsize
        return 2 * self.num_cache_layers * bs * heads * dim * elem

    def determine_num_blocks(self) -> int:
        """cache.num_blocks if set; else a byte budget (cache.kv_cache_memory, CPU default 1 GiB,
        CUDA: gpu_memory_utilization * total memory - peak of a profiling forward) / block."""
        cache = self.config.cache
        self.prepare_kv_scales()  # a start-up calibration must run before memory is profiled
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        per_block = self.kv_cache_bytes_per_block() + self.draft_kv_bytes_per_block
        num_blocks = budget // per_block
        if self.draft_kv_bytes_per_block:
            logger.info("KV budget %.2f GiB split by bytes per block: target %.2f GiB, draft "
                        "model %.2f GiB (%d blocks)", budget / 2**30,
                        num_blocks * self.kv_cache_bytes_per_block() / 2**30,
                        num_blocks * self.draft_kv_bytes_per_block / 2**30, num_blocks)
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{self.kv_cache_bytes_per_block()} bytes; raise kv_cache_memory "
                             "or gpu_memory_utilization")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate (zeroed) K and V of `num_blocks` blocks for every layer."""
        self.prepare_kv_scales()
        shape = self._kv_shape(num_blocks)
        dtype = self.kv_cache_dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(self.num_cache_layers)
        ]
        self.num_blocks = num_blocks

    def _cuda_kv_budget(self) -> int:
        """Bytes left for the KV cache after weights, activation peak and non-torch memory."""
        peak = self._profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(self.config.cache.gpu_memory_utilization * total) - peak - max(non_torch, 0)
        logger.info("KV budget %.2f GiB (total %.2f GiB, peak %.2f GiB, non-torch %.2f GiB)",
                    budget / 2**30, total / 2**30, peak / 2**30, non_torch / 2**30)
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {self.config.cache.gpu_memory_utilization:g}"
                f" of {total / 2**30:.1f} GiB minus {peak / 2**30:.2f} GiB allocated at the peak "
                f"of a forward (weights and any other engine of this process) and "
                f"{max(non_torch, 0) / 2**30:.2f} GiB used outside PyTorch; lower max_num_tokens, "
                "raise gpu_memory_utilization or set kv_cache_memory")
        return budget

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak allocated bytes of one forward at max_num_tokens (its scratch KV cache excluded)."""
        sched = self.config.scheduler
        lengths = _split(sched.max_num_tokens, max(1, sched.max_model_len - 1), sched.max_num_seqs)
        blocks_per_seq = [-(-n // self.block_size) for n in lengths]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        saved = self.kv_caches, self.num_blocks
        self.initialize_kv_cache(sum(blocks_per_seq))
        scratch = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)
        seqs, next_block = [], 0
        for n, nb in zip(lengths, blocks_per_seq):
            req = Request(f"profile-{len(seqs)}", [0] * n, SamplingParams(max_tokens=1))
            seqs.append(ScheduledSeq(req, [0] * n, 0, list(range(next_block, next_block + nb)),
                                     True))
            next_block += nb
        logits, _ = self.forward_logits(SchedulerOutput(seqs=seqs))
        # With drafts a verification samples k + 1 rows a request, more than the headroom that
        # gpu_memory_utilization leaves can hold at a large vocabulary: reserve them.
        rows = max_sampled_rows(self.config) if _max_draft_tokens(self.config) else 0
        if rows > logits.shape[0]:
            logits = logits.new_zeros((rows, logits.shape[-1]), dtype=torch.float32)
        # Stands in for the sampler's [rows, V] temporaries (probabilities, exponentials).
        probs = torch.softmax(logits.float(), dim=-1)
        (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        del logits, probs
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch
        self.kv_caches, self.num_blocks = saved
        torch.cuda.empty_cache()
        return peak

    def initialize_host_cache(self) -> int:
        """The host KV tier (kv_cache/host_tier.py): as many blocks as kv_cache_host_memory
        holds, K and V of every layer, pinned on CUDA so copies run asynchronously. Returns
        the block count (0: no tier)."""
        budget = self.config.cache.kv_cache_host_memory
        if not budget:
            return 0
        num_blocks = budget // self.kv_cache_bytes_per_block()
        if num_blocks < 1:
            raise ValueError(f"kv_cache_host_memory={budget} holds no block of "
                             f"{self.kv_cache_bytes_per_block()} bytes")
        self.host_copies = HostKVCopies(self.kv_caches, int(num_blocks))
        return int(num_blocks)

    def apply_kv_transfers(self, transfers: list[tuple[str, int, int]]) -> None:
        """The host tier's block copies, in effect in order, queued before the next forward:
        ("out", device block, host block) or ("in", host block, device block), batched
        (runner/host_copies.py)."""
        if transfers:
            self.host_copies.apply(transfers)

    def host_tier_cost(self) -> TierCost:
        """The host tier's cost model, from this device's measured copy and matmul rates and
        the model's work per token (kv_cache/tier_cost.py)."""
        m = self.config.model
        layers = len(self.kv_caches)
        copy_rate = measure_copy_rate(self.host_copies)
        flops_rate = measure_matmul_rate(self.device, self.kv_caches[0][0].dtype, m.hidden_size)
        linear = linear_parameters(m.hf_config) * layers / m.num_hidden_layers
        return TierCost(
            block_size=self.block_size, block_bytes=self.kv_cache_bytes_per_block(),
            copy_bytes_per_s=copy_rate, flops_per_s=flops_rate,
            linear_flops_per_token=2.0 * linear,
            attention_flops_per_position=4.0 * layers * m.num_attention_heads * m.head_dim)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer, queued on the stream
        before the next forward (a forked beam's partly filled block: KVCacheManager.fork)."""
        if not pairs or not self.kv_caches:
            return
        ids = to_device(np.asarray(pairs, dtype=np.int64), self.device)  # no host sync
        src, dst = ids[:, 0], ids[:, 1]
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    # ---- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor, ModelInputs]:
        """Run the step's batch; logits [S, vocab] float32 for the needs_sample seqs, in order."""
        inputs, hidden = self._forward(sched.seqs)
        return self.model.compute_logits(hidden[inputs.logits_indices]), inputs

    def _forward(self, seqs: list[ScheduledSeq]) -> tuple[ModelInputs, torch.Tensor]:
        if self.model is None or not self.kv_caches:
            raise RuntimeError("call load_model() and initialize_kv_cache() before running")
        inputs = prepare_inputs(seqs, self.block_size, self.device)
        if self.lora is not None:
            self.lora.prepare_eager(seqs)
        return inputs, self._forward_inputs(inputs)

    def _forward_inputs(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def capture_cuda_graphs(self) -> None:
        """Record decode steps for the batch sizes the engine allows (CUDA, not enforce_eager).

        Without graphs (CPU, enforce_eager) the same static decode buffers still back
        multi-step decoding when decode_steps > 1, running the model eagerly.
        """
        sched = self.config.scheduler
        use_graphs = self.device.type == "cuda" and not self.config.enforce_eager
        if not use_graphs and sched.decode_steps <= 1:
            return
        self._graphs = DecodeGraphs(
            self.model, self.kv_caches, self.device, max_batch_size=sched.max_num_seqs,
            max_blocks_per_seq=self._max_blocks_per_seq(), max_seq_len=sched.max_model_len)
        self._use_graph_replay = use_graphs
        self._lora_graphs = self._graphs  # without graphs the eager forward reads the layout
        if use_graphs:
            self._attach_l2_prefetch()
            self._graphs.capture()
            if self.lora is not None:
                self._lora_graphs = self.lora.capture(self._capture_lora_decode_graphs)
            self._capture_prefill_graphs()
        # A build warms the multi-step kernels whatever its own decode_steps: LLM loads the
        # engine with multi-step decode on, and must find them in the engine's kernel cache.
        if sched.decode_steps > 1 or startup.BUILD_DIR.get() is not None:
            self._graphs.warm_up_greedy(self.block_size)

    def _capture_lora_decode_graphs(self) -> DecodeGraphs:
        sched = self.config.scheduler
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.device, max_batch_size=sched.max_num_seqs,
            max_blocks_per_seq=self._max_blocks_per_seq(), max_seq_len=sched.max_model_len)
        graphs.pool = self._graphs.pool
        graphs.capture()
        return graphs

    def _decode_graphs_for(self, seqs: list[ScheduledSeq]) -> DecodeGraphs:
        """The decode graphs a batch replays: with LoRA on when a request uses an adapter (its
        layout staged for the padded batch size), else the plain ones."""
        if self.lora is None:
            return self._graphs
        if self.lora.stage_static(seqs, self._graphs.padded_size(len(seqs))):
            return self._lora_graphs
        return self._graphs

    def _attach_l2_prefetch(self) -> None:
        """Span tables of the weights each layer reads after attention, for the decode graphs'
        split attention launches to prefetch into L2 (kernels/attention/l2_spans.py); models without
        attach_l2_prefetch go without."""
        attach = getattr(self.model, "attach_l2_prefetch", None)
        if attach is None:
            return
        per_layer = attach(budget_bytes(self.device, self.config.quant.method))
        logger.info("L2 prefetch in decode attention: %.1f MiB a layer%s", per_layer / 2**20,
                    "" if per_layer else " (off)")

    def _capture_prefill_graphs(self) -> None:
        """Graphs for prefill steps of up to max_prefill_graph_tokens (capped by the step's
        token budget and max_model_len: the padding sequence must fit a block table)."""
        sched = self.config.scheduler
        limit = min(self.config.max_prefill_graph_tokens, sched.max_num_tokens,
                    sched.max_model_len)
        if not prefill_sizes(limit):
            return
        self._prefill_graphs = self.new_prefill_graphs(limit, pool=self._graphs.pool)
        self._prefill_graphs.capture()

    def new_prefill_graphs(self, max_tokens: int, pool=None) -> PrefillGraphs:
        """Prefill graphs' buffers for this engine's steps (uncaptured): with a draft-tree mask
        when the proposer drafts trees, the hidden-state buffer with keep_hidden."""
        sched, spec = self.config.scheduler, self.config.speculative
        return PrefillGraphs(
            self.model, self.kv_caches, self.device, max_tokens=max_tokens,
            max_blocks_per_seq=self._max_blocks_per_seq(), max_seq_len=sched.max_model_len,
            max_seqs=sched.max_num_seqs, pool=pool, max_logits_rows=_verify_rows(self.config),
            trees=spec is not None and spec.drafts_trees, keep_hidden=self.keep_hidden)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run the batch kinds the first requests bring once, so the kernel variants they need
        are compiled at start-up rather than while a request waits (each Triton compile of the
        attention kernel takes about a second)."""
        if self.model is None:
            return
        max_len = self.config.scheduler.max_model_len
        for batch in warmup_batches(self.block_size):
            need = sum(_blocks_for(start + n, self.block_size) for n, start in batch)
            if need > self.num_blocks or any(start + n > max_len for n, start in batch):
                continue
            logits, _ = self.forward_logits(SchedulerOutput(seqs=_warmup_seqs(batch, self.block_size)))
            warm_up_greedy(logits)
        if self.lora is not None:  # the LoRA kernels, on slot 0 (zeros until an adapter comes)
            self.lora.force_slot = 0
            try:
                for batch in warmup_batches(self.block_size)[:2]:
                    self.forward_logits(SchedulerOutput(seqs=_warmup_seqs(batch, self.block_size)))
            finally:
                self.lora.force_slot = None
                self.lora.off()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def max_decode_batch(self) -> int:
        """Largest batch the multi-step decode path takes (0: none)."""
        return self._graphs.sizes[-1] if self._graphs is not None else 0

    @torch.inference_mode()
    def launch_decode_steps(self, sched: SchedulerOutput, num_steps: int, feed: _Feed = None
                            ) -> LaunchedTokens:
        """Pure-decode batch, num_steps tokens per request without the host: queues the steps
        and returns their token ids [num_steps, num_seqs] (on the device, their host copy
        queued behind them) for collect_decode_steps. The scheduler has reserved blocks for
        every step (ScheduledSeq.num_lookahead). feed: input tokens still on the device (see
        DecodeGraphs.run_steps); the seqs' token_ids are then placeholders.

        Greedy batches take the fused argmax; a batch with sampled requests runs the sampler
        once a step, as the single-step path would (each seeded request draws from its own
        generator once a step, in step order, so its tokens are the same either way)."""
        hb = self._host_batch(sched)
        graphs = self._decode_graphs_for(sched.seqs)
        requests = [s.request for s in sched.seqs]
        sample = None
        if not all(r.sampling_params.greedy for r in requests):
            sampler = self._get_sampler()

            def sample(logits: torch.Tensor) -> torch.Tensor:
                return sampler.sample_on_device(logits, requests)

        with self.timer.phase("graph"):
            return LaunchedTokens(graphs.run_steps(hb, num_steps, self.block_size, feed, sample))

    def collect_decode_steps(self, sched: SchedulerOutput, tokens: LaunchedTokens) -> RunnerOutput:
        """Wait for launched decode steps and return their tokens, per request."""
        with self.timer.phase("graph"):
            rows = tokens.host().T.tolist()
        out = RunnerOutput()
        for seq, row in zip(sched.seqs, rows, strict=True):
            out.sampled_token_ids[seq.request_id] = row
        return out

    def _host_batch(self, sched: SchedulerOutput) -> HostBatch:
        """The step's host arrays, block tables gathered from the rows kept across steps."""
        self._block_tables.forget(sched.finished_request_ids)
        return build_host_batch(sched.seqs, self.block_size, tables=self._block_tables)

    def _max_blocks_per_seq(self) -> int:
        return -(-(self.config.scheduler.max_model_len + 1) // self.block_size)

    def _decode_logits(self, sched: SchedulerOutput, feed: _Feed = None):
        """Logits from a replayed CUDA graph when the step is a pure decode, else None."""
        graphs = self._graphs
        if graphs is None or not self._use_graph_replay or len(sched.seqs) > graphs.sizes[-1]:
            return None
        if any(s.num_tokens != 1 or not s.needs_sample for s in sched.seqs):
            return None
        hb = self._host_batch(sched)
        if hb.block_tables.shape[1] > graphs.max_blocks_per_seq:
            return None
        return self._decode_graphs_for(sched.seqs).run(hb, feed)

    def _prefill_logits(self, sched: SchedulerOutput, hb: HostBatch, feed: _Feed = None):
        """(logits of the sampled seqs or None, their requests, the step's hidden states with
        keep_hidden else None) from a replayed prefill graph, or None when no captured graph
        takes the step (too many tokens or sequences, a request wants prompt logprobs: those
        need the eager path's hidden states)."""
        graphs = self._prefill_graphs
        if self.lora is not None and self.lora.uses_adapters(sched.seqs):
            return None  # captured without LoRA: adapter steps run eagerly
        if graphs is None or not graphs.accepts(hb) or any(
                s.request.sampling_params.prompt_logprobs is not None for s in sched.seqs):
            return None
        with self.timer.phase("graph"):
            logits = graphs.run(hb, feed)
        requests = [sched.seqs[i].request for i in hb.sample_seq_indices]
        hidden = None
        if self.keep_hidden:
            hidden = hb.query_start_loc.tolist(), graphs.hidden_rows(len(hb.input_ids))
        return (logits if requests else None), requests, hidden

    def _step_logits(self, sched: SchedulerOutput, feed: _Feed):
        """The step's forward, a graph replay where one takes it: (logits of the needs_sample
        seqs or None when none samples, their requests, (query_start_loc, hidden) of an eager
        forward or of a replay with keep_hidden, else None)."""
        with self.timer.phase("graph"):
            logits = None if self.keep_hidden else self._decode_logits(sched, feed)
        if logits is not None:
            return logits, [s.request for s in sched.seqs], None
        with self.timer.phase("prepare"):
            hb = self._host_batch(sched)
        prefill = self._prefill_logits(sched, hb, feed)
        if prefill is not None:
            return prefill
        with self.timer.phase("prepare"):
            # Fed tokens (see DecodeGraphs.run_steps) go in place of each fed seq's last input.
            inputs = inputs_from_host_batch(hb, self.device)
            put_fed_tokens(inputs.input_ids, hb, feed)
            if self.lora is not None:
                self.lora.prepare_eager(sched.seqs)
        with self.timer.phase("forward"):
            hidden = self._forward_inputs(inputs)
        kept = inputs.query_start_loc_cpu, hidden
        if not inputs.sample_seq_indices:
            return None, [], kept
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return logits, [sched.seqs[i].request for i in inputs.sample_seq_indices], kept

    @torch.inference_mode()
    def launch_sampled(self, sched: SchedulerOutput, feed: _Feed = None) -> LaunchedTokens:
        """execute_model's GPU work with the sampled token ids left on the device, one per
        needs_sample seq in order (async_scheduling: no request of the step wants logprobs or
        prompt logprobs). collect_sampled reads them."""
        return self.sample_launched(self.launch_logits(sched, feed))

    @torch.inference_mode()
    def launch_logits(self, sched: SchedulerOutput, feed: _Feed = None) -> LaunchedLogits:
        """launch_sampled's forward alone: the logits of the needs_sample seqs (None when none
        samples) and their requests, on the device. The caller may update host state the
        sampler reads (grammars) before sample_launched samples them, while the forward runs."""
        logits, requests, _ = self._step_logits(sched, feed)
        return logits, requests

    @torch.inference_mode()
    def sample_launched(self, launched: LaunchedLogits) -> LaunchedTokens:
        """Sample launch_logits' logits on the device, as launch_sampled does."""
        logits, requests = launched
        if logits is None:
            return LaunchedTokens(torch.empty(0, dtype=torch.int64, device=self.device))
        return LaunchedTokens(self._get_sampler().sample_on_device(logits, requests))

    @staticmethod
    def collect_sampled(sched: SchedulerOutput, tokens: LaunchedTokens) -> RunnerOutput:
        """Wait for a launch_sampled step and return its tokens, per request."""
        requests = [s.request for s in sched.seqs if s.needs_sample]
        values = tokens.host().tolist()
        if len(values) != len(requests):
            raise ValueError(f"{len(values)} sampled tokens for {len(requests)} sampled seqs")
        return RunnerOutput({r.request_id: [t] for r, t in zip(requests, values)})

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput,
                      while_gpu_runs: Callable[[], None] | None = None,
                      feed: _Feed = None) -> RunnerOutput:
        """One step: sampled tokens for needs_sample seqs, plus logprobs where asked.
        while_gpu_runs: host work to do once the forward is queued, before sampling waits.
        feed: input tokens still on the device (see DecodeGraphs.run_steps)."""
        out = RunnerOutput()
        if sched.is_empty:
            _call(while_gpu_runs)
            return out
        logits, requests, eager = self._step_logits(sched, feed)
        _call(while_gpu_runs)
        paths = {}
        if logits is not None:
            with self.timer.phase("sample"):
                if any(s.num_spec_tokens for s in sched.seqs):
                    paths = verify_into(out, self._get_sampler(), logits, sched.seqs)
                    self._move_tree_kv(sched, paths)
                else:
                    self._sample_into(out, logits, requests)
        if eager is None:
            return out
        qsl, hidden = eager
        if self.keep_hidden:
            self._keep_hidden(out, sched, qsl, hidden, paths)
        for i, seq in enumerate(sched.seqs):
            entries = self._prompt_logprobs(seq, hidden, qsl[i])
            if entries:
                out.prompt_logprobs[seq.request_id] = entries
        return out

    def _move_tree_kv(self, sched: SchedulerOutput, paths: dict[str, list[int]]) -> None:
        """Draft trees: the accepted path's K/V to the slots right after the root (tree.py)."""
        if not paths:
            return
        moves = [path_moves(paths[s.request_id], s.start_pos, s.block_ids, self.block_size)
                 for s in sched.seqs if s.request_id in paths]
        move_accepted_kv(self.kv_caches, moves)

    def _keep_hidden(self, out: RunnerOutput, sched: SchedulerOutput, qsl: list[int],
                     hidden: torch.Tensor, paths: dict[str, list[int]]) -> None:
        out.spec_hidden = StepHidden(hidden, None, sched.seqs, qsl,
                                     known_rows(sched.seqs, qsl, out.sampled_token_ids, paths))

    def _sample_into(self, out: RunnerOutput, logits: torch.Tensor, requests: list[Request]) -> None:
        sampled = self._get_sampler()(logits, requests)
        for req, token, lps in zip(requests, sampled.token_ids, sampled.logprobs, strict=True):
            out.sampled_token_ids[req.request_id] = [int(token)]
            if lps is not None:
                out.logprobs[req.request_id] = [lps]

    def _get_sampler(self):
        if self._sampler is None:
            self._sampler = Sampler(seed=self.config.seed)
        return self._sampler

    def _prompt_logprobs(self, seq: ScheduledSeq, hidden: torch.Tensor,
                         row0: int) -> list[dict[int, float] | None]:
        """Entries for prompt positions this chunk reveals: None for position 0, then, for
        each position p in (start_pos, min(end, P - 1)], {prompt[p]: lp, top-k ...} from row p-1.

        Skipped once the request has output tokens (a recompute after preemption).
        """
        req = seq.request
        k = req.sampling_params.prompt_logprobs
        if k is None or req.num_output_tokens > 0 or seq.start_pos >= req.num_prompt_tokens:
            return []
        entries: list[dict[int, float] | None] = [None] if seq.start_pos == 0 else []
        start = seq.start_pos
        n = min(start + seq.num_tokens, req.num_prompt_tokens - 1) - start
        targets = req.prompt_token_ids[start + 1 : start + 1 + n]
        for lo in range(0, n, _PROMPT_LOGPROB_ROWS):
            hi = min(n, lo + _PROMPT_LOGPROB_ROWS)
            logits = self.model.compute_logits(hidden[row0 + lo : row0 + hi])
            entries += top_logprobs(torch.log_softmax(logits, dim=-1), targets[lo:hi], k)
        return entries


def _max_draft_tokens(config: EngineConfig) -> int:
    """The most draft tokens or tree nodes one request verifies in a step (0: no drafts)."""
    return max(config.speculative.max_draft_tokens if config.speculative else 0,
               config.grammar_forced_drafts)


def max_sampled_rows(config: EngineConfig) -> int:
    """Logits rows one step can sample: a row a seq, k + 1 for a seq verifying k drafts, and
    never more than the step's tokens (drafts are cut to fit its token budget)."""
    sched = config.scheduler
    rows = sched.max_num_seqs * (_max_draft_tokens(config) + 1)
    return min(rows, max(sched.max_num_tokens, sched.max_num_seqs))


def _verify_rows(config: EngineConfig) -> int | None:
    """Logits rows a captured prefill step returns with speculative decoding or grammar drafts,
    capped at 256 rows ([rows, vocab] float32 buffer); None without drafts."""
    if not _max_draft_tokens(config):
        return None
    return min(max_sampled_rows(config), 256)


def _call(fn: Callable[[], None] | None) -> None:
    if fn is not None:
        fn()


def _split(total: int, max_len: int, max_seqs: int) -> list[int]:
    """Split `total` tokens into at most max_seqs sequences of at most max_len tokens."""
    lengths = []
    while total > 0 and len(lengths) < max_seqs:
        lengths.append(min(total, max_len))
        total -= lengths[-1]
    return lengths


# A chunk fed after this many cached tokens spans more than one KV split of the attention
# kernel (its _MIN_TOKENS_PER_SPLIT is 64), so the split-KV prefill variant gets compiled: a
# first 400-token prompt needs it.
_WARMUP_CACHED_TOKENS = 96


def warmup_batches(block_size: int) -> list[list[tuple[int, int]]]:
    """The warm-up's batches as (tokens fed, tokens already cached) per sequence: a fresh
    prefill, a prefill and a decode together, a decode, and a chunk after a long cached prefix."""
    long_prefix = -(-_WARMUP_CACHED_TOKENS // block_size) * block_size
    return [[(2 * block_size, 0)], [(17, 0), (1, block_size)], [(1, block_size)],
            [(2 * block_size, long_prefix)]]


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-(num_tokens + 1) // block_size)


def _warmup_seqs(batch: list[tuple[int, int]], block_size: int) -> list[ScheduledSeq]:
    """ScheduledSeqs of dummy tokens, each sequence on its own blocks (0, 1, ...)."""
    seqs, first_block = [], 0
    for i, (n, start) in enumerate(batch):
        nb = _blocks_for(start + n, block_size)
        req = Request(f"warmup-{i}", [1] * (start + n), SamplingParams(max_tokens=1))
        seqs.append(ScheduledSeq(req, [1] * n, start, list(range(first_block, first_block + nb)),
                                 True))
        first_block += nb
    return seqs
