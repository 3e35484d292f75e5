"""Float weights from ``model.safetensors`` or the shards its index names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tidal.gpu.checkpoints.mapped_pages import MappedPages

LET_GO_BYTES = 256 << 20  # the checkpoint bytes read between two let-gos


def safetensors_files(model_dir: Path) -> list[Path]:
    """``model.safetensors``, or the shards its index names."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    return [model_dir / file for file in files]


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight as a view of its file's memory map. Once ``LET_GO_BYTES`` of them have
    been handed out and used, their pages are let go (``MappedPages``), so a load holds at
    most about that much of a file resident, not the whole file until it is closed: a tensor
    kept as read (an embedding used in place) reads its pages back from the page cache."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            read: list[torch.Tensor] = []
            nbytes = 0
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor
                read.append(tensor)
                nbytes += tensor.nbytes
                if nbytes >= LET_GO_BYTES:
                    _let_go(read)
                    nbytes = 0
            _let_go(read)


def _let_go(tensors: list[torch.Tensor]) -> None:
    pages = MappedPages()  # the mappings as they are now: none written to since
    for t in tensors:
        pages.let_go(t)
    tensors.clear()
