"""The output head under ``--quantization``: int8 with one scale per vocabulary row, which a
tied model's token embedding reads too; an untied embedding is int8 per row as well, in its own
weight (a vocabulary-wide table is a large share of a MoE model's resident bytes).

At batch 1 every decode step reads the whole head, and a small model's float32 head is a large
share of the step's bytes; int8 is a quarter of them.

A tied head in the model's dtype costs its bytes twice on the CPU: once as the embedding's
plain rows, once in the packed layout its matmul runs fastest from (``gpu/cpu/packed_linear.py``),
which is a Qwen2.5-3B model's 622 MB of bfloat16 twice. Quantized to int8 per row, the head keeps
one plain copy, a quarter of those bytes: the embedding dequantizes the rows it looks up
(``QuantEmbedding``), and the head multiplies by the same tensor (``QuantHead``).

On the CPU the head's plan is timed as a quantized linear's is (``gpu/quantization/linear.py``),
the dot kernel among the candidates: where it wins, the logits are computed from the final
hidden state rounded to int8 per block of 32 inputs, as llama.cpp's are, within the bounds that
``docs/quantization.md`` states for ``--quantization``.

Where the model keeps one layout per weight (its quantized weights pass
``TWO_LAYOUTS_MAX_BYTES``), a tied head's candidates are the methods that multiply from the plain
rows the embedding reads (torch's int8 op, or torch's path), so no second copy is made; with
float32 activations, where torch's int8 op is an order of magnitude slower than tidal's kernel,
every method stays a candidate and the kernel's layout is kept beside the plain rows. An untied
head (its embedding has rows of its own) takes every method, and keeps only the layout its plan
uses, as a ``QuantLinear`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.gpu.checkpoints.mapped_pages import MappedPages
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.packed_linear import TWO_LAYOUTS_MAX_BYTES
from tidal.gpu.cpu.selector import TORCH, Plan, PlanCache
from tidal.gpu.distributed import tensor_parallel
from tidal.gpu.layers import vocab_parallel_lookup
from tidal.gpu.quantization.linear import (
    ATEN,
    TIMED_MAX_OUT_FEATURES,
    QuantLinear,
    QuantPacks,
    candidate_methods,
    planned_forward,
)
from tidal.gpu.quantization.planner import quant_candidates, untimed_plan
from tidal.gpu.quantization.weights import QuantizedWeight, Weight, quantize_int8

# Methods that multiply from the weight's plain int8 rows, which the embedding reads too
PLAIN_ROW_METHODS = (ATEN, TORCH)
QUANTIZE_ROWS = 8192  # rows quantized at a time, to bound the float temporaries of the load


def quantize_head(weight: torch.Tensor | QuantizedWeight) -> QuantizedWeight:
    """``weight`` (``[vocab, hidden]``) as symmetric int8 with one scale per row, quantized
    ``QUANTIZE_ROWS`` rows at a time (rows are independent, so the result is the same); the
    checkpoint's mapped pages of each are let go once read (``MappedPages``)."""
    if isinstance(weight, QuantizedWeight):
        if weight.bits == 8 and weight.per_channel and weight.offsets is None:
            return weight
        weight = weight.dequantize()
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=weight.device)
    pages = MappedPages()
    for i in range(0, rows, QUANTIZE_ROWS):  # into place: no second copy to concatenate
        part = quantize_int8(weight[i:i + QUANTIZE_ROWS])
        q[i:i + QUANTIZE_ROWS], scales[i:i + QUANTIZE_ROWS] = part.q, part.scales
        pages.let_go(weight[i:i + QUANTIZE_ROWS])
    return QuantizedWeight(8, cols, q, scales)


