"""The model runner's KV cache: how many blocks fit (a CPU's budget, or on a GPU what a
profiling forward at the largest token batch leaves), their allocation, and the decode
steps' CUDA graphs captured over them. A part of ``ModelRunner``, kept apart so that each
part reads on its own."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from tidal.core.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from tidal.core.host_tier import KVCopies
from tidal.core.kv_window import WindowGroup, window_group_for
from tidal.core.scheduler_output import SchedulerOutput
from tidal.gpu.attention import AttentionBackend, AttentionMetadata, kv_quant
from tidal.gpu.cuda_graphs import CudaGraphRunner, graph_rows
from tidal.gpu.draft_runner import DraftRunner
from tidal.gpu.kv_copier import KVCopier
from tidal.gpu.kv_disk_tier import KVDiskTier, manifest
from tidal.gpu.kv_host_tier import KVHostTier
from tidal.gpu.model_config import ModelConfig

logger = logging.getLogger(__name__)


class KVCacheSetup:
    config: EngineConfig
    shard_config: ModelConfig  # this rank's heads
    model_config: ModelConfig
    device: str
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    max_blocks_per_req: int
    model: torch.nn.Module
    kv_caches: list[tuple[torch.Tensor, ...]]
    host_tier: KVHostTier | None = None  # --kv-offload-size's blocks (--kv-offload-path's)
    kv_copier: KVCopier | None = None  # their copies, on a thread (and stream) of their own
    pooler: Any  # gpu/pooler.py's Pooler for a pooling runner, else None
    cuda_graphs: CudaGraphRunner | None
    backend: AttentionBackend  # the runner's property: the running model's
    run_model: Callable[..., torch.Tensor]
    drafter: DraftRunner | None  # draft_model's: its layers' KV shares the block ids

    # -- KV cache -----------------------------------------------------------------------
    @property
    def kv_cache_quantized(self) -> bool:
        return kv_quant.is_quantized(self.config.kv_cache_dtype)

    def determine_num_blocks(self) -> int:
        # an int8 cache's scales count: a float32 per token, KV head and K or V
        cfg = self.shard_config
        per_token = (cfg.kv_bytes_per_token(1, kv_quant.SCALE_BYTES) if self.kv_cache_quantized
                     else cfg.kv_bytes_per_token(self.dtype.itemsize))
        if self.device == "cpu":
            budget = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        else:
            budget = self._free_gpu_memory_for_kv()
        draft = 0
        if self.drafter is not None:  # each block in the draft's layers too, and its scratch
            draft = self.drafter.bytes_per_token(self.kv_cache_quantized)
            per_token += draft
            budget -= self.drafter.num_scratch * self.block_size * draft
        per_block = self.block_size * per_token
        num_blocks = budget // per_block
        group, windows = self.window_group, self.model_config.layer_windows()
        if group is not None:  # the sliding layers' blocks are a pool apart
            per_layer = self.block_size * (per_token - draft) // len(windows)
            window_block = per_layer * sum(1 for w in windows if w)
            num_blocks = group.full_blocks(budget, per_block - window_block, window_block)
        if num_blocks < 1:
            hint = ("raise kv_cache_memory" if self.device == "cpu" or self.config.kv_cache_memory
                    else "free GPU memory (other engines or processes hold it), raise "
                         "gpu_memory_utilization or set kv_cache_memory")
            raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of "
                             f"{per_block} bytes; {hint}")
        return int(num_blocks)

    def _free_gpu_memory_for_kv(self) -> int:
        if self.config.kv_cache_memory:
            return self.config.kv_cache_memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_run()
        torch.cuda.empty_cache()  # the profile's activations count once, in peak_extra
        free, total = torch.cuda.mem_get_info()
        used = total - free  # by every process on the device, this one's weights included
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = int(total * self.config.gpu_memory_utilization) - used - peak_extra
        logger.info("GPU memory: %.2f of %.2f GiB in use, %.2f GiB of activations at peak; "
                    "%.2f GiB for the KV cache", used / 2**30, total / 2**30,
                    peak_extra / 2**30, max(0, budget) / 2**30)
        return max(0, budget)

    def profile_run(self) -> None:
        """A forward at the largest token batch, to measure peak activation memory."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.allocate_kv_cache(-(-n // self.block_size), capture=False)
        cu, lens = [0, n], [n]
        num_blocks = -(-n // self.block_size)
        meta = AttentionMetadata(
            num_actual_tokens=n,
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_table=torch.arange(num_blocks, dtype=torch.int32,
                                     device=self.device)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=self.device),
            max_query_len=n, max_seq_len=n, query_start_loc_cpu=cu, seq_lens_cpu=lens)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(n, device=self.device), self.kv_caches, meta)
            if self.model.stage.is_last:  # a stage before it passed its activations on
                self.model.compute_logits(hidden[: self._max_logits_rows()]).float()
        self.kv_caches = []

    def _max_logits_rows(self) -> int:
        """The most rows a step computes logits for: one per sequence, and with speculative
        decoding one per proposal too."""
        spec = self.config.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0  # type: ignore[union-attr]
        return self.config.max_num_seqs * (1 + k)

    @functools.cached_property
    def window_group(self) -> WindowGroup | None:
        """The sliding-window layers' block group, where they keep one (core/kv_window.py)."""
        return window_group_for(self.config, self.model_config.layer_windows(),
                                self.max_model_len)

    def allocate_kv_cache(self, num_blocks: int, capture: bool = True) -> None:
        """Every layer's cache: ``num_blocks`` blocks, a sliding-window layer's its group's
        pool (the profiling run, ``capture`` False, gives every layer the same blocks)."""
        cfg, group = self.shard_config, self.window_group
        sliding = (self.model_config.layer_windows() if group is not None and capture
                   else (0,) * cfg.num_layers)
        window_blocks = group.pool_blocks(num_blocks) if group is not None else num_blocks
        dtype = torch.int8 if self.kv_cache_quantized else self.dtype
        self.kv_caches = [
            kv_quant.allocate_layer((window_blocks if window else num_blocks, self.block_size,
                                     cfg.num_kv_heads, cfg.head_dim), dtype, self.device)
            for window in sliding]
        if capture and self.drafter is not None:
            self.drafter.allocate(num_blocks, self.kv_cache_quantized)
        if capture:  # the cache steps run on, not the profiling run's: its tiers too
            self._allocate_tiers()
            self._capture_cuda_graphs()

    def _allocate_tiers(self) -> None:
        """The second tier's host blocks (``--kv-offload-size``), its disk file
        (``--kv-offload-path``) and their copy thread."""
        if self.kv_copier is not None:
            self.kv_copier.shutdown()
        self.host_tier, self.kv_copier = None, None
        config, caches = self.config, self.kv_caches
        host_blocks = KVHostTier.blocks_for(config.kv_offload_size, caches)
        if not host_blocks:
            return
        self.host_tier = KVHostTier(host_blocks, caches)
        disk_blocks = KVDiskTier.blocks_for(config.kv_offload_disk_size, caches)
        if config.kv_offload_path and disk_blocks:
            meta = manifest(config.model, config.tokenizer or config.model, self.dtype,
                            self.block_size, caches, self.tp.rank, self.tp.size)
            self.host_tier.disk = KVDiskTier(config.kv_offload_path, disk_blocks, caches, meta)
        self.kv_copier = KVCopier(self.host_tier, caches[0][0].device)

    def start_kv_copies(self, sched: SchedulerOutput) -> None:
        """Start a step's tier copies on the copy thread (``gpu/kv_copier.py``)."""
        if sched.kv_copies and self.kv_copier is not None:
            self.kv_copier.submit(sched.kv_copies, self.kv_caches)

    def finish_kv_copies(self) -> None:
        """Make the forward wait for them: it reads the blocks copied in, and overwrites
        those copied out. On a GPU its stream waits for the copy stream's; on the CPU each
        layer waits for its own copies (``forward_caches``)."""
        if self.kv_copier is not None and self.kv_copier.gate is None:
            self.kv_copier.wait_issued()

    @property
    def forward_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """The caches the forward reads (``KVCopier.forward_caches``)."""
        copier = self.kv_copier
        return self.kv_caches if copier is None else copier.forward_caches(self.kv_caches)

    def apply_kv_copies(self, copies: KVCopies) -> None:
        """Run tier copies outside a step, to the end."""
        if self.kv_copier is not None:
            self.kv_copier.submit(copies, self.kv_caches)
            self.kv_copier.wait()

    def close_kv_tiers(self) -> None:
        """Let the copies end and hand the disk file's rows to the OS."""
        if self.kv_copier is not None:
            self.kv_copier.shutdown()

    def disk_index(self) -> tuple[int, dict[int, bytes]]:
        """The disk tier's slots and the block hash each filled one holds (none: (0, {}))."""
        disk = self.host_tier.disk if self.host_tier is not None else None
        return (disk.num_blocks, disk.index()) if disk is not None else (0, {})

    def _capture_cuda_graphs(self) -> None:
        """Decode-step CUDA graphs over the allocated cache: on the GPU with the Triton
        backend (the torch one reads lengths on the host), unless ``enforce_eager``; not under
        tensor or pipeline parallelism, whose collectives are not captured, nor for MoE models
        or a pooling runner. A draft model captures its own beside them."""
        if (self.device == "cpu" or self.config.enforce_eager or self.tp.world_size > 1
                or self.pooler is not None):  # a pooling runner never decodes
            return
        if self.model_config.num_experts:  # gpu/moe.py's paths are not yet checked under capture
            logger.info("a mixture-of-experts model runs its decode steps without CUDA graphs")
            return
        if self.backend.name != "triton":
            logger.warning("CUDA graphs need the triton attention backend; running eagerly")
            return
        config = self.config
        rows = graph_rows(config.max_num_seqs, self._max_logits_rows() // config.max_num_seqs,
                          config.max_num_batched_tokens)
        self.cuda_graphs = CudaGraphRunner(self.run_model, rows, self.max_blocks_per_req,
                                           self.max_model_len, self.device,
                                           self.window_group is not None)
        self.cuda_graphs.capture()
        if self.drafter is not None:
            self.drafter.capture_cuda_graphs()
