"""The one-call C++ decode step (``gpu/cpu/decode_stack.py``): built where it applies, bitwise the
Python model's hidden states on ragged paged batches, and left out of every other step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tidal.gpu.attention import AttentionMetadata, get_attention_backend
from tidal.gpu.attention.paged_layout import paged_layout, random_caches
from tidal.gpu.cpu.decode_stack import runs_on_stack
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadedModel, LoadOptions, load_model
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")

BLOCK = 16
CONTEXTS = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 3, 97, 200]


def _load(path, dtype=torch.float32, backend: str = "cpu",
          quantization: str | None = None) -> LoadedModel:
    return load_model(path, ModelConfig.from_dir(path),
                      LoadOptions(get_attention_backend(backend, "cpu"), 512, dtype, "cpu",
                                  quantization=quantization))


# qwen2: a biased qkv projection; qwen3: per-head query and key norms
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                           hidden_size=128, head_dim=32)  # which the decode kernel takes


def _step(loaded: LoadedModel, query_lens: list[int], seed: int,
          dtype: torch.dtype = torch.float32, contexts: list[int] = CONTEXTS):
    cfg = loaded.model.config
    meta = paged_layout(contexts, query_lens, BLOCK, seed=seed)
    torch.manual_seed(seed)
    caches = [random_caches(meta, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype)
              for _ in range(cfg.num_layers)]
    ids = torch.randint(0, cfg.vocab_size, (meta.num_actual_tokens,))
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(contexts, query_lens)])
    return ids, positions, caches, meta


def _run(loaded: LoadedModel, stack, ids, positions, caches, meta) -> torch.Tensor:
    """A step as the runner runs it: on ``stack`` (None: no stack) where it takes the step,
    else through the model's layers."""
    cpu = replace(loaded.cpu, stack=stack)
    with torch.inference_mode():
        hidden = cpu.forward(ids, positions, caches, meta)
        return hidden if hidden is not None else loaded.model(ids, positions, caches, meta)


def _forward(loaded: LoadedModel, stack, ids, positions, caches, meta) -> torch.Tensor:
    """``_run`` on copies of ``caches``."""
    copies = [tuple(c.clone() for c in kv) for kv in caches]
    return _run(loaded, stack, ids, positions, copies, meta)


