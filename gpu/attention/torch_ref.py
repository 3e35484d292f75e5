"""Reference paged attention in plain torch: the CPU default and the kernels' yardstick.

Decode rows (one query token) of a step are attended in one batched call over their gathered
context; prefill chunks, which may sit on top of prefix-cached blocks or earlier chunks, are
attended one request at a time with a causal mask offset by the cached length. Both go through
torch's fused ``scaled_dot_product_attention``; ``reference_paged_attention`` states the maths
plainly, for tests.

Every backend's ``forward`` also takes a layer's sliding ``window`` (0: none; a row then sees
only the positions after its own minus ``window``) and its attention logits' ``softcap`` (0:
none; each score ``s`` becomes ``softcap * tanh(s / softcap)`` before the softmax), as Gemma 2
and 3 use them, and its attention ``sinks`` (None: none; gpt-oss): a learned logit per query
head that joins each row's softmax denominator (``exp(sink - max)`` is added to the sum) but
takes no value, so a row may give less than all its weight to the keys. Here a window is one
more term of the mask; soft-capped scores and sinks take the plain maths, which torch's fused
attention cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.gpu.attention.kv_quant import dequantize, write_quantized
from tidal.gpu.attention.metadata import AttentionMetadata

Scale = torch.Tensor | None  # an int8 cache's scales [num_blocks, block_size, num_kv_heads]
Sinks = torch.Tensor | None  # a layer's attention sinks [num_heads]: a logit per query head


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: Scale = None, v_scale: Scale = None) -> None:
        if k_scale is not None and v_scale is not None:
            return write_quantized(key, value, key_cache, value_cache, k_scale, v_scale,
                                   slot_mapping)
        n = slot_mapping.shape[0]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid] if not bool(valid.all()) else slot_mapping
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        flat_k.index_copy_(0, slots, key[:n][valid].to(flat_k.dtype))
        flat_v.index_copy_(0, slots, value[:n][valid].to(flat_v.dtype))

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: Scale = None,
                v_scale: Scale = None, window: int = 0, softcap: float = 0.0,
                sinks: Sinks = None) -> torch.Tensor:
        out = torch.empty_like(query)
        # padding rows; every request's rows are written below
        out[meta.query_start_loc_cpu[-1]:].zero_()
        scales = (k_scale, v_scale)
        if meta.decode_requests:
            self._decode(query, key_cache, value_cache, meta, scale, out, scales, window,
                         softcap, sinks)
        if meta.prefill_requests:
            self._prefill(query, key_cache, value_cache, meta, scale, out, scales, window,
                          softcap, sinks)
        return out

    def _prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor,
                 scales: tuple[Scale, Scale] = (None, None), window: int = 0,
                 softcap: float = 0.0, sinks: Sinks = None) -> None:
        """The step's prefill chunks (``meta.prefill_requests``), one request at a time."""
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in meta.prefill_requests:
            start, end = qsl[i], qsl[i + 1]
            k, v = _gather_context(key_cache, value_cache, meta.block_table[i], lens[i], scales)
            out[start:end] = _attend_sdpa(query[start:end], k, v, scale, lens[i] - (end - start),
                                          window, softcap, sinks)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor,
                scales: tuple[Scale, Scale] = (None, None), window: int = 0,
                softcap: float = 0.0, sinks: Sinks = None) -> None:
        """The step's decode rows (``meta.decode_requests``), in one batched call per group
        of rows whose contexts span the same power-of-two number of blocks: every row of a
        call is gathered and attended up to the call's longest context, so one long request
        must not stretch all the short ones (with a 2,000-token request beside 8 short ones,
        that made each decode step ~9x slower)."""
        block_size = key_cache.shape[1]
        groups: dict[int, list[int]] = {}
        for i in meta.decode_requests:
            blocks = -(-meta.seq_lens_cpu[i] // block_size)
            groups.setdefault((blocks - 1).bit_length(), []).append(i)
        for group in groups.values():
            self._decode_group(query, key_cache, value_cache, meta, scale, group, out, scales,
                               window, softcap, sinks)

    @staticmethod
    def _decode_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, rows: list[int],
                      out: torch.Tensor, scales: tuple[Scale, Scale], window: int = 0,
                      softcap: float = 0.0, sinks: Sinks = None) -> None:
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        tokens = torch.tensor([qsl[i] for i in rows], device=query.device)
        ctx = torch.tensor([lens[i] for i in rows], device=query.device)
        block_size = key_cache.shape[1]
        num_blocks = -(-max(lens[i] for i in rows) // block_size)
        table = meta.block_table[rows, :num_blocks].flatten()
        b, kvh, dim = len(rows), key_cache.shape[2], key_cache.shape[3]
        k = _gather_blocks(key_cache, scales[0], table).view(b, -1, kvh, dim).transpose(1, 2)
        v = _gather_blocks(value_cache, scales[1], table).view(b, -1, kvh, dim).transpose(1, 2)
        q = query[tokens].unsqueeze(2)  # [B, H, 1, D]
        pos = torch.arange(k.shape[2], device=query.device)
        mask = pos[None, :] < ctx[:, None]
        if window:
            mask &= pos[None, :] >= ctx[:, None] - window
        o = _masked_attention(q, k.to(q.dtype), v.to(q.dtype), mask[:, None, None, :], scale,
                              softcap, sinks)
        out[tokens] = o.squeeze(2)


def _gather_blocks(cache: torch.Tensor, scale: Scale, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's ``blocks``, dequantized to float32 where it holds int8 with scales: only the
    gathered copy is dequantized, never the whole cache."""
    # index_select copies whole blocks several times faster than advanced indexing
    gathered = cache.index_select(0, blocks)
    if scale is None:
        return gathered
    return dequantize(gathered, scale.index_select(0, blocks))


def _gather_context(key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_row: torch.Tensor, seq_len: int,
                    scales: tuple[Scale, Scale] = (None, None),
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[seq_len, num_kv_heads, head_dim]`` of one request."""
    block_size = key_cache.shape[1]
    blocks = block_row[: -(-seq_len // block_size)]
    k = _gather_blocks(key_cache, scales[0], blocks).flatten(0, 1)[:seq_len]
    v = _gather_blocks(value_cache, scales[1], blocks).flatten(0, 1)[:seq_len]
    return k, v


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 num_cached: int, window: int = 0, softcap: float = 0.0,
                 sinks: Sinks = None) -> torch.Tensor:
    """``_attend`` through torch's fused attention (several times faster on the CPU).

    The inputs get a batch dimension: on the CPU only 4-D inputs reach the flash kernel (3-D
    ones fall back to the unfused maths, ~5x slower), and a prompt with nothing cached takes
    the plain causal kernel, without a mask (twice faster again).
    """
    length = q.shape[0]
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k.to(q.dtype), v.to(q.dtype)))
    if num_cached == 0 and not window and not softcap and sinks is None:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    mask = _visible(length, k.shape[0], num_cached, window, q.device)
    return _masked_attention(q4, k4, v4, mask, scale, softcap, sinks)[0].transpose(0, 1)


def _visible(length: int, context: int, num_cached: int, window: int,
             device: torch.device) -> torch.Tensor:
    """``[length, context]``: which keys each of the last ``length`` query positions sees
    (causal, and within ``window`` where one is given)."""
    q_pos = torch.arange(length, device=device)[:, None] + num_cached
    k_pos = torch.arange(context, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window else mask


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float, sinks: Sinks = None) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, L, D]`` over ``k``/``v`` ``[B, KVH, S, D]`` where ``mask``
    allows: torch's fused kernel, or with ``softcap`` or ``sinks`` the plain maths (as HF's
    eager path), in float32 whatever the inputs' dtype: torch's bfloat16 matmul on a CPU
    without bfloat16 instructions is tens of times slower than its float32 one (a
    gpt-oss-shaped prefill of 128 tokens spent most of its time there), and the scores are
    float32 either way."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    dtype, group = q.dtype, q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(
        group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax_with_sinks(scores, sinks, heads_dim=1)
    return torch.matmul(probs, v).to(dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: Sinks, heads_dim: int) -> torch.Tensor:
    """The float32 softmax over the last dimension of ``scores``, whose dimension
    ``heads_dim`` counts the query heads; with ``sinks``, each head's sink logit joins the
    denominator as one more column, dropped from the result."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    shape = [1] * scores.dim()
    shape[heads_dim] = -1
    sink = sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores.float(), sink], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            num_cached: int, window: int = 0, softcap: float = 0.0,
            sinks: Sinks = None) -> torch.Tensor:
    """Causal attention of ``q`` ``[L, H, D]`` (the last L positions) over ``k``/``v``."""
    length, heads, dim = q.shape
    kvh = k.shape[1]
    qg = q.view(length, kvh, heads // kvh, dim).permute(1, 2, 0, 3).float()  # [KVH, G, L, D]
    kt = k.permute(1, 2, 0).float()[:, None]  # [KVH, 1, D, S]
    scores = torch.matmul(qg, kt) * scale  # [KVH, G, L, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~_visible(length, k.shape[0], num_cached, window, q.device),
                        float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # each head's sink logit: one more column of its softmax, which has no value
        sink = sinks.float().view(kvh, heads // kvh, 1, 1).expand(-1, -1, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, v.permute(1, 0, 2).float()[:, None])  # [KVH, G, L, D]
    return out.permute(2, 0, 1, 3).reshape(length, heads, dim).to(q.dtype)


def reference_paged_attention(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, window: int = 0,
                              softcap: float = 0.0, sinks: Sinks = None) -> torch.Tensor:
    """Per-request loop, no batching tricks: the simplest statement of the maths, for tests."""
    out = torch.zeros_like(query)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(meta.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        k, v = _gather_context(key_cache, value_cache, meta.block_table[i], lens[i])
        out[start:end] = _attend(query[start:end], k, v, scale, lens[i] - (end - start),
                                 window, softcap, sinks)
    return out
