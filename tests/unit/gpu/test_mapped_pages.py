"""A mapped checkpoint's pages let go once read (``gpu/checkpoints/mapped_pages.py``): out of
the resident set, the data unchanged; never memory of the process's own."""

from __future__ import annotations

import platform

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.gpu.checkpoints import safetensors_files
from tidal.gpu.checkpoints.mapped_pages import MappedPages
from tidal.gpu.quantization import head as head_module
from tidal.gpu.quantization.experts import quantize_experts_on_read
from tidal.gpu.quantization.head import quantize_head
from tidal.gpu.quantization.weights import quantize_int8

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="Linux's madvise and smaps")
MB = 1 << 20


def _file_resident() -> int:
    """This process's resident bytes of mapped files (``RssFile``)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


def _mapped(tmp_path, rows: int = 16384, cols: int = 1024) -> tuple[torch.Tensor, object]:
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    save_file({"w": weight.bfloat16()}, str(tmp_path / "w.safetensors"))
    f = safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    return f.get_tensor("w"), f


def test_read_pages_are_let_go_and_read_back_the_same(tmp_path):
    t, f = _mapped(tmp_path)  # 32 MB of bfloat16
    want = t.float().sum()  # every page read: resident
    before = _file_resident()
    dropped = MappedPages().let_go(t)
    assert dropped >= t.numel() * 2 - 2 * 4096
    assert _file_resident() <= before - 24 * MB
    assert torch.equal(t.float().sum(), want)  # faulted back from the file, unchanged
    del f


def test_memory_of_its_own_is_never_let_go(tmp_path):
    t, f = _mapped(tmp_path)
    own = t.clone()  # anonymous memory: let go, it would read as zeros
    assert MappedPages().let_go(own) == 0 and torch.equal(own, t)
    t[0, 0] = 7.0  # a private page written to: let go, the write would be undone
    assert MappedPages().let_go(t) == 0
    assert t[0, 0] == 7.0
    del f


def test_quantizing_a_mapped_head_lets_its_pages_go(tmp_path, monkeypatch):
    """The rows are the quantizer's own, chunk by chunk, and the head's pages do not stay
    resident: at most one chunk's at a time."""
    t, f = _mapped(tmp_path)
    monkeypatch.setattr(head_module, "QUANTIZE_ROWS", 2048)  # 4 MB a chunk
    before = _file_resident()
    got = quantize_head(t)
    assert _file_resident() <= before + 8 * MB  # not the head's 32 MB
    want = quantize_int8(t)
    assert torch.equal(got.q, want.q) and torch.equal(got.scales, want.scales)
    del f


def test_a_checkpoint_read_in_order_holds_little_of_its_file_resident(tmp_path, monkeypatch):
    """``iter_safetensors`` lets the pages of the weights it handed out go every
    ``LET_GO_BYTES``: a load that reads each weight holds a few of them resident, not the
    whole file; a weight kept as read still reads the file's values."""
    g = torch.Generator().manual_seed(1)
    weights = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(12)}  # 4 MB each
    save_file(weights, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(safetensors_files, "LET_GO_BYTES", 8 * MB)
    before, most, kept = _file_resident(), 0, None
    for name, tensor in safetensors_files.iter_safetensors(tmp_path):
        assert torch.equal(tensor, weights[name])  # read whole: every page resident
        most = max(most, _file_resident() - before)
        kept = tensor if name == "w0" else kept
    assert most <= 16 * MB  # not the file's 48 MB
    assert torch.equal(kept, weights["w0"])


def test_stacked_experts_quantized_on_read_let_each_experts_pages_go(tmp_path):
    """A fused checkpoint's experts (one tensor a layer) quantized expert by expert: each
    expert's pages go once it is read, so the layer's tensor is never resident whole."""
    stacked = torch.randn(16, 512, 1024, generator=torch.Generator().manual_seed(2))
    save_file({"e": stacked.bfloat16()}, str(tmp_path / "e.safetensors"))
    f = safe_open(str(tmp_path / "e.safetensors"), framework="pt")
    value = f.get_tensor("e")  # 16 MB of bfloat16
    before, most = _file_resident(), 0
    parts = quantize_experts_on_read("model.layers.0.mlp.experts.down_proj", value, "int8", 32)
    for e, (name, weight) in enumerate(parts):
        assert name == f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        assert torch.equal(weight.q, quantize_int8(value[e]).q)
        most = max(most, _file_resident() - before)
    assert most <= 6 * MB  # not the layer's 16 MB
    del f