class Counted:
    """A stack that records its calls."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


# bfloat16 linears are packed for oneDNN where it has a bfloat16 path, else run torch's own:
# the stack takes either, as its linears are the model's PlannedLinears.
STACK_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", STACK_DTYPES)
def test_decode_step_is_bitwise_the_python_model(model_dir, dtype):
    loaded = _load(model_dir, dtype)
    assert loaded.cpu.stack is not None
    stack = Counted(loaded.cpu.stack)
    for seed in range(3):
        ids, positions, caches, meta = _step(loaded, [1] * len(CONTEXTS), seed, dtype)
        python = _forward(loaded, None, ids, positions, caches, meta)
        ours = _forward(loaded, stack, ids, positions, caches, meta)
        assert stack.calls == seed + 1
        assert torch.equal(ours, python)


# Qwen3-MoE: experts in every layer but one (a dense MLP), q/k norms; Mixtral: top-2 of 8
@pytest.mark.parametrize("dtype", STACK_DTYPES)
@pytest.mark.parametrize("arch,method", [("qwen3_moe", "int4"), ("mixtral", "int8")])
def test_quantized_experts_decode_in_the_one_call_step(arch, method, dtype, tmp_path):
    """A model of quantized experts decodes on the stack, bitwise the Python model, at many
    rows (the grouped experts) and at one (a lone row's experts together)."""
    path = build_model_dir(tmp_path / arch, arch, hidden_size=128, head_dim=32)
    loaded = _load(path, dtype, quantization=method)
    assert loaded.cpu.stack is not None
    stack = Counted(loaded.cpu.stack)
    for seed, contexts in enumerate([CONTEXTS, [37], CONTEXTS[:3]]):
        ids, positions, caches, meta = _step(loaded, [1] * len(contexts), seed, dtype, contexts)
        python = _forward(loaded, None, ids, positions, caches, meta)
        ours = _forward(loaded, stack, ids, positions, caches, meta)
        assert stack.calls == seed + 1
        assert torch.equal(ours, python)


@pytest.mark.parametrize("dtype", STACK_DTYPES)
def test_the_stack_writes_the_step_keys_and_values(model_dir, dtype):
    loaded = _load(model_dir, dtype)
    ids, positions, caches, meta = _step(loaded, [1] * len(CONTEXTS), seed=4, dtype=dtype)
    written = {}
    for name, stack in (("python", None), ("stack", loaded.cpu.stack)):
        copies = [(k.clone(), v.clone()) for k, v in caches]
        _run(loaded, stack, ids, positions, copies, meta)
        written[name] = copies
    for (k1, v1), (k2, v2), (k0, _) in zip(written["python"], written["stack"], caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert not torch.equal(k2, k0)  # the step's keys did land in the cache


def _one_token_rows(ids, positions, table, caches, loaded) -> torch.Tensor:
    """The Python model over rows that are each a request of one token (row i over
    ``table``'s row i), as a draft's catch-up and guesses run."""
    n = len(ids)
    seq_lens = positions + 1
    slots = table[torch.arange(n), positions // BLOCK].long() * BLOCK + positions % BLOCK
    meta = AttentionMetadata(
        num_actual_tokens=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=seq_lens.int(), block_table=table, slot_mapping=slots, max_query_len=1,
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens.tolist())
    with torch.inference_mode():
        return loaded.model(ids, positions, caches, meta)


@pytest.mark.parametrize("dtype", STACK_DTYPES)
def test_propose_is_the_python_models_greedy_loop(model_dir, dtype):
    """``DecodeStack.propose`` (a draft's catch-up rows, then its guesses, in one call) gives
    the guesses and writes the cache of the Python model's forwards, head and torch's argmax
    run one after another."""
    loaded = _load(model_dir, dtype)
    cfg, steps = loaded.model.config, 4
    meta = paged_layout([40, 3, 70], [1, 1, 1], BLOCK, seed=7)
    table = torch.cat([meta.block_table, torch.arange(3 * 2, dtype=torch.int32).view(3, 2)
                       + int(meta.block_table.max()) + 1], dim=1)  # room for the guesses
    torch.manual_seed(7)
    caches = [random_caches(replace(meta, block_table=table), BLOCK, cfg.num_kv_heads,
                            cfg.head_dim, dtype) for _ in range(cfg.num_layers)]
    row_requests = torch.tensor([0, 0, 0, 1, 2, 2])  # catch-ups of 3, 1 and 2 rows
    positions = torch.tensor([38, 39, 40, 3, 69, 70])
    ids = torch.randint(0, cfg.vocab_size, (6,))
    guessing, last_rows = torch.tensor([0, 2]), torch.tensor([2, 5])  # request 1 only catches up
    ours = [tuple(c.clone() for c in kv) for kv in caches]
    got = loaded.cpu.stack.propose(
        ids, positions, [c for kv in ours for c in kv], table, row_requests, guessing, last_rows,
        loaded.model.lm_head.kernel, steps, BLOCK)
    hidden = _one_token_rows(ids, positions, table[row_requests], caches, loaded)
    want, pos = [], positions[last_rows]
    while True:
        with torch.inference_mode():
            want.append(loaded.model.compute_logits(hidden[-len(guessing):] if want
                                                    else hidden[last_rows]).argmax(dim=-1))
        if len(want) == steps:  # the last guess is not run
            break
        pos = pos + 1
        hidden = _one_token_rows(want[-1], pos, table[guessing], caches, loaded)
    assert torch.equal(got, torch.stack(want, dim=1))
    for kv, kv0 in zip(ours, caches):
        assert all(torch.equal(c, c0) for c, c0 in zip(kv, kv0))


def test_prefill_and_padded_steps_take_the_python_path(model_dir):
    loaded = _load(model_dir)
    ids, positions, caches, meta = _step(loaded, [1, 3] + [1] * (len(CONTEXTS) - 2), seed=5)
    assert not runs_on_stack(ids, meta, loaded.cpu.stack_rows)

    class Refuses:
        def forward(self, *args):
            raise AssertionError("a prefill chunk reached the decode stack")

    _forward(loaded, Refuses(), ids, positions, caches, meta)
    decode_meta = paged_layout(CONTEXTS, [1] * len(CONTEXTS), BLOCK, seed=6, pad_rows=2)
    padded_ids = torch.zeros(decode_meta.num_actual_tokens + 2, dtype=torch.long)
    assert not runs_on_stack(padded_ids, decode_meta, loaded.cpu.stack_rows)
    decode_meta = paged_layout(CONTEXTS, [1] * len(CONTEXTS), BLOCK, seed=6)
    decode_ids = torch.zeros(decode_meta.num_actual_tokens, dtype=torch.long)
    assert runs_on_stack(decode_ids, decode_meta, loaded.cpu.stack_rows)
    rows = len(CONTEXTS)
    # a row count whose ops the plans give to torch keeps the Python path
    assert not runs_on_stack(decode_ids, decode_meta, [True] * rows + [False])
    assert runs_on_stack(decode_ids, decode_meta, [False] * rows + [True])


def test_not_built_where_it_does_not_apply(model_dir, tmp_path):
    assert _load(model_dir, dtype=torch.float16).cpu is None  # linears not packed
    assert _load(model_dir, backend="torch").cpu.stack is None
    narrow_heads = build_model_dir(tmp_path / "hd16", "llama")  # head_dim 16: no kernel
    assert _load(narrow_heads).cpu.stack is None
    experts = build_model_dir(tmp_path / "moe", "qwen3_moe", hidden_size=128, head_dim=32)
    assert _load(experts).cpu.stack is None
