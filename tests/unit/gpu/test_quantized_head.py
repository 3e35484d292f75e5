"""A tied output head under ``--quantization`` (``gpu/quantization/head.py``): one int8 weight
that the embedding and the head both read, kept once where the model keeps one layout per
weight, bitwise the same through the one-call decode step as through the Python model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from tidal.gpu import model_loader as loader_module
from tidal.gpu.attention import get_attention_backend
from tidal.gpu.attention.paged_layout import paged_layout, random_caches
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.selector import KERNELS, TORCH, Plan, PlanCache
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model, read_model
from tidal.gpu.quantization import head as head_module
from tidal.gpu.quantization.head import (
    PLAIN_ROW_METHODS,
    QuantEmbedding,
    QuantHead,
    plan_head,
    quantize_head,
)
from tidal.gpu.quantization.linear import (
    DOT,
    TIMED_MAX_OUT_FEATURES,
    candidate_methods,
    round_activations,
)
from tidal.gpu.quantization.weights import quantize_int8
from tidal.gpu.random_model import build_model_dir


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tied"), "qwen2", hidden_size=128,
                           tie_word_embeddings=True)


def _read(path, dtype=torch.bfloat16, quantization="int4"):
    return read_model(path, ModelConfig.from_dir(path), LoadOptions(
        get_attention_backend("cpu", "cpu"), 512, dtype, "cpu", quantization=quantization))


def _byte_storages(model: torch.nn.Module) -> dict[int, int]:
    """Every tensor of bytes (int8, uint8: quantized values) the model's modules hold, packs
    included: storage address -> bytes."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_mkldnn:
            if t.element_size() == 1:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(t, (tuple, list)):
            for x in t:
                add(x)
        elif t is not None and hasattr(t, "q") and hasattr(t, "scales"):  # QuantizedWeight
            add((t.q, t.scales, t.offsets))

    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            add(t)
        add(getattr(module, "weight_format", None))
        packs = getattr(module, "packs", None)
        if packs is not None:
            for name in ("tidal", "aten", "dot", "format", "panels", "mkl", "onednn", "plain"):
                add(getattr(packs, name, None))
    return seen


def test_quantize_head_is_int8_per_row_in_chunks(monkeypatch):
    w = torch.randn(300, 64)
    monkeypatch.setattr("tidal.gpu.quantization.head.QUANTIZE_ROWS", 128)
    got, ref = quantize_head(w), quantize_int8(w)
    assert torch.equal(got.q, ref.q) and torch.equal(got.scales, ref.scales)
    assert quantize_head(ref) is ref  # already int8 per row: kept as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_dequantized_rows(dtype):
    w = quantize_int8(torch.randn(50, 32))
    embedding = QuantEmbedding(w, dtype)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(embedding(ids), w.dequantize(dtype)[ids])
    assert embedding.stage(ids) is None  # no table staged
    table = embedding.stage_table(4)
    assert torch.equal(table[embedding.stage(ids)], w.dequantize(dtype)[ids])
    assert embedding.stage(torch.arange(5)) is None  # more rows than the table holds


def test_a_tied_quantized_model_reads_one_int8_weight(tied_dir):
    model = _read(tied_dir)
    head, embedding = model.lm_head, model.embed_tokens
    assert isinstance(head, QuantHead) and isinstance(embedding, QuantEmbedding)
    assert head.weight_format is embedding.weight_format
    assert head.weight_format.q.dtype == torch.int8 and head.weight_format.per_channel
    names = {name for name, _ in model.named_parameters()}
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    ref = F.linear(x.float(), head.weight_format.dequantize()).to(torch.bfloat16)
    torch.testing.assert_close(head(x), ref, atol=2e-2, rtol=2e-2)


