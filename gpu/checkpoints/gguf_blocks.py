"""GGUF's tensor blocks mapped onto ``QuantizedWeight``'s affine form, kept quantized.

Each quantized GGML type stores a row as blocks of bytes: a float16 scale (and for the K types
6-bit sub-block scales and minimums) beside packed integers. Every type read here is exactly
``q * scale + offset`` per group of inputs, so its integers are unpacked to one value a byte and
its scales multiplied out, never through a float copy of the weight:

- ``Q8_0``: blocks of 32 int8 and a scale ``d`` -> 8 bits, groups of 32, symmetric;
- ``Q4_0``: blocks of 32 4-bit values ``w = d * (q - 8)`` -> 4 bits, groups of 32, offsets
  ``-8 d``;
- ``Q4_K``: super-blocks of 256 in 8 sub-blocks of 32, ``w = d * sc * q - dmin * m`` with
  6-bit ``sc`` and ``m`` -> 4 bits, groups of 32, scales ``d * sc``, offsets ``-dmin * m``;
- ``Q6_K``: super-blocks of 256 in 16 sub-blocks of 16, ``w = d * sc * (q - 32)`` with 6-bit
  ``q`` and int8 ``sc`` -> 8 bits (``q - 32`` fits int8), groups of 16, symmetric;
- ``MXFP4``: blocks of 32 E2M1 codes and an E8M0 exponent ``e`` -> a codebook weight over
  ``MXFP4_CODEBOOK`` (E2M1 doubled, as llama.cpp's ``kvalues_mxfp4``), groups of 32, scales
  ``2 ** (e - 128)``; the one type that is not affine (``weights.py``).

The unpacking is vectorised over all of a tensor's blocks at once (a 3B model has millions),
mirrors ``gguf.quants``' dequantizers bit for bit, and reads the memory-mapped file once.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tidal.gpu.quantization.weights import MXFP4_CODEBOOK, QuantizedWeight

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
QUANTIZED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K, T.MXFP4)
SUPPORTED_TYPES = FLOAT_TYPES + QUANTIZED_TYPES
QK_K = 256  # values in a K-type super-block


def to_weight(name: str, qtype: T, data: np.ndarray) -> torch.Tensor | QuantizedWeight:
    """The tensor ``name`` of GGML type ``qtype`` from its reader array ``data`` (the shape
    outermost first; for quantized types ``[rows, bytes a row]``)."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"GGUF tensor {name!r} is {qtype.name}, a type tidal does not read "
                         f"(it reads {names})")
    if qtype in FLOAT_TYPES:
        return _float_tensor(qtype, data)
    if data.ndim != 2:
        raise ValueError(f"GGUF tensor {name!r} is a quantized {data.ndim}-D tensor; tidal reads "
                         "quantized matrices only")
    return _UNPACK[qtype](np.asarray(data))


def dense_tensor(name: str, qtype: T, data: np.ndarray) -> torch.Tensor:
    """The tensor as floats whatever its type and rank: quantized blocks dequantized."""
    if qtype in FLOAT_TYPES:
        return _float_tensor(qtype, data).float()
    shape = data.shape
    weight = to_weight(name, qtype, np.asarray(data).reshape(-1, shape[-1]))
    assert isinstance(weight, QuantizedWeight)
    return weight.dequantize(torch.float32).reshape(*shape[:-1], -1)


def _float_tensor(qtype: T, data: np.ndarray) -> torch.Tensor:
    if qtype == T.BF16:  # the reader hands bfloat16 as raw bytes
        data = np.ascontiguousarray(data).view(np.int16)
        return _from_numpy(data.reshape(*data.shape[:-1], -1)).view(torch.bfloat16)
    return _from_numpy(data)


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s memory (the memory-mapped file's, read-only: nothing writes
    into it, so torch's warning about that is silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """``[rows, blocks, block_bytes]`` over the same memory."""
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 ``[rows, blocks]``."""
    pair = np.ascontiguousarray(blocks[..., start:start + 2])
    return pair.view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes ``[..., m]`` -> their low nibbles then their high nibbles, ``[..., 2, m]``."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


def _weight(bits: int, group: int, q: np.ndarray, scales: np.ndarray,
            offsets: np.ndarray | None = None) -> QuantizedWeight:
    rows = q.shape[0]
    return QuantizedWeight(bits, group, torch.from_numpy(q.reshape(rows, -1)),
                           torch.from_numpy(scales.reshape(rows, -1)),
                           None if offsets is None else torch.from_numpy(offsets.reshape(rows, -1)))


def unpack_q8_0(raw: np.ndarray) -> QuantizedWeight:
    blocks = _blocks(raw, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return _weight(8, 32, q, _f16(blocks, 0))


def unpack_q4_0(raw: np.ndarray) -> QuantizedWeight:
    blocks = _blocks(raw, 18)
    d = _f16(blocks, 0)
    return _weight(4, 32, _nibbles(blocks[..., 2:]), d, -8 * d)


def unpack_q4_k(raw: np.ndarray) -> QuantizedWeight:
    blocks = _blocks(raw, 144)
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, m = _k_scale_min(blocks[..., 4:16])
    q = _nibbles(blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32))  # sub-blocks 2c, 2c + 1
    return _weight(4, 32, q, d * sc.astype(np.float32), -(dmin * m.astype(np.float32)))


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums -> ``[..., 8]`` each:
    bytes 0-3 hold scales 0-3 (and the top bits of scales 4-7), bytes 4-7 the minimums 0-3
    (and the top bits of minimums 4-7), bytes 8-11 the low nibbles of scales and minimums
    4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def unpack_q6_k(raw: np.ndarray) -> QuantizedWeight:
    blocks = _blocks(raw, 210)
    rows, nb = blocks.shape[:2]
    # Each half of 128 values: the low 4 bits from 64 bytes of ql (low nibbles for values
    # 0-63, high for 64-127), the top 2 bits from 32 bytes of qh (4 shifts, 32 values each).
    ql = _nibbles(blocks[..., :128].reshape(rows, nb, 2, 64)).reshape(rows, nb, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32) >> np.array(
        [0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = ((ql | ((qh & 0x03) << 4)).astype(np.int8) - np.int8(32))
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    return _weight(8, 16, q, _f16(blocks, 208)[..., None] * sc)


def unpack_mxfp4(raw: np.ndarray) -> QuantizedWeight:
    blocks = _blocks(raw, 17)  # the exponent byte, then 16 bytes: codes j and j + 16 each
    rows = blocks.shape[0]
    q = _nibbles(blocks[..., 1:]).reshape(rows, -1)
    scales = np.ldexp(np.float32(1), blocks[..., 0].astype(np.int32) - 128).astype(np.float32)
    return QuantizedWeight(4, 32, torch.from_numpy(q), torch.from_numpy(scales),
                           codebook=torch.tensor(MXFP4_CODEBOOK, dtype=torch.int8))


_UNPACK = {T.Q8_0: unpack_q8_0, T.Q4_0: unpack_q4_0, T.Q4_K: unpack_q4_k, T.Q6_K: unpack_q6_k,
           T.MXFP4: unpack_mxfp4}
