"""Float weights from ``model.safetensors`` or the shards its index names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