def test_an_untied_embedding_is_int8_rows_of_its_own_and_float_models_keep_theirs(tied_dir,
                                                                                   tmp_path):
    """Under --quantization an untied model's head and embedding are each int8 per row, the
    checkpoint's own rows quantized (a quarter of float32's bytes, half of bfloat16's); the
    lookup gives those rows dequantized, bitwise."""
    untied = build_model_dir(tmp_path, "qwen2", hidden_size=128)
    model = _read(untied)
    assert isinstance(model.lm_head, QuantHead)
    embed = model.embed_tokens
    assert isinstance(embed, QuantEmbedding)
    assert embed.weight_format is not model.lm_head.weight_format
    with safe_open(str(untied / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    want = quantize_int8(table)
    assert torch.equal(embed.weight_format.q, want.q)
    assert torch.equal(embed.weight_format.scales, want.scales)
    ids = torch.tensor([0, 5, 7, table.shape[0] - 1])
    assert torch.equal(embed(ids), want.dequantize(torch.bfloat16)[ids])
    assert embed.weight_format.nbytes < table.numel() * 2 * 0.52  # vs bfloat16's bytes
    assert isinstance(_read(untied, quantization=None).embed_tokens, torch.nn.Embedding)
    assert isinstance(_read(tied_dir, quantization=None).lm_head, torch.nn.Linear)


def test_an_upgrade_takes_the_int8_rows_of_the_model_it_replaces(tied_dir, tmp_path):
    """A model read again for its timed plans (``LoadOptions.reuse``) holds the serving
    model's int8 embedding and head, not a second copy of them."""
    for path in (build_model_dir(tmp_path, "qwen2", hidden_size=128), tied_dir):
        first = _read(path)
        second = read_model(path, ModelConfig.from_dir(path), LoadOptions(
            get_attention_backend("cpu", "cpu"), 512, torch.bfloat16, "cpu",
            quantization="int4", reuse=first))
        assert second.lm_head.weight_format is first.lm_head.weight_format
        assert second.embed_tokens.weight_format is first.embed_tokens.weight_format


def test_an_upgrade_borrows_the_packed_untied_head_it_replaces(tmp_path, monkeypatch):
    """An untied head planned onto packed layouts lets its int8 rows go, so the model read
    again for its timed plans cannot take them: it borrows the packed layouts instead
    (``QuantHead.borrowing``), quantizing only a sample of rows to time on, never the whole
    head again; its logits are the first model's, bit for bit."""
    path = build_model_dir(tmp_path, "qwen2", hidden_size=128)
    cfg = ModelConfig.from_dir(path)

    def load(reuse=None):
        return load_model(path, cfg, LoadOptions(
            get_attention_backend("cpu", "cpu"), 512, torch.bfloat16, "cpu",
            quantization="int8", reuse=reuse)).model

    first = load()
    lender = first.lm_head
    assert lender.weight_format is None and lender.methods  # packed, rows let go
    quantized_rows = []
    real = head_module.quantize_head
    for module in (head_module, loader_module):
        monkeypatch.setattr(module, "quantize_head",
                            lambda w: quantized_rows.append(w.shape[0]) or real(w))
    second = load(reuse=first).lm_head
    assert second.plan.used() == lender.plan.used()
    for layout in ("tidal", "dot", "aten"):
        assert getattr(second.packs, layout) is getattr(lender.packs, layout)
    assert quantized_rows == [min(cfg.vocab_size, TIMED_MAX_OUT_FEATURES)]  # the sample alone
    assert second.sample is None and second.source is None and second.lent is None
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(second(x.bfloat16()), lender(x.bfloat16()))


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
def test_a_borrowing_head_quantizes_its_rows_for_a_layout_the_lender_lacks():
    """Planned onto a layout its lender has, a borrowing head takes it; onto another, it
    quantizes the whole of its rows and packs them as a head of its own would be."""
    source = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    lender = QuantHead(quantize_head(source), torch.bfloat16, tied=False)
    lender.methods = [KERNELS, DOT, TORCH]
    lender.replan(Plan.always(KERNELS))
    same = QuantHead.borrowing(lender, source, torch.bfloat16)
    same.replan(Plan.always(KERNELS))
    assert same.packs.tidal is lender.packs.tidal and same.weight_format is None
    other = QuantHead.borrowing(lender, source, torch.bfloat16)
    other.replan(Plan.always(DOT))
    alone = QuantHead(quantize_head(source), torch.bfloat16, tied=False)
    alone.replan(Plan.always(DOT))
    assert other.packs.tidal is None
    assert all(torch.equal(a, b) for a, b in zip(other.packs.dot, alone.packs.dot))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(other(x), alone(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_layout_keeps_one_copy_of_the_head_weight(tied_dir, tmp_path, monkeypatch, dtype):
    """Over the byte bound, a bfloat16 head runs from the plain rows the embedding reads: the
    model holds the head's int8 values once. float32 activations keep the kernel's layout
    beside them (torch's int8 op has no fast float32 path), at most twice."""
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "auto")
    model = _read(tied_dir, dtype)
    head = model.lm_head
    cache = PlanCache(tmp_path, key={"host": "test"})
    plans = plan_head(model, 8, cache, two_layouts_max_bytes=0)
    assert len(plans) == 1 and len(head.plan.used()) == 1
    vocab, hidden = head.weight_format.shape
    copies = sum(1 for nbytes in _byte_storages(model).values() if nbytes >= vocab * hidden)
    if dtype == torch.bfloat16:
        assert head.plan.used() <= set(PLAIN_ROW_METHODS)
        assert copies == 1
    else:
        assert copies <= 2
    x = torch.randn(5, hidden, dtype=dtype)
    w = head.weight_format
    if head.plan.used() == {DOT}:  # the dot kernel multiplies the rounded rows
        ref = F.linear(round_activations(x).float(), w.float16_params().dequantize())
    else:
        ref = F.linear(x.float(), w.dequantize())
    torch.testing.assert_close(head(x), ref.to(dtype), atol=2e-2, rtol=2e-2)



@pytest.mark.parametrize("fastest", [DOT, TORCH])
def test_an_untied_head_over_the_bound_takes_any_method_and_keeps_its_layout_alone(
        tmp_path, monkeypatch, fastest):
    """An untied head shares no rows with the embedding: over the byte bound in bfloat16 it
    times every method, and keeps the plain weight only where its plan runs torch's path."""
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "auto")
    model = _read(build_model_dir(tmp_path / "m", "qwen2", hidden_size=128))
    head = model.lm_head
    assert isinstance(head, QuantHead) and not head.tied
    w = head.weight_format
    methods = candidate_methods(w, w.q.device, torch.bfloat16)
    if fastest not in methods:
        pytest.skip(f"{fastest} does not run here")
    x = torch.randn(5, w.shape[1], dtype=torch.bfloat16)
    want = F.linear((round_activations(x) if fastest == DOT else x).float(),
                    (w.float16_params() if fastest == DOT else w).dequantize())
    cache = PlanCache(tmp_path, key={"host": "test"},
                      timer=lambda name, fn, calls: (fn(), 1.0 if name == fastest else 2.0)[1])
    (name,) = plan_head(model, 8, cache, two_layouts_max_bytes=0)
    assert name.endswith("|" + ",".join(methods) + " (head)")  # every one was timed
    assert head.plan.used() == {fastest}
    assert (head.weight_format is None) == (fastest != TORCH)
    torch.testing.assert_close(head(x), want.to(torch.bfloat16), atol=2e-2, rtol=2e-2)

def test_a_small_model_times_every_method_for_its_head(tied_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "auto")
    model = _read(tied_dir)
    fast = {TORCH: 1.0}
    cache = PlanCache(tmp_path, key={"host": "test"},
                      timer=lambda name, fn, calls: (fn(), fast.get(name, 2.0))[1])
    (name,) = plan_head(model, 8, cache)
    w = model.lm_head.weight_format
    methods = candidate_methods(w, w.q.device, torch.bfloat16)
    assert name.endswith("|" + ",".join(methods) + " (head)")  # every one was timed
    assert model.lm_head.plan.used() == {TORCH}


@pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_through_the_staged_table_is_bitwise_the_python_model(tied_dir, dtype):
    path = tied_dir
    model, cpu = load_model(path, ModelConfig.from_dir(path), LoadOptions(
        get_attention_backend("cpu", "cpu"), 512, dtype, "cpu", quantization="int4"))
    stack = cpu.stack
    assert stack is not None and isinstance(model.embed_tokens, QuantEmbedding)
    cfg = model.config
    contexts = [0, 15, 16, 97]
    meta = paged_layout(contexts, [1] * len(contexts), 16, seed=0)
    caches = [random_caches(meta, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
              for _ in range(cfg.num_layers)]
    ids = torch.randint(0, cfg.vocab_size, (len(contexts),))
    positions = torch.tensor(contexts)
    calls = []
    out = {}
    for name, on in (("python", None), ("stack", Counted(stack, calls))):
        step = replace(cpu, stack=on, stack_rows=[True] * 8)
        copies = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode():
            hidden = step.forward(ids, positions, copies, meta)
            out[name] = model(ids, positions, copies, meta) if hidden is None else hidden
    assert len(calls) == 1
    assert torch.equal(out["stack"], out["python"])


class Counted:
    def __init__(self, stack, calls: list) -> None:
        self.stack, self.calls = stack, calls

    def forward(self, *args):
        self.calls.append(args[0])
        return self.stack.forward(*args)
