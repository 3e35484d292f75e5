"""Runs one scheduled step on the model: builds flattened inputs from the persistent batch,
calls the model over the paged KV cache, and samples where a next token is due."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tidal.core.config import EngineConfig
from tidal.core.pooling import read_pooling_config
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.core.step_profiler import StepProfiler
from tidal.gpu.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.host_allocator import keep_freed_host_memory, release_freed_host_memory
from tidal.gpu.cpu.kernels import denormals_flushed, load_cpu_kernels
from tidal.gpu.cpu.model_upgrade import CpuUpgrades, plans_of
from tidal.gpu.cpu.selector import PlanCache
from tidal.gpu.cpu.step_watch import StepWatch
from tidal.gpu.cuda_graphs import CudaGraphRunner
from tidal.gpu.distributed import tensor_parallel
from tidal.gpu.draft_runner import DraftedHandle, DraftRunner
from tidal.gpu.input_batch import CachedRequestState, InputBatch
from tidal.gpu.kv_cache_setup import KVCacheSetup
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadedModel, LoadOptions, load_model, resolve_dtype
from tidal.gpu.pipeline import pipeline_stage
from tidal.gpu.pooler import PooledHandle, Pooler
from tidal.gpu.prompt_logprobs import plan_prompt_rows, score_prompt_rows
from tidal.gpu.sampler import Sampler, apply_grammar_bitmask
from tidal.gpu.sampling_metadata import build_sampling_metadata
from tidal.gpu.spec_step import AttentionRows, decode_turn, rows_as_decode, spec_rows, write_drafts
from tidal.gpu.spec_verify import verify
from tidal.gpu.step_handle import StepHandle
from tidal.gpu.step_inputs import StepInputs, TokenLayout, advance, fill_in_flight
from tidal.gpu.weight_shards import local_config
from tidal.gpu.window_inputs import window_decode_inputs, window_inputs

logger = logging.getLogger(__name__)


class ModelRunner(KVCacheSetup):
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = config.device
        self.dtype = resolve_dtype(config.dtype, config.device)
        if self.device == "cpu":
            keep_freed_host_memory()
            if config.cpu_kernels is not None:
                selector.set_mode(config.cpu_kernels)
        self.max_model_len, self.block_size = max_model_len, config.block_size
        self.tp, self.stage = tensor_parallel(), pipeline_stage()
        self.shard_config = self.stage.local(local_config(model_config, self.tp))  # heads, layers
        # A first start on a CPU serves at once while the kernels build or its plans are
        # timed, and plans timed on a noisy host are timed again later (a server's, on one
        # device; a tensor-parallel rank builds and plans first, as its peers do).
        self._last_step_at = 0.0  # time.monotonic() of the latest step
        self._upgrades = (CpuUpgrades(self._load_model, plans_of, self.plan_signature(),
                                      lambda: self._last_step_at)
                          if self.device == "cpu" and not config.offline and self.tp.world_size == 1
                          else None)
        # the model, and on the CPU its plans and one-call decode step (gpu/cpu/backend.py)
        self.model, self.cpu = (self._upgrades.start() if self._upgrades is not None
                                else self._load_model())
        self._step_watch = (StepWatch() if self.device == "cpu" and self.tp.world_size == 1
                            and selector.mode() == "auto" else None)
        self.drafter = DraftRunner.for_config(config, model_config, max_model_len, self.dtype)
        self.sampler = Sampler()
        self.pooler = (Pooler(read_pooling_config(config.model)) if config.runner == "pooling"
                       else None)  # embeddings, nothing sampled (gpu/pooler.py)
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, max_model_len, self.max_blocks_per_req,
                                config.device, window_tables=self.window_group is not None)
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.cuda_graphs: CudaGraphRunner | None = None
        self.profiler = StepProfiler()
        self._last_sampled = torch.empty(0, dtype=torch.long, device=self.device)
        self._last_index: dict[str, int] = {}
        self._modes_thread: int | None = None  # the thread holding ``step_modes``
        kernels = load_cpu_kernels() if self.device == "cpu" else None
        self._decode_inputs = kernels.decode_inputs if kernels is not None else None
        self._token_ids_cpu = torch.from_numpy(self.batch.token_ids)  # the same memory
        self._block_table_cpu = torch.from_numpy(self.batch.block_table)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def attention_cost_context(self) -> int:
        return self.model_config.attention_cost_context()

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model_config.eos_token_ids

    def kernel_summary(self) -> str:
        """What runs the model's ops, in a line for the start-up banner."""
        if self.device != "cpu":
            graphs = ", CUDA graphs for decode steps" if self.cuda_graphs is not None else ""
            return f"{self.backend.name} attention{graphs}"
        mode = selector.mode()
        waiting = self._upgrades.waiting if self._upgrades is not None else None
        if waiting == "kernels":
            return (f"--cpu-kernels {mode}: torch's paths while tidal's C++ kernels build in the "
                    "background, then the kernels")
        if waiting == "plans":
            return (f"--cpu-kernels {mode}: untimed defaults while this model's plans are "
                    "timed in the background")
        if self.cpu is None:
            return f"--cpu-kernels {mode}: torch's own paths ({self.dtype} is not packed)"
        plans = self.cpu.plans
        built = "C++ kernels loaded" if load_cpu_kernels() is not None else "no C++ kernels"
        how = (f"{plans.measured} plans timed now" if plans.measured
               else "plans from this host's cache" if plans.timed
               else {"force": "tidal's kernels wherever they apply, untimed",
                     "off": "torch's own paths, untimed"}.get(mode, "defaults, untimed"))
        rows = self.cpu.stack_rows
        stack = (f"; one-call decode step at {sum(rows[1:])} of 1-{len(rows) - 1} rows"
                 if self.cpu.stack is not None else "")
        return (f"--cpu-kernels {mode} ({built}, {how}): {plans.summary()}{stack}"
                f"{self._upgrades.retime_note() if self._upgrades is not None else ''}")

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend of the model that runs now."""
        return self.model.layers[0].self_attn.backend

    def shutdown(self) -> None:
        """Stop waiting to re-time plans (an upgrade already under way runs out)."""
        if self._upgrades is not None:
            self._upgrades.cancel()
        self.close_kv_tiers()

    def plan_signature(self) -> str:
        """What the model's CPU plans depend on beyond the host: its shapes and settings."""
        c, m = self.config, self.model_config
        return (f"{m.architecture}|h{m.hidden_size}|i{m.intermediate_size}|l{m.num_layers}|"
                f"{m.num_heads}/{m.num_kv_heads}x{m.head_dim}|v{m.vocab_size}|{self.dtype}|"
                f"{c.quantization}/{c.quantization_group_size}|{c.attention_backend}|"
                f"rows{c.max_num_batched_tokens}|seqs{c.max_num_seqs}|len{self.max_model_len}")

    def _load_model(self, timed: bool = True, plan_cache: PlanCache | None = None,
                    serving: LoadedModel | None = None) -> LoadedModel:
        config = self.config
        backend = get_attention_backend(config.attention_backend, config.device)
        loaded = load_model(config.model, self.model_config, LoadOptions(
            backend, self.max_model_len, self.dtype, config.device,
            max_rows=config.max_num_batched_tokens, max_seqs=config.max_num_seqs, timed=timed,
            quantization=config.quantization, group_size=config.quantization_group_size,
            plan_cache=plan_cache, reuse=serving.model if serving is not None else None))
        if config.device == "cpu":
            release_freed_host_memory()  # the load's temporaries, kept by the thresholds
        return loaded

    def _swap_in(self, loaded: LoadedModel) -> None:
        """Between steps: the model upgraded in the background (``gpu/cpu/model_upgrade.py``)."""
        self.model, self.cpu = loaded
        if self._step_watch is not None:
            self._step_watch.reset()  # new plans: the steps' new baselines
        kernels = load_cpu_kernels()
        self._decode_inputs = kernels.decode_inputs if kernels is not None else None
        if kernels is not None:  # the step modes were entered before the kernels were there
            kernels.flush_denormals_in_pool()
        logger.info("serving on the upgraded CPU model from this step: %s",
                    self.kernel_summary())
        release_freed_host_memory()  # the model it replaced, kept by the thresholds

    def _watched_forward(self, inputs: StepInputs) -> torch.Tensor:
        """``run_model``, a CPU server's decode steps timed: steps persistently slower than
        when the plans came in have the plans timed again (``StepWatch``)."""
        meta = inputs.meta
        if self._step_watch is None or not meta.is_decode_only:
            return self.run_model(inputs.input_ids, inputs.positions, meta)
        start = time.perf_counter()
        hidden = self.run_model(inputs.input_ids, inputs.positions, meta)
        ms, context = (time.perf_counter() - start) * 1e3, sum(meta.seq_lens_cpu) / meta.num_reqs
        if self._step_watch.observe(meta.num_reqs, context, ms) and self._upgrades is not None:
            self._upgrades.slow_steps()
        return hidden

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states: from the CPU's one-call decode step where it takes
        the step, else from the model's forward."""
        if self.cpu is not None:
            hidden = self.cpu.forward(input_ids, positions, self.forward_caches, meta)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, self.forward_caches, meta)

    # -- one step -----------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def execute_model_async(self, sched: SchedulerOutput,
                            before_forward: Callable[[], None] | None = None
                            ) -> StepHandle | PooledHandle:
        """Launch a step. The sampled ids stay on the device (the next step reads them from
        there); the returned handle brings them to the host when asked.

        ``before_forward`` runs once the inputs are ready, just before the forward (not at all
        for an empty step)."""
        if self._modes_thread == threading.get_ident():
            return self._launch_step(sched, before_forward)
        with self.step_modes():
            return self._launch_step(sched, before_forward)

    @contextlib.contextmanager
    def step_modes(self) -> Iterator[None]:
        """Hold the thread modes a step runs under, inference mode and (on the CPU) flushed
        denormals, for a run of steps on this thread. A step outside it enters and leaves
        them itself, a cost worth saving on the CPU, where the forward leaves the caches
        cold."""
        if self._modes_thread == threading.get_ident():
            yield  # already held further up
            return
        flush = denormals_flushed() if self.device == "cpu" else contextlib.nullcontext()
        with torch.inference_mode(), flush:
            self._modes_thread = threading.get_ident()
            try:
                yield
            finally:
                self._modes_thread = None

    def _launch_step(self, sched: SchedulerOutput, before_forward: Callable[[], None] | None
                     ) -> StepHandle | PooledHandle | DraftedHandle:
        self._last_step_at = time.monotonic()
        if self._upgrades is not None:
            upgraded = self._upgrades.poll()
            if upgraded is not None:
                self._swap_in(upgraded)
        self.batch.update(sched)
        drafted = None if self.drafter is None else self.drafter.note(self.batch, sched)
        handle = self._launch_target(sched, before_forward)  # the draft runs after it
        return handle if drafted is None else drafted.after(handle, self.step_modes)

    def _launch_target(self, sched: SchedulerOutput,
                       before_forward: Callable[[], None] | None) -> StepHandle | PooledHandle:
        prof = self.profiler
        self.start_kv_copies(sched)  # on their own thread, while the inputs are prepared
        if sched.is_empty:
            return StepHandle(self.batch, [], [], None)
        prompt_rows = plan_prompt_rows(self.batch, sched)  # before the inputs advance it
        pool_plan = self.pooler.plan(self.batch, sched) if self.pooler is not None else None
        inputs = self._prepare_inputs(sched)
        prof.lap("prepare_inputs")
        if before_forward is not None:
            before_forward()  # laps its own phase
        self.finish_kv_copies()  # the blocks the forward reads and overwrites: copied
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(inputs.meta):
            hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self._watched_forward(inputs)
        if not self.stage.is_last:  # the activations went on; the worker takes the tokens
            return StepHandle(self.batch, [], [], None)
        if pool_plan is not None:
            prof.lap("forward")
            return self.pooler.pool(pool_plan, hidden, self._to_device, self.model)
        prompt_scores = (None if prompt_rows is None else
                         score_prompt_rows(prompt_rows, hidden, self.model.compute_logits,
                                           self._to_device))
        if not inputs.sampling_states:
            prof.lap("forward")
            return StepHandle(self.batch, [], [], None, prompt_scores)
        if inputs.logits_indices is not None:
            hidden = hidden.index_select(0, inputs.logits_indices)
        logits = self.model.compute_logits(hidden).float()
        prof.lap("forward")
        spec = inputs.spec  # a request's rows: one, or its proposals' too (gpu/spec_step.py)
        row_states = inputs.sampling_states if spec is None else spec.row_states
        meta = build_sampling_metadata(self.batch, row_states,
                                       self.model_config.vocab_size, logits.device,
                                       in_flight=(self._last_sampled, self._last_index))
        row_req_ids = [state.req_id for state in row_states]
        if sched.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, sched.grammar_bitmask, row_req_ids)
        sampled = self.sampler(logits, meta) if spec is None else verify(logits, meta,
                                                                         spec.drafts)
        for state in inputs.sampling_states:
            state.num_pending += 1
        self._last_sampled = sampled.sampled_token_ids
        self._last_index = dict(zip(row_req_ids, range(len(row_req_ids))))
        prof.lap("sample")
        req_ids = row_req_ids if spec is None else [s.req_id for s in inputs.sampling_states]
        return StepHandle(self.batch, inputs.sampling_states, req_ids, sampled, prompt_scores,
                          spec)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        batch_states = self.batch.states
        states = [batch_states[r] for r in sched.num_scheduled_tokens]
        if self._decode_inputs is not None and sched.total_num_scheduled_tokens == len(states):
            return self._prepare_decode(sched, states)
        rows, computed = np.array(
            [[s.row for s in states], [s.num_computed_tokens for s in states]],
            dtype=np.int64).reshape(2, len(states))
        layout = TokenLayout.of(sched, computed)
        cu, positions, seq_lens = layout.cu, layout.positions, layout.seq_lens
        seq_lens_cpu = seq_lens.tolist()
        spec = sched.scheduled_spec_decode_tokens
        if spec:
            write_drafts(self.batch, states, spec)
        sampling, in_flight = advance(states, seq_lens_cpu, spec)
        token_rows = layout.per_token(rows)
        input_ids = self.batch.token_ids[token_rows, positions]
        bs = self.block_size
        slots = (self.batch.block_table[token_rows, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        max_seq = max(seq_lens_cpu)
        longest = decode_turn(spec, rows_as_decode(self.device, self.cuda_graphs,
                                                   sched.total_num_scheduled_tokens))
        seen = AttentionRows.of_step(rows, cu, seq_lens, token_rows, positions,
                                     layout.max_query_len, turn_up_to=longest)
        block_table = self.batch.block_table[seen.rows, : -(-max_seq // bs)]
        to_dev = self._to_device
        input_ids_dev = to_dev(input_ids)
        if in_flight:
            fill_in_flight(input_ids_dev, layout, states, self._last_sampled, self._last_index,
                           to_dev)
        num_tokens = sched.total_num_scheduled_tokens
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=to_dev(seen.cu.astype(np.int32)),
            seq_lens=to_dev(seen.seq_lens.astype(np.int32)),
            block_table=to_dev(np.ascontiguousarray(block_table)),
            slot_mapping=to_dev(slots),
            max_query_len=seen.max_query_len,
            max_seq_len=max_seq,
            query_start_loc_cpu=seen.cu.tolist(),
            seq_lens_cpu=seen.seq_lens.tolist(),
        )
        if self.batch.window_block_table is not None:
            window_inputs(meta, self.batch.window_block_table, seen.rows, token_rows, positions,
                          bs, to_dev)
        if spec:  # each sampling request's proposals and its last token give logits
            indices, rows = spec_rows([states[i] for i in sampling],
                                      cu[1:][np.asarray(sampling, dtype=np.int64)] - 1, spec,
                                      self.device, views=self.batch.num_needing_metadata > 0)
            return StepInputs(input_ids_dev, to_dev(positions), meta, to_dev(indices),
                              [states[i] for i in sampling], rows)
        every_token_samples = len(sampling) == num_tokens  # then every request does, in order
        return StepInputs(
            input_ids=input_ids_dev,
            positions=to_dev(positions),
            meta=meta,
            logits_indices=(None if every_token_samples
                            else to_dev(cu[1:][np.asarray(sampling, dtype=np.int64)] - 1)),
            sampling_states=states if every_token_samples else [states[i] for i in sampling],
        )

    def _prepare_decode(self, sched: SchedulerOutput,
                        states: list[CachedRequestState]) -> StepInputs:
        """``_prepare_inputs`` for a step of one token per request, its arrays built by the
        CPU kernels' ``decode_inputs`` in one call."""
        computed = [s.num_computed_tokens for s in states]
        seq_lens_cpu = [c + 1 for c in computed]
        sampling, in_flight = advance(states, seq_lens_cpu)
        max_seq = max(seq_lens_cpu)
        assert self._decode_inputs is not None
        input_ids, positions, slots, seq_lens, cu, block_table = self._decode_inputs(
            [s.row for s in states], computed, self._token_ids_cpu, self._block_table_cpu,
            self.block_size, -(-max_seq // self.block_size))
        if in_flight:
            layout = TokenLayout.of(sched, np.asarray(computed, dtype=np.int64))
            fill_in_flight(input_ids, layout, states, self._last_sampled, self._last_index,
                           self._to_device)
        n = len(states)
        meta = AttentionMetadata(
            num_actual_tokens=n, query_start_loc=cu, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=slots, max_query_len=1, max_seq_len=max_seq,
            query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens_cpu)
        if self.batch.window_block_table is not None:
            window_decode_inputs(meta, self.batch, states, computed, self._decode_inputs,
                                 self.block_size)
        every_request_samples = len(sampling) == n
        return StepInputs(
            input_ids=input_ids, positions=positions, meta=meta,
            logits_indices=(None if every_request_samples  # request i's token is row i
                            else torch.tensor(sampling, dtype=torch.long)),
            sampling_states=states if every_request_samples else [states[i] for i in sampling],
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without a sync: staged in pinned memory and copied
        with ``non_blocking`` (the caching host allocator holds the staging buffer until the
        copy has run)."""
        tensor = torch.from_numpy(array)
        if self.device == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