class QuantEmbedding(nn.Module):
    """Token embedding over an int8 weight with one scale per row: the rows looked up are
    dequantized to ``dtype`` (bitwise ``weight.dequantize(dtype)[ids]``). A tied model's shares
    its weight with the ``QuantHead``; an untied model's has its own (under ``int4`` too: a
    lookup reads a few rows a step, so 4 bits would save memory only, at a coarser grid).
    Under tensor parallelism the weight is this rank's vocabulary rows, looked up as
    ``VocabParallelEmbedding`` looks up its own."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_format = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.tp = tensor_parallel()
        self.table: torch.Tensor | None = None  # the one-call decode step's (stage_table)
        self.table_ids: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(self._rows, input_ids, self.num_embeddings, self.tp)

    def _rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.weight_format
        rows = w.q.index_select(0, input_ids).float() * w.scales.index_select(0, input_ids)
        return rows.to(self.dtype)

    def stage_table(self, rows: int) -> torch.Tensor:
        """A ``[rows, hidden]`` table for the one-call decode step (``csrc/decoder.cpp``),
        which looks its ids up in a float table: ``stage`` fills it with a step's rows."""
        device = self.weight_format.q.device
        self.table = torch.zeros(rows, self.embedding_dim, dtype=self.dtype, device=device)
        self.table_ids = torch.arange(rows, device=device)
        return self.table

    def stage(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's rows written to the staged table, and the ids that find them there
        (``0 .. n-1``); ``None`` where they do not fit."""
        n = input_ids.shape[0]
        if self.table is None or n > self.table.shape[0]:
            return None
        self.table[:n] = self._rows(input_ids)
        return self.table_ids[:n]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


class QuantHead(nn.Module):
    """``logits = x W^T`` over an int8 weight with one scale per row, by the method its plan
    names for the row count. A ``tied`` head never drops the plain weight: its
    ``QuantEmbedding`` reads it. An untied one keeps only the layouts its plan uses."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, tied: bool = True) -> None:
        super().__init__()
        self.weight_format: QuantizedWeight | None = weight
        self.format_nbytes = weight.nbytes  # kept once an untied head's plan drops the weight
        self.tied = tied
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.plan = Plan.always(candidate_methods(weight, weight.q.device, dtype)[0])
        self.methods: list[str] | None = None  # the candidates its plan was chosen among
        self.packs: QuantPacks | None = None
        self.kernel = None  # the C++ PlannedLinear over the packs, where the kernels are built
        # a head borrowing another's layouts (``borrowing``): the checkpoint's rows, quantized
        # only where its plan needs a layout the lender lacks, and a sample to time it on
        self.source: Weight | None = None
        self.sample: QuantizedWeight | None = None
        self.lent: QuantPacks | None = None

    def can_lend(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether a head of ``shape`` and ``dtype`` read again may borrow this one's layouts
        (``borrowing``): it let its rows go for them, and its candidates were found with the
        kernels loaded now (not before they were built)."""
        return (self.weight_format is None and self.packs is not None
                and self.methods is not None and self.packs.kernels is load_cpu_kernels()
                and self.dtype == dtype and (self.out_features, self.in_features) == shape)

    @classmethod
    def borrowing(cls, lender: QuantHead, source: Weight, dtype: torch.dtype) -> QuantHead:
        """An untied head read again beside ``lender`` (the same checkpoint's, whose plan let
        its int8 weight go): timed on a sample of ``source``'s rows among ``lender``'s
        candidates, it takes ``lender``'s packed layouts where its plan uses them and
        quantizes the whole of ``source`` only where it needs another. The upgrade of a
        gpt-oss model neither reads its 1.2 GB head again nor holds its int8 rows twice."""
        rows = min(source.shape[0], TIMED_MAX_OUT_FEATURES)
        sample = quantize_head(source.narrow_rows(0, rows) if isinstance(source, QuantizedWeight)
                               else source[:rows])
        head = cls(sample, dtype, tied=False)
        head.weight_format, head.sample, head.source = None, sample, source
        head.out_features, head.format_nbytes = lender.out_features, lender.format_nbytes
        head.plan, head.methods, head.lent = lender.plan, lender.methods, lender.packs
        return head

    def replan(self, plan: Plan) -> None:
        """Pack for ``plan``: a tied head keeps the plain weight whatever it uses; an untied
        one only where the plan runs torch's path, which dequantizes from it."""
        if self.weight_format is None and self.source is None:
            raise RuntimeError("this head was planned already: its weight's own form is gone")
        self.plan = plan
        packs = self.lent.only(plan.used()) if self.lent is not None else None
        if packs is None:
            if self.weight_format is None:
                self.weight_format = quantize_head(self.source)
            packs = QuantPacks(self.weight_format, plan.used(), self.dtype, self.lent)
        self.packs, self.lent, self.source, self.sample = packs, None, None, None
        if not self.tied and TORCH not in plan.used():
            self.packs.format = self.weight_format = None
        self.kernel = self.packs.kernel(None, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return planned_forward(self, x, None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8, "
                f"{'tied, ' if self.tied else ''}{self.plan.describe()}")


def leave_vocab_unallocated(model: nn.Module) -> None:
    """Give the embedding and output head of a model still on the meta device empty weights,
    so that allocating the model leaves them out: ``--quantization`` replaces both with int8
    rows as read (a tied pair with one weight)."""
    for layer in (model.embed_tokens, model.lm_head):
        if isinstance(layer, (nn.Embedding, nn.Linear)):
            layer.weight = nn.Parameter(torch.empty(0, device="meta"))
    model.tie_weights()


def install_tied_head(model: nn.Module, weight: QuantizedWeight, dtype: torch.dtype) -> None:
    """Make ``weight`` (int8, one scale per row) the model's embedding and output head."""
    model.embed_tokens = QuantEmbedding(weight, dtype)
    model.lm_head = QuantHead(weight, dtype)


def plan_head(model: nn.Module, max_rows: int, cache: PlanCache | None,
              two_layouts_max_bytes: int = TWO_LAYOUTS_MAX_BYTES,
              hints: PlanCache | None = None) -> dict[str, Plan]:
    """Time and set the plan of the model's ``QuantHead``, if it has one (``auto`` with a
    ``cache``; untimed, ``untimed_plan`` from ``hints``; else the first candidate). Call
    before the decoder linears are planned: whether the model keeps one layout per weight
    counts their bytes. Returns the plan by name."""
    head = model.lm_head
    if not isinstance(head, QuantHead):
        return {}
    w = head.weight_format if head.weight_format is not None else head.sample
    assert w is not None, "the head was planned already"
    linears = sum(m.format_nbytes for m in model.modules() if isinstance(m, QuantLinear))
    one_layout = linears + head.format_nbytes > two_layouts_max_bytes
    methods = head.methods or candidate_methods(w, w.q.device, head.dtype)
    if one_layout and head.dtype != torch.float32 and head.tied:
        methods = [m for m in methods if m in PLAIN_ROW_METHODS]
    head.methods = methods
    name = "qlinear {}x{} int8|{}|{}".format(head.out_features, head.in_features,
                                             str(head.dtype).removeprefix("torch."),
                                             ",".join(methods))
    timed = selector.mode() == "auto" and cache is not None and len(methods) > 1
    buckets = selector.row_buckets(max_rows)
    plan = (cache.get_or_choose(name, buckets, quant_candidates(w, head.dtype, methods))
            if timed else untimed_plan(name, methods, buckets, hints,
                                       lambda: quant_candidates(w, head.dtype, methods)))
    if one_layout:
        plan = Plan.always(plan.single())
    head.replan(plan)
    return {name + " (head)": plan}
