"""The disk part of the KV cache's second tier (``--kv-offload-path``; the bookkeeping is
``core/host_tier.py``): one file of fixed-size rows, memory-mapped, a row per disk slot. A row
is the slot's header, the 32-byte prefix-cache hash of the block it holds (zeros: empty), then
the block's bytes, every tensor of every layer as the host tier holds them.

A row is written header cleared, bytes, then header set, so a row whose header is set holds
that block whole, and a server started again reads the headers to know which prefixes it has
(no fsync per block: the page cache keeps them across a restart of the process, a crash of
the machine may lose the last ones, never mix them up). The file sits in a directory named
for a manifest of what the bytes mean (the checkpoint's files, the tokenizer, dtype, block
size, KV shapes, rank): another model, or the same one changed, gets its own directory and
never reads this one's blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

HASH_BYTES = 32  # core/block_pool.py's SHA-256 digests
FORMAT = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "special_tokens_map.json")

LayerCache = tuple[torch.Tensor, ...]


def checkpoint_digest(model: str) -> str:
    """A digest of the checkpoint's weight and config files: names, sizes and mtimes (reading
    every weight would take as long as loading them)."""
    path = Path(model)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES) or p.name == "config.json")
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def tokenizer_digest(tokenizer_dir: str) -> str:
    """A digest of the tokenizer files' contents (small); a GGUF file's, its name and size."""
    path = Path(tokenizer_dir)
    h = hashlib.sha256()
    if path.is_file():
        h.update(f"{path.name}:{path.stat().st_size}".encode())
        return h.hexdigest()
    for name in _TOKENIZER_FILES:
        if (path / name).is_file():
            h.update(name.encode())
            h.update((path / name).read_bytes())
    return h.hexdigest()


def manifest(model: str, tokenizer: str, dtype: torch.dtype, block_size: int,
             caches: list[LayerCache], rank: int, world: int) -> dict[str, object]:
    """What a disk tier's bytes mean; a tier is reused only under an equal manifest."""
    return {"format": FORMAT, "checkpoint": checkpoint_digest(model),
            "tokenizer": tokenizer_digest(tokenizer), "dtype": str(dtype),
            "block_size": block_size, "rank": rank, "world_size": world,
            "kv_shapes": [[[*t.shape[1:]], str(t.dtype)] for t in caches[0]],
            "num_layers": len(caches)}


class KVDiskTier:
    def __init__(self, root: str, num_blocks: int, caches: list[LayerCache],
                 meta: dict[str, object]) -> None:
        text = json.dumps(meta, sort_keys=True)
        self.dir = Path(root).expanduser() / hashlib.sha256(text.encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.num_blocks = num_blocks
        self._sizes = [t[0].numel() * t.element_size() for layer in caches for t in layer]
        self.row_bytes = HASH_BYTES + sum(self._sizes)
        data = self.dir / "blocks.bin"
        trusted = self._manifest_matches(text)
        if not trusted and data.exists():
            logger.warning("KV disk tier %s: its manifest does not match; starting empty",
                           self.dir)
            data.unlink()
        with open(data, "ab") as f:  # created if missing; resized to this run's slots
            f.truncate(num_blocks * self.row_bytes)
        (self.dir / "manifest.json").write_text(text)
        self.rows = np.memmap(data, dtype=np.uint8, mode="r+",
                              shape=(num_blocks, self.row_bytes))

    @staticmethod
    def blocks_for(size_bytes: int, caches: list[LayerCache]) -> int:
        per_block = HASH_BYTES + sum(t[0].numel() * t.element_size()
                                     for layer in caches for t in layer)
        return size_bytes // per_block

    def _manifest_matches(self, text: str) -> bool:
        path = self.dir / "manifest.json"
        return path.exists() and path.read_text() == text

    def index(self) -> dict[int, bytes]:
        """The block hash each filled slot holds (a restart's prefixes)."""
        headers = self.rows[:, :HASH_BYTES]
        filled = np.flatnonzero(headers.any(axis=1))
        return {int(s): bytes(headers[s]) for s in filled}

    def clear(self) -> None:
        self.rows[:, :HASH_BYTES] = 0

    def write(self, slots: list[int], block_hashes: list[bytes], caches: list[LayerCache],
              indices: list[int]) -> None:
        """Write blocks ``indices`` of ``caches`` (the host tier's, or the device's) into disk
        slots ``slots``, all at once: per tensor one gather of the blocks, then the rows."""
        if not slots:
            return
        rows = np.asarray(slots, dtype=np.int64)
        index = torch.as_tensor(indices, dtype=torch.int64, device=caches[0][0].device)
        parts = [t.index_select(0, index).to("cpu").reshape(len(slots), -1).view(torch.uint8)
                 for layer in caches for t in layer]
        self.rows[rows, :HASH_BYTES] = 0  # cleared, so a row cut short reads as empty
        self.rows[rows, HASH_BYTES:] = torch.cat(parts, dim=1).numpy()
        self.rows[rows, :HASH_BYTES] = np.frombuffer(b"".join(block_hashes), dtype=np.uint8
                                                     ).reshape(len(slots), HASH_BYTES)

    def read(self, slots: list[int], caches: list[LayerCache], indices: list[int]) -> None:
        """Copy disk slots ``slots``' blocks into blocks ``indices`` of ``caches`` (the host
        tier's, or the device's), all at once: one read of the rows, then per tensor one
        scatter."""
        if not slots:
            return
        rows = torch.from_numpy(self.rows[np.asarray(slots, dtype=np.int64)])
        on = caches[0][0].device
        index = torch.as_tensor(indices, dtype=torch.int64, device=on)
        at = HASH_BYTES
        for layer in caches:
            for t in layer:
                n = t[0].numel() * t.element_size()
                blocks = rows[:, at:at + n].contiguous().view(t.dtype).view(-1, *t.shape[1:])
                t.index_copy_(0, index, blocks.to(on, non_blocking=False))
                at += n

    def flush(self) -> None:
        """Hand the written rows to the OS (no fsync: see the module's docstring)."""
        self.rows.flush()
