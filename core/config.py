"""Engine configuration: what to load and how big the batch and the KV cache may be."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.core.speculative_config import SpeculativeConfig, parse_speculative_config

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB
DEFAULT_KV_OFFLOAD_DISK_SIZE = 16 << 30  # with --kv-offload-path and no --kv-offload-disk-size
# Tokens per step when none is given. A CPU step costs about the same per token from a few
# hundred tokens up (its matmuls are compute-bound by then), so a larger budget only lengthens
# the step every running stream waits on: 2,048 stalled the short chats beside 2,000-token
# prompts for half a second. Between 128 and 256 (docs/scheduler.md, "The token budget on a
# CPU"), 192 cut the median TTFT of 32 streams of short prompts by about a sixth against 256,
# where 128 made 512-token prompts at the same concurrency wait 2.5x longer for their first
# token.
DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS = 192
DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS = 2048
# Offline (``LLM``) no stream waits on a step, so on a CPU the budget only trades the number of
# steps against the size of their matmuls. On the benchmark Llama's offline workload (256 prompts
# of 64-256 tokens, 128 sequences a step; output tok/s, paired runs): 192 tokens 1,474, 384
# 1,558, 512 1,615-1,638, 1,024 1,604-1,642, 2,048 1,562-1,584, 4,096 1,529.
DEFAULT_CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS = 1024
# The model that ships inside the package (a small Llama trained on Tiny Shakespeare by
# gpu/training/train_default.py): served when no model is named.
DEFAULT_MODEL: str = str(Path(__file__).resolve().parent / "default_model")
EXECUTOR_BACKENDS = ("mp", "uni", "ray")  # distributed_executor_backend's values
QUANTIZATIONS = ("int8", "int4")  # quantization's values (None: the checkpoint's weights)
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8")  # kv_cache_dtype's values
DEFAULT_MODEL_NAME = "tidal-shakespeare"  # the id the server lists for it


SCHEDULING_POLICIES = ("fcfs", "priority")
RUNNERS = ("generate", "pooling")  # runner's values (core/pooling.py)


@dataclass
class EngineConfig:
    model: str  # a Hugging Face model directory, or a GGUF file
    tokenizer: str | None = None  # a tokenizer directory; None: the model's (a GGUF's metadata)
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on GPU), "float32", "bfloat16", ...
    device: str = "cpu"  # "cpu" or "cuda"
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: 192 on CPU, 2048 on GPU
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes of KV cache; None: 1 GiB on CPU
    # bytes of host memory for the KV cache's second tier (core/host_tier.py); 0: none
    kv_offload_size: int = 0
    # a directory for the second tier's disk part, which takes the blocks the host part
    # evicts and outlives the process (gpu/kv_disk_tier.py), and its bytes; None: no disk
    kv_offload_path: str | None = None
    kv_offload_disk_size: int | None = None  # None: DEFAULT_KV_OFFLOAD_DISK_SIZE with a path
    # "auto" (the model's dtype) or "int8" (8-bit values, a float32 scale per token and KV
    # head: gpu/attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # GPU: no CUDA graphs
    async_scheduling: bool | None = None  # schedule step N+1 while N runs; None: on GPU only
    attention_backend: str = "auto"  # "auto", "cpu", "torch" or "triton"
    # CPU: "auto" (each op's fastest on this host, timed), "force" (tidal's kernels) or "off"
    # (torch's own paths); None: the TIDAL_CPU_KERNELS environment variable, else "auto"
    cpu_kernels: str | None = None
    # Weight-only quantization of the decoder layers' linears at load: None, "int8" (one scale
    # per output channel) or "int4" (groups of ``quantization_group_size`` inputs)
    quantization: str | None = None
    quantization_group_size: int = 32
    seed: int = 0
    # Tensor parallelism: a worker process per rank (torch.distributed: gloo on CPU, NCCL on
    # GPU), ``nnodes`` machines of ``world_size // nnodes`` ranks each, meeting at
    # ``distributed_init_method`` (``tcp://HEAD:PORT``; None: a free port on this machine)
    tensor_parallel_size: int = 1
    # Pipeline parallelism: the layers split into this many stages in turn, each stage a
    # tensor-parallel group; world = tensor_parallel_size x pipeline_parallel_size processes
    pipeline_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # "mp": the model in worker processes, one per rank (a world of one too); "uni": in this
    # process; "ray": in Ray actors, one per rank (gpu/ray_executor.py); None: "mp" where
    # tensor_parallel_size > 1, else "uni"
    distributed_executor_backend: str | None = None
    offline: bool = False  # driven by ``LLM``: nothing streams, so a CPU takes a larger budget
    # Grammar compiles (docs/robustness.md): threads compiling at once, seconds one may run
    # (None: no limit), and bytes the compiled-grammar cache may hold
    grammar_compile_workers: int = 4
    grammar_compile_timeout: float | None = 15.0
    grammar_cache_bytes: int = 256 << 20
    # "fcfs" (first come, first served, clients in turn) or "priority" (each request's
    # ``priority``, the lowest first; a request preempts running ones it outranks)
    scheduling_policy: str = "fcfs"
    # Speculative decoding (docs/speculative-decoding.md): vLLM's shape, as a dict, its JSON
    # text or a SpeculativeConfig; None: off. With async scheduling, each step speculates
    # only where measured to pay (core/spec_mode.py).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # "generate" (text) or "pooling" (embeddings: each request one prefill, pooled;
    # core/pooling.py), vLLM's ``--runner``
    runner: str = "generate"

    def _check_offload(self) -> None:
        if self.kv_offload_path is None:
            self.kv_offload_disk_size = 0
            return
        if self.kv_offload_size <= 0:
            raise ValueError("kv_offload_path spills the host tier's evictions to disk: give "
                             "the host tier some memory too (kv_offload_size)")
        if self.kv_offload_disk_size is None:
            self.kv_offload_disk_size = DEFAULT_KV_OFFLOAD_DISK_SIZE
        if self.kv_offload_disk_size <= 0:
            raise ValueError("kv_offload_disk_size must be a positive byte count, "
                             f"got {self.kv_offload_disk_size}")

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if not (is_gguf_file(self.model) or (Path(self.model) / "config.json").is_file()):
            raise ValueError(f"model must be a Hugging Face model directory with a config.json "
                             f"or a .gguf file; {self.model!r} is neither")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"tokenizer must be a directory; {self.tokenizer!r} is none")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            if self.async_scheduling:
                raise ValueError("speculative method draft_model runs without async "
                                 "scheduling (its proposals follow each step's tokens); drop "
                                 "async_scheduling or choose ngram or suffix")
            self.async_scheduling = False
        if self.async_scheduling is None:
            self.async_scheduling = self.device != "cpu"
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self._default_budget()
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size", "pipeline_parallel_size", "nnodes",
                     "grammar_compile_workers", "grammar_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive byte count, "
                             f"got {self.kv_cache_memory}")
        self._check_offload()
        if self.grammar_compile_timeout is not None and not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be a positive number of seconds, "
                             f"got {self.grammar_compile_timeout}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError("quantization_group_size must be one of "
                             f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}, "
                             f"got {self.quantization_group_size!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        self._check_distributed()

    def _check_distributed(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError("distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}, got {backend!r}")
        if backend == "ray":
            self._check_ray()
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if backend == "uni" and getattr(self, name) > 1:
                raise ValueError(f"distributed_executor_backend 'uni' runs one rank; {name} "
                                 f"is {getattr(self, name)}")
        if self.world_size % self.nnodes:
            what = ("tensor_parallel_size" if self.pipeline_parallel_size == 1
                    else "tensor_parallel_size x pipeline_parallel_size")
            raise ValueError(f"{what} {self.world_size} must be a multiple of nnodes "
                             f"{self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.distributed_init_method:
            raise ValueError("distributed_init_method (tcp://HEAD:PORT) is needed to run on "
                             "several nodes")
        method = self.distributed_init_method
        if method is not None and not method.startswith(("tcp://", "env://", "file://")):
            raise ValueError("distributed_init_method must be a tcp://HOST:PORT, env:// or "
                             f"file:// URL, got {method!r}")

    def _check_ray(self) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray, an optional "
                             "dependency: pip install 'tidal[ray]'")
        if self.nnodes > 1:
            raise ValueError("with distributed_executor_backend 'ray', Ray places the ranks on "
                             "its nodes: drop nnodes (and node_rank)")

    @property
    def world_size(self) -> int:
        """Worker processes in all: every pipeline stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _default_budget(self) -> int:
        if self.device != "cpu":
            return DEFAULT_GPU_MAX_NUM_BATCHED_TOKENS
        return (DEFAULT_CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS if self.offline
                else DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS)


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (llama.cpp's format), served as a model of its own."""
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer ``--tokenizer`` names, else the model's: a directory's files, or the one
    transformers builds from a GGUF file's metadata (vocabulary, merges or scores, special
    tokens and chat template)."""
    from transformers import AutoTokenizer

    if config.tokenizer is not None:
        return AutoTokenizer.from_pretrained(config.tokenizer)
    if is_gguf_file(config.model):
        path = Path(config.model).resolve()
        try:
            return _gguf_tokenizer(path)
        except Exception as exc:  # noqa: BLE001 - the parser's KeyError/IndexError on bad bytes
            detail = (f"its metadata lacks tokenizer.ggml.{exc.args[0]}"
                      if isinstance(exc, KeyError) and exc.args else f"{type(exc).__name__}: "
                      f"{exc}")
            raise ValueError(f"{config.model}: no tokenizer could be read from this GGUF file "
                             f"(damaged or truncated, or without tokenizer.ggml.* metadata: "
                             f"{detail}); --tokenizer DIR names one to use instead") from None
    return AutoTokenizer.from_pretrained(config.model)


def _gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of a GGUF file. ``AutoTokenizer`` reads the whole model config
    first, which fails on some architectures' metadata (gpt-oss's YaRN keys in transformers
    5); the generic fast tokenizer reads the tokenizer's metadata alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except TypeError:  # that config bug's; a damaged file's ValueError is the caller's to name
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
