// What the paged-attention kernels (attention.cpp for decode rows,
// prefill_attention.cpp for prefill chunks) share: the checks of their common inputs, made
// before any index is used, and where a request's context positions sit in the cache.
//
// Shapes: query/out [tokens, heads, head_dim]; key_cache/value_cache
// [blocks, block_size, kv_heads, head_dim]; block_table [requests, max_blocks] int32;
// seq_lens [requests] int32. An int8 cache comes with float32 scales k_scale/v_scale
// [blocks, block_size, kv_heads], one per position and KV head (gpu/attention/kv_quant.py);
// a float cache is in the query's dtype and has none.
#pragma once

#include "kernels.h"
#include "vec.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <vector>

namespace tidal {

using OptionalTensor = c10::optional<torch::Tensor>;

// An int8 cache has a scale per position and KV head, float32, contiguous; another has none.
inline void check_cache_scales(const torch::Tensor& key_cache, const OptionalTensor& k_scale,
                               const OptionalTensor& v_scale) {
  if (key_cache.scalar_type() != torch::kInt8) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales go with an int8 cache");
    return;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 cache needs its scales");
  for (const auto* s : {&*k_scale, &*v_scale})
    TORCH_CHECK(s->device().is_cpu() && s->scalar_type() == torch::kFloat32 &&
                    s->is_contiguous() && s->dim() == 3 && s->size(0) == key_cache.size(0) &&
                    s->size(1) == key_cache.size(1) && s->size(2) == key_cache.size(2),
                "scales must be contiguous float32 [blocks, block_size, kv_heads]");
}

// A layer's attention sinks: contiguous float32 [heads], or none (nullptr).
inline const float* sink_logits(const OptionalTensor& sinks, int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == torch::kFloat32 &&
                  sinks->is_contiguous() && sinks->dim() == 1 && sinks->size(0) == heads,
              "sinks must be contiguous float32 [heads]");
  return sinks->data_ptr<float>();
}

inline void check_paged_attention_inputs(const torch::Tensor& out, const torch::Tensor& query,
                                         const torch::Tensor& key_cache,
                                         const torch::Tensor& value_cache,
                                         const torch::Tensor& block_table,
                                         const torch::Tensor& seq_lens,
                                         const OptionalTensor& k_scale = c10::nullopt,
                                         const OptionalTensor& v_scale = c10::nullopt) {
  for (const auto& t : {out, query, key_cache, value_cache, block_table, seq_lens})
    TORCH_CHECK(t.device().is_cpu(), "CPU tensors expected");
  check_cache_scales(key_cache, k_scale, v_scale);
  const bool int8 = key_cache.scalar_type() == torch::kInt8;
  for (const auto& x : {out, query})
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                    x.sizes() == query.sizes() && x.scalar_type() == query.scalar_type() &&
                    (int8 || x.scalar_type() == key_cache.scalar_type()),
                "query/out must be [tokens, heads, head_dim] in the cache's dtype (any with "
                "an int8 cache), rows contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "caches must be contiguous 4-D tensors of one shape and dtype");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && decode_attention_supports(query.size(2)),
              "head_dim must match the cache and be one of 32, 64, 80, 96, 128, 256");
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
              "heads must be a multiple of kv heads");
  // Rows are written by several threads while others read their queries: each row of out
  // must be its own memory, and out may be query itself but not overlap it otherwise.
  at::assert_no_internal_overlap(out);
  at::assert_no_partial_overlap(out, query);
  at::assert_no_overlap(out, key_cache);
  at::assert_no_overlap(out, value_cache);
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == torch::kInt32 &&
                  block_table.stride(1) == 1,
              "block_table must be 2-D int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
}

// Request r's context of len positions fits its row of the block table, whose blocks exist.
inline void check_context(const torch::Tensor& block_table, int64_t num_blocks,
                          int64_t block_size, int64_t r, int64_t len) {
  TORCH_CHECK(len >= 1 && len <= block_table.size(1) * block_size, "seq_len ", len,
              " of request ", r, " exceeds the block table");
  const int32_t* row = block_table.data_ptr<int32_t>() + r * block_table.stride(0);
  for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
    TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "block ", row[b], " out of range");
}

// Where each position of a row's context starts in the cache (in elements), padded to a whole
// number of 16 positions by repeating the last: the kernels always read 16 key rows (the
// padded lanes are then masked), so their loops unroll with every index known at compile time.
inline void context_offsets(const int32_t* blocks, int64_t len, int64_t block_size,
                            int64_t block_stride, int64_t token_stride,
                            std::vector<int64_t>& offsets) {
  offsets.resize((len + kLanes - 1) / kLanes * kLanes);
  for (int64_t b = 0, p = 0; p < len; ++b) {
    const int64_t base = blocks[b] * block_stride;
    for (int64_t t = 0; t < block_size && p < len; ++t, ++p) offsets[p] = base + t * token_stride;
  }
  std::fill(offsets.begin() + len, offsets.end(), offsets[len - 1]);
}

// Where the scales of the positions at `offsets` sit in an int8 cache's scale tensors (before
// the KV head is added): a cache row's offset over head_dim, as the scales are laid out like
// the cache without its last dimension.
inline void scale_offsets(const std::vector<int64_t>& offsets, int64_t head_dim,
                          std::vector<int64_t>& out) {
  out.resize(offsets.size());
  for (size_t p = 0; p < offsets.size(); ++p) out[p] = offsets[p] / head_dim;
}

}  // namespace tidal
