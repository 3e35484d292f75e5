"""tidal's quantized linear kernel (``gpu/cpu/csrc/quant_linear.cpp``) against ``F.linear`` over
the dequantized weight, for every format it takes, at row counts across its tiles and chunks;
the C++ dispatch (``PlannedLinear`` over a ``QuantPack``) against the Python one; and the
one-call decode step of a quantized model against the Python model and torch's own path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.core import LLM, SamplingParams
from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.selector import KERNELS, TORCH, Plan
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model
from tidal.gpu.quantization.linear import ATEN, QuantLinear, candidate_methods, pack_for_kernel
from tidal.gpu.quantization.weights import QuantizedWeight, quantize_int4, quantize_int8
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")

K = 256
ROWS = [1, 2, 3, 4, 5, 7, 17, 63, 64, 65, 70]


def _random(bits: int, group: int, n: int, offsets: bool, seed: int = 0) -> QuantizedWeight:
    """Random values and scales of a format (int8 with groups, as GGUF's Q8_0 and Q6_K give)."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (n, K), generator=gen).to(torch.int8)
    else:
        q = torch.randint(0, 16, (n, K), generator=gen).to(torch.uint8)
    scales = torch.rand(n, K // group, generator=gen) * 0.02 + 1e-3
    off = torch.randn(n, K // group, generator=gen) * 0.05 if offsets else None
    return QuantizedWeight(bits, group, q, scales, off)


def _weight(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, K, generator=torch.Generator().manual_seed(seed)) * K ** -0.5


FORMATS = {
    "int8": lambda n: quantize_int8(_weight(n)),
    "int8g32": lambda n: _random(8, 32, n, offsets=False),
    "int8g16": lambda n: _random(8, 16, n, offsets=False),
    "int8g32-offsets": lambda n: _random(8, 32, n, offsets=True),
    "int4g32": lambda n: quantize_int4(_weight(n), 32),
    "int4g64": lambda n: quantize_int4(_weight(n), 64),
    "int4g128": lambda n: quantize_int4(_weight(n), 128),
    "int4g32-symmetric": lambda n: _random(4, 32, n, offsets=False),
}


def _fits(qw: QuantizedWeight) -> bool:
    return load_cpu_kernels().quant_linear_supports(qw.bits, qw.group_size, K)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("out_features", [37, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_matches_the_dequantized_linear(fmt, out_features, bias):
    qw = FORMATS[fmt](out_features)
    if not _fits(qw):
        pytest.skip("this build's blocks are wider than the format's groups")
    assert KERNELS in candidate_methods(qw, torch.device("cpu"))
    b = torch.randn(out_features) if bias else None
    layer = QuantLinear(qw, b, plan=Plan.always(KERNELS))
    weight = qw.dequantize()
    for rows in ROWS:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        ref = F.linear(x, weight, b)
        scale = ref.abs().max().item()
        torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4 * scale,
                                   msg=f"{fmt}, {rows} rows")


def test_every_format_of_the_issue_fits_this_build():
    """int4 in groups of 32 fits AVX-512's 32-value blocks and AVX2's 16; int8 groups of 16
    (GGUF's Q6_K) fit a 16-float register's blocks."""
    for fmt, make in FORMATS.items():
        assert _fits(make(8)), fmt


def test_the_pack_puts_each_value_where_the_kernel_reads_it():
    lanes, rows = load_cpu_kernels().quant_linear_tile()
    qw = _random(4, 2 * lanes, 3, offsets=True)
    packed, params = pack_for_kernel(qw, lanes, rows)
    items = -(-3 // rows)
    assert packed.numel() == items * rows * K // 2
    first = packed[:lanes]  # item 0, k-block 0, output row 0
    assert torch.equal(first & 15, qw.q[0, :lanes])
    assert torch.equal(first >> 4, qw.q[0, lanes:2 * lanes])
    assert torch.equal(params[:rows][:3], qw.scales[:, 0][:rows])
    assert torch.equal(params[rows:rows + min(rows, 3)], qw.offsets[:min(rows, 3), 0])


@pytest.mark.parametrize("fmt", ["int8", "int4g32", "int4g128"])
def test_the_cpp_dispatch_gives_the_python_paths_results(fmt):
    """QuantLinear runs through its C++ PlannedLinear; each method there gives exactly what
    the Python path (QuantPacks.run) gives."""
    qw = FORMATS[fmt](96)
    bias = torch.randn(96)
    for method in candidate_methods(qw, torch.device("cpu")):
        layer = QuantLinear(qw, bias, plan=Plan.always(method))
        assert layer.kernel is not None
        for rows in (1, 5, 33):
            x = torch.randn(rows, K)
            assert torch.equal(layer(x), layer.packs.run(method, x, layer.bias)), method


def test_a_plan_by_rows_reaches_the_cpp_dispatch():
    qw = quantize_int4(_weight(96), 32)
    layer = QuantLinear(qw, plan=Plan((2, 8), (KERNELS, ATEN)))
    assert [layer.kernel.method(r) for r in (1, 2, 3, 100)] == [4, 4, 5, 5]
    layer = QuantLinear(qw, plan=Plan((1,), (TORCH,)))
    x = torch.randn(3, K)
    assert torch.equal(layer(x), F.linear(x, qw.dequantize()))


def test_bfloat16_activations_are_widened_for_the_kernel():
    qw = quantize_int4(_weight(96), 32)
    assert KERNELS in candidate_methods(qw, torch.device("cpu"), torch.bfloat16)
    bias = torch.randn(96)
    layer = QuantLinear(qw, bias, torch.bfloat16, Plan.always(KERNELS))
    x = torch.randn(5, K).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    wide = F.linear(x.float(), qw.dequantize(), bias.to(torch.bfloat16).float())
    torch.testing.assert_close(y, wide.to(torch.bfloat16), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("llama"), "llama", hidden_size=128)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_models_decode_step_is_the_python_models(model_dir, quantization):
    from tests.unit.gpu.test_decode_stack import CONTEXTS, _forward, _step

    loaded = load_model(model_dir, ModelConfig.from_dir(model_dir), LoadOptions(
        get_attention_backend("cpu", "cpu"), 512, torch.float32, "cpu",
        quantization=quantization))
    assert loaded.cpu.stack is not None
    for seed in range(2):
        ids, positions, caches, meta = _step(loaded, [1] * len(CONTEXTS), seed)
        python = _forward(loaded, None, ids, positions, caches, meta)
        stack = _forward(loaded, loaded.cpu.stack, ids, positions, caches, meta)
        assert torch.equal(stack, python)


def _generate(model_dir, cpu_kernels: str) -> list:
    try:
        llm = LLM(str(model_dir), dtype="float32", quantization="int4", cpu_kernels=cpu_kernels,
                  max_model_len=256)
        cpu = llm.engine.executor.runner.cpu
        assert (cpu.stack is not None) == (cpu_kernels != "off")
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
        outs = llm.generate(["hello there", "a b c d e f", "the kernels"], params,
                            use_tqdm=False)
    finally:
        selector.set_mode(None)  # the engine set the process's mode
    return [o.outputs[0] for o in outs]


def test_an_int4_model_generates_as_on_torchs_path(model_dir):
    ours, torchs = _generate(model_dir, "force"), _generate(model_dir, "off")
    for a, b in zip(ours, torchs):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            for token, value in step_b.items():
                assert step_a[token] == pytest.approx(value, abs=1e-4)


def test_kernels_off_leaves_torchs_paths_and_no_cpp_dispatch():
    qw = quantize_int4(_weight(96), 32)
    selector.set_mode("off")
    try:
        assert KERNELS not in candidate_methods(qw, torch.device("cpu"))
        layer = QuantLinear(qw)
        assert layer.kernel is None and layer.plan.used() == {ATEN}
        x = torch.randn(3, K)
        torch.testing.assert_close(layer(x), F.linear(x, qw.dequantize()), rtol=1e-4, atol=1e-4)
    finally:
        selector.set_mode(None)
