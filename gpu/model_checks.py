"""A model's files checked before anything is built from them: the config's numbers against
what the weights hold, and the whole against the memory the machine has.

A config is a claim: ``num_hidden_layers: 1000000`` would have the model built layer by layer
(gigabytes of modules on the meta device alone), ``max_position_embeddings: 2**26`` a rotary
table of 32 GiB. So before any allocation:

- every size is a positive integer in a sane range (``check_config_values``);
- the layers the config names are the layers the weights hold, and the embedding's and each
  linear's shape is the one the config implies, read from the files' headers (a safetensors
  header, a GGUF tensor index): no weight is read (``check_against_checkpoint``);
- the context's position tables fit the memory left beside the weights: a context the model
  claims but the machine cannot hold is clamped with a warning, one ``--max-model-len`` asks
  for is refused (``fit_context``); weights larger than the memory are refused.

Every refusal is a ``ModelFileError`` (a ``ValueError``) naming the file, the field and what was
expected. docs/robustness.md ("Model files") has the reasoning.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.core.config import EngineConfig
    from tidal.gpu.model_config import ModelConfig

logger = logging.getLogger(__name__)

# The ranges a config's sizes must lie in: beyond any model there is, far below what would
# exhaust a machine before the checkpoint check runs.
LIMITS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 12, "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 31,
}
# Of the memory the machine has free, the most the rotary table (its cos and sin, float32)
# may take while it is built, and at most POSITION_TABLE_CAP: beyond this a model's claimed
# context is clamped (1 GiB is 700,000 positions of a 128-wide head).
POSITION_TABLE_SHARE = 1 / 16
POSITION_TABLE_CAP = 1 << 30
_ROTARY_BUILD_PEAK = 4  # tables alive at once while building: angles, cat, cos, sin
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class ModelFileError(ValueError):
    """A model file that is damaged, or that says something its weights or the machine
    cannot back."""


def check_config_values(raw: Mapping[str, Any], source: str) -> None:
    """Each size of a ``config.json`` (or a GGUF's metadata as one) is a positive integer
    within ``LIMITS``; the heads divide as attention needs."""
    for key, limit in LIMITS.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(f"{source}: {key} must be an integer, got {value!r}")
        if not 1 <= value <= limit:
            raise ModelFileError(f"{source}: {key} is {value:,}; expected 1 to {limit:,}")


def check_shape_rules(cfg: ModelConfig, source: str) -> None:
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelFileError(f"{source}: num_attention_heads {cfg.num_heads} is not a multiple "
                             f"of num_key_value_heads {cfg.num_kv_heads}")
    if cfg.head_dim % 2:
        raise ModelFileError(f"{source}: head_dim {cfg.head_dim} is odd; rotary embeddings "
                             "need an even one")


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """What a float checkpoint's weights of ``layer`` (and the embedding) must measure, in
    Hugging Face's names and ``[out, in]`` order."""
    hidden, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, inter = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    p = f"model.layers.{layer}."
    return {
        "model.embed_tokens.weight": (cfg.vocab_size, hidden),
        p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
        p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
        p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
        p + "input_layernorm.weight": (hidden,),
    }


def check_against_checkpoint(model: str | Path, cfg: ModelConfig) -> int:
    """The config against the weights' index (names and shapes, no data); returns the bytes
    the weights take in their files."""
    from tidal.core.config import is_gguf_file

    if is_gguf_file(model):
        shapes, nbytes, source = _gguf_index(Path(model))
        float_shapes = True  # quantized rows too: the index gives the logical shapes
    else:
        shapes, nbytes, source, float_shapes = _safetensors_index(Path(model))
        # a body without its head (``Qwen3Model``: an embedding model) names no ``model.``
        shapes = {n if n.startswith(("model.", "lm_head.")) else f"model.{n}": s
                  for n, s in shapes.items()}
    layers = sorted({int(m.group(1)) for name in shapes if (m := _LAYER_NAME.match(name))})
    if layers != list(range(cfg.num_layers)):
        raise ModelFileError(
            f"{source}: num_hidden_layers is {cfg.num_layers:,}, but the weights hold "
            f"{_describe_layers(layers)}; expected layers 0 to {cfg.num_layers - 1}")
    for name, want in expected_shapes(cfg, 0).items():
        got = shapes.get(name)
        if got is None or (not float_shapes and name.endswith("proj.weight")):
            continue  # absent (the loader names what is missing) or packed by a quantizer
        if tuple(got) != want:
            raise ModelFileError(f"{source}: {name} is {list(got)}, but the config's sizes "
                                 f"(hidden_size {cfg.hidden_size}, heads {cfg.num_heads}/"
                                 f"{cfg.num_kv_heads} of {cfg.head_dim}, intermediate_size "
                                 f"{cfg.intermediate_size}, vocab_size {cfg.vocab_size}) "
                                 f"make it {list(want)}")
    return nbytes


def _describe_layers(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    if layers == list(range(len(layers))):
        return f"{len(layers)} (0 to {layers[-1]})"
    return f"{len(layers)} layers numbered {layers[:4]}{'...' if len(layers) > 4 else ''}"


def _safetensors_index(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], int, str, bool]:
    """Names and shapes from each file's header, the data's bytes, the files' name for
    messages, and whether the linears are plain floats (not packed by a quantizer)."""
    from safetensors import SafetensorError, safe_open

    from tidal.gpu.checkpoints.safetensors_files import safetensors_files

    config = json.loads((model_dir / "config.json").read_text())
    files = safetensors_files(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    nbytes = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: not a readable safetensors file (damaged or "
                                 f"truncated?): {exc}") from None
        nbytes += file.stat().st_size
    source = str(files[0] if len(files) == 1 else model_dir)
    return shapes, nbytes, source, not config.get("quantization_config")


def _gguf_index(path: Path) -> tuple[dict[str, tuple[int, ...]], int, str]:
    from tidal.gpu.checkpoints.gguf_file import hf_name, open_reader

    shapes: dict[str, tuple[int, ...]] = {}
    nbytes = 0
    for tensor in open_reader(str(path)).tensors:
        name = hf_name(tensor.name)
        nbytes += int(tensor.n_bytes)
        if name is not None:
            # GGUF lists dimensions innermost first: [in, out] is Hugging Face's [out, in]
            shapes[name] = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return shapes, nbytes, str(path)


def available_memory() -> int:
    """Bytes this process may still take: the machine's available memory, or what is left
    under its cgroup's limit where that is less."""
    free = _meminfo_available()
    limit = _cgroup_room()
    return min(free, limit) if limit is not None else free


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62  # unknown: no limit from here


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def position_table_bytes(cfg: ModelConfig, positions: int) -> int:
    """Peak bytes of building the rotary cos/sin table for ``positions`` (float32)."""
    return _ROTARY_BUILD_PEAK * positions * cfg.head_dim * 4


def weight_bytes(cfg: ModelConfig, config: EngineConfig, file_bytes: int,
                 itemsize: int) -> int:
    """A lower bound of the memory the weights take once loaded: the file's bytes for a
    GGUF (kept quantized), else the parameters at ``itemsize`` (a quarter byte an int4
    decoder weight, one an int8 one)."""
    from tidal.core.config import is_gguf_file

    if is_gguf_file(config.model):
        return file_bytes
    hidden, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * cfg.intermediate_size
    linear_size = {"int8": 1, "int4": 0.5}.get(config.quantization or "", itemsize)
    embed = cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)
    return int(cfg.num_layers * per_layer * linear_size + embed * itemsize)


def fit_context(config: EngineConfig, cfg: ModelConfig, file_bytes: int, itemsize: int,
                memory: int | None = None) -> int:
    """The context length to serve: ``--max-model-len``, else the model's
    ``max_position_embeddings``, checked against ``memory`` (the machine's available memory):
    weights that do not fit are refused; a claimed context whose position tables would take
    more than ``POSITION_TABLE_SHARE`` of what the weights leave is clamped with a warning
    (one asked for is refused where its tables do not fit at all)."""
    memory = available_memory() if memory is None else memory
    weights = weight_bytes(cfg, config, file_bytes, itemsize) if config.device == "cpu" else 0
    if weights > memory:
        raise ModelFileError(f"{config.model}: its weights take at least {_gib(weights)} once "
                             f"loaded, more than the {_gib(memory)} of memory available")
    room = memory - weights
    if config.max_model_len is not None:
        length = config.max_model_len
        if position_table_bytes(cfg, length) > room:
            raise ModelFileError(
                f"--max-model-len {length:,} needs {_gib(position_table_bytes(cfg, length))} "
                f"of position tables (head_dim {cfg.head_dim}), more than the {_gib(room)} "
                "of memory the weights leave")
        if length > cfg.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                           length, cfg.max_position_embeddings)
        return length
    length = cfg.max_position_embeddings
    budget = min(int(room * POSITION_TABLE_SHARE), POSITION_TABLE_CAP)
    if position_table_bytes(cfg, length) > budget:
        fitted = budget // position_table_bytes(cfg, 1)
        fitted = max(2, fitted - fitted % 1024 if fitted > 1024 else fitted)
        logger.warning(
            "%s: max_position_embeddings %d would need %s of position tables, more than the "
            "%s allowed them (a sixteenth of the %s of memory the weights leave, at most "
            "%s): serving a context of %d tokens (--max-model-len sets it)", config.model,
            length, _gib(position_table_bytes(cfg, length)), _gib(budget), _gib(room),
            _gib(POSITION_TABLE_CAP), fitted)
        return fitted
    return length


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
