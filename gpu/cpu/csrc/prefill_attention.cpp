// Prefill attention on the CPU: every prefill chunk of a step in one call, reading the paged
// KV cache in place.
//
// A chunk's m query rows are the last m positions of its request's context (the positions
// before them are cached: earlier chunks or a shared prefix), and row i attends causally over
// positions [0, cached + i]. The work is split into items of kRows query rows of one KV head:
// the rows of that head's query heads (GQA), position by position, so a key and value row read
// from the cache serves every query head that shares it.
//
// An item keeps its rows side by side, one per vector lane: the queries transposed (q^T[d]
// holds dimension d of all its rows), the output transposed likewise, and the online softmax's
// running maximum and sum as vectors. For each tile of kRows positions of the context, the
// scores of key j are then sum_d q^T[d] * K[j][d], one multiply-add per element with the key's
// element broadcast from the cache, and the output gains sum_j p[j] * V[j][d] the same way.
// Softmax needs no horizontal sums or maxima: everything is lane-wise across the rows. Key
// tiles past an item's last position are skipped, and only tiles that cross the diagonal are
// masked.
//
// A sliding-window layer (window > 0) lets row i see only positions > its position - window:
// an item starts at the tile holding its first row's earliest visible key, and tiles reaching
// below its last row's are masked from below too. Soft-capping (softcap > 0) maps each score s
// to softcap * tanh(s / softcap) before the masks. Both are checked once a tile.
//
// The vectors are the target's own (vec.h's vnative), so an item is 16 rows and a tile 16 keys
// with AVX-512, 8 and 8 with AVX2: a tile's scores (one vector per key) and the query
// dimensions multiplying them, or a step of output dimensions, then fit the 32 or 16 vector
// registers. In 16-float vectors, two registers each with AVX2, the tiles spilled to the stack
// there and the kernel lost to torch's path.
//
// bench/prefill_attention.py times it against torch's fused attention over gathered copies,
// one call per request (the torch backend's path).
//
// Shapes as in paged.h; query_start_loc [requests + 1] int32 (request r's rows are
// query[query_start_loc[r]:query_start_loc[r + 1]]); requests [n] int64, the requests to
// attend. float32 queries only: other dtypes keep torch's path. The cache is float32 or int8
// with its scales (gpu/attention/kv_quant.py): each tile of an int8 cache's keys and values is
// then dequantized into a small float buffer first, and attended from there.

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in this file only

#include "kernels.h"
#include "paged.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using V = tidal::vnative;
// Query rows in an item, one per lane, and keys in a tile: the target's vector width.
constexpr int64_t kRows = tidal::kNativeLanes;
constexpr int64_t kKeys = kRows;
// Query dimensions held in registers while a tile's scores accumulate, beside its kKeys sums.
constexpr int kQueryStep = 4;
// Output dimensions accumulated in registers at a time, each over a tile's keys.
constexpr int kDimStep = 8;
static_assert(kKeys + kQueryStep + 1 <= tidal::kNativeRegisters &&
                  kDimStep + 2 <= tidal::kNativeRegisters,
              "a tile must fit the target's vector registers");
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// kRows query rows of one KV head of one request.
struct Item {
  int64_t request;
  int64_t kv_head;
  int64_t first_row;  // in the request's rows of this KV head: position-major, then head
};

// The request's query rows [first, last) and context length, after checking them.
struct Chunk {
  int64_t first, last, len;
};

Chunk request_chunk(const int32_t* qsl, const int32_t* lens, int64_t r, int64_t tokens) {
  const Chunk c{qsl[r], qsl[r + 1], lens[r]};
  TORCH_CHECK(c.first >= 0 && c.first < c.last && c.last <= tokens, "query rows [", c.first,
              ", ", c.last, ") of request ", r, " are not within the query's ", tokens);
  TORCH_CHECK(c.last - c.first <= c.len, "request ", r, " has ", c.last - c.first,
              " query rows but a context of ", c.len);
  return c;
}

void check_inputs(const torch::Tensor& out, const torch::Tensor& query,
                  const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                  const torch::Tensor& query_start_loc, const torch::Tensor& requests,
                  const tidal::OptionalTensor& k_scale, const tidal::OptionalTensor& v_scale) {
  tidal::check_paged_attention_inputs(out, query, key_cache, value_cache, block_table, seq_lens,
                                      k_scale, v_scale);
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "prefill_attention: float32 expected");
  TORCH_CHECK(query_start_loc.device().is_cpu() && requests.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.is_contiguous(),
              "query_start_loc must be contiguous int32");
  TORCH_CHECK(requests.scalar_type() == torch::kInt64 && requests.is_contiguous(),
              "requests must be contiguous int64");
  const int64_t num_requests = std::min({seq_lens.numel(), block_table.size(0),
                                         query_start_loc.numel() - 1});
  const int64_t* req = requests.data_ptr<int64_t>();
  std::vector<bool> written(query.size(0));
  for (int64_t i = 0; i < requests.numel(); ++i) {
    const int64_t r = req[i];
    TORCH_CHECK(r >= 0 && r < num_requests, "request ", r, " out of range");
    const Chunk c = request_chunk(query_start_loc.data_ptr<int32_t>(),
                                  seq_lens.data_ptr<int32_t>(), r, query.size(0));
    for (int64_t row = c.first; row < c.last; ++row) {
      TORCH_CHECK(!written[row], "query row ", row, " given twice");
      written[row] = true;
    }
    tidal::check_context(block_table, key_cache.size(0), key_cache.size(1), r, c.len);
  }
}

// Scores of the item's kRows rows against the kKeys keys at `offsets` (lane k of s[j]: row k,
// key j).
template <int DIM>
void tile_scores(const float* qt, const float* keys, const int64_t* offsets, V s[kKeys]) {
  for (int64_t j = 0; j < kKeys; ++j) s[j] = V{};
  for (int d0 = 0; d0 < DIM; d0 += kQueryStep) {
    V q[kQueryStep];
    for (int dd = 0; dd < kQueryStep; ++dd) q[dd] = tidal::load<V>(qt + (d0 + dd) * kRows);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kKeys; ++j) {
      const float* k = keys + offsets[j] + d0;
      for (int dd = 0; dd < kQueryStep; ++dd) s[j] += q[dd] * k[dd];
    }
  }
}

// ot (the output so far, transposed) scaled by alpha, plus the first n values at `offsets`
// weighted by p.
template <int DIM>
void tile_values(float* ot, V alpha, const V p[kKeys], const float* values,
                 const int64_t* offsets, int64_t n) {
  for (int d0 = 0; d0 < DIM; d0 += kDimStep) {
    V acc[kDimStep];
    for (int dd = 0; dd < kDimStep; ++dd)
      acc[dd] = tidal::load<V>(ot + (d0 + dd) * kRows) * alpha;
    const auto add = [&](int64_t j) {
      const float* v = values + offsets[j] + d0;
      for (int dd = 0; dd < kDimStep; ++dd) acc[dd] += p[j] * v[dd];
    };
    if (n == kKeys) {
#pragma GCC unroll 16
      for (int64_t j = 0; j < kKeys; ++j) add(j);
    } else {
      for (int64_t j = 0; j < n; ++j) add(j);
    }
    for (int dd = 0; dd < kDimStep; ++dd) tidal::store(ot + (d0 + dd) * kRows, acc[dd]);
  }
}

// An int8 cache's scales for one KV head: position p's key scale is k[at[p]] and its value
// scale v[at[p]]. Unused (null) for a float32 cache.
struct Scales {
  const float* k;
  const float* v;
  const int64_t* at;
};

// An int8 tile's kKeys key and value rows (at offsets[k0], ...), dequantized by their scales
// into float rows of DIM at tile (keys) and tile + kKeys DIM (values): widened a vector at a
// time once a tile, where widening each element as it was broadcast made prefill over an int8
// cache 2-3x slower than over a float32 one.
template <int DIM>
void dequantize_tile(const int8_t* keys, const int8_t* values, const int64_t* offsets,
                     Scales scales, int64_t k0, float* tile) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const V key_scale = tidal::splat<V>(scales.k[scales.at[k0 + j]]);
    const V value_scale = tidal::splat<V>(scales.v[scales.at[k0 + j]]);
    const int8_t* k = keys + offsets[k0 + j];
    const int8_t* v = values + offsets[k0 + j];
    for (int64_t d = 0; d < DIM; d += kRows) {
      tidal::store(tile + j * DIM + d, tidal::load<V>(k + d) * key_scale);
      tidal::store(tile + (kKeys + j) * DIM + d, tidal::load<V>(v + d) * value_scale);
    }
  }
}

// One item over its context: qt [DIM][kRows] (scaled queries), positions[k] the position of
// row k, in increasing order; leaves the unnormalised output in ot [DIM][kRows] and returns
// the softmax sums (each row's shifted by its maximum score, left in `row_max`). An int8
// cache's tiles are dequantized into `tile` (2 kKeys DIM floats).
template <int DIM, typename cache_t>
V attend_rows(const float* qt, V positions, const cache_t* keys, const cache_t* values,
              const int64_t* offsets, Scales scales, float* tile, float* ot, int64_t window,
              float softcap, V& row_max) {
  constexpr bool kScaled = std::is_same_v<cache_t, int8_t>;
  int64_t tile_offsets[kKeys];  // where each key's row sits in the dequantized tile
  for (int64_t j = 0; j < kKeys; ++j) tile_offsets[j] = j * DIM;
  const V minus_inf = tidal::splat<V>(kMinusInf);
  std::fill(ot, ot + DIM * kRows, 0.f);
  V running_max = minus_inf, sums{};
  const float first_position = positions[0];
  const int64_t end = static_cast<int64_t>(positions[kRows - 1]) + 1;  // keys to attend
  // with a sliding window: the first row's earliest key, and the last row's
  const int64_t lowest = window > 0 ? std::max<int64_t>(0, end - window) : 0;
  const int64_t begin =
      window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(first_position) - window + 1) : 0;
  const V window_floor = positions - static_cast<float>(window);  // keys at or below: masked
  for (int64_t k0 = begin - begin % kKeys; k0 < end; k0 += kKeys) {
    V s[kKeys], p[kKeys];
    if constexpr (kScaled) {
      dequantize_tile<DIM>(keys, values, offsets, scales, k0, tile);
      tile_scores<DIM>(qt, tile, tile_offsets, s);
    } else {
      tile_scores<DIM>(qt, keys, offsets + k0, s);
    }
    if (softcap > 0.f)
      for (int64_t j = 0; j < kKeys; ++j) s[j] = tidal::soft_cap(s[j], softcap);
    if (k0 < lowest) {  // the tile reaches below a row's window: mask the past
      for (int64_t j = 0; j < kKeys; ++j)
        s[j] = window_floor >= static_cast<float>(k0 + j) ? minus_inf : s[j];
    }
    if (k0 + kKeys - 1 > first_position) {  // the tile crosses the diagonal: mask the future
      for (int64_t j = 0; j < kKeys; ++j)
        s[j] = positions < static_cast<float>(k0 + j) ? minus_inf : s[j];
    }
    V tile_max = s[0];
    for (int64_t j = 1; j < kKeys; ++j) tile_max = s[j] > tile_max ? s[j] : tile_max;
    const V new_max = tile_max > running_max ? tile_max : running_max;
    // shifted by the maximum, or by 0 while a row's every score is -inf (-inf - -inf is NaN)
    const V shift = new_max == minus_inf ? V{} : new_max;
    const V alpha = tidal::exp_nonpositive(running_max - shift);
    const int64_t n = std::min(kKeys, end - k0);
    V tile_sum{};
    for (int64_t j = 0; j < n; ++j) {
      p[j] = tidal::exp_nonpositive(s[j] - shift);
      tile_sum += p[j];
    }
    sums = sums * alpha + tile_sum;
    running_max = new_max;
    if constexpr (kScaled) {
      tile_values<DIM>(ot, alpha, p, tile + kKeys * DIM, tile_offsets, n);
    } else {
      tile_values<DIM>(ot, alpha, p, values, offsets + k0, n);
    }
  }
  row_max = running_max;
  return sums;
}

template <int DIM, typename cache_t>
void prefill_kernel(torch::Tensor& out, const torch::Tensor& query,
                    const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                    const torch::Tensor& query_start_loc, const torch::Tensor& requests,
                    float scale, const tidal::OptionalTensor& k_scale,
                    const tidal::OptionalTensor& v_scale, int64_t window, float softcap,
                    const float* sinks) {
  constexpr bool kScaled = std::is_same_v<cache_t, int8_t>;
  const int64_t heads = query.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* req = requests.data_ptr<int64_t>();
  std::vector<Item> items;
  for (int64_t i = 0; i < requests.numel(); ++i) {
    const int64_t rows = (qsl[req[i] + 1] - qsl[req[i]]) * group;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t first = 0; first < rows; first += kRows) items.push_back({req[i], h, first});
  }
  const float* q = query.data_ptr<float>();
  const cache_t* keys = key_cache.data_ptr<cache_t>();
  const cache_t* values = value_cache.data_ptr<cache_t>();
  const float* key_scales = kScaled ? k_scale->data_ptr<float>() : nullptr;
  const float* value_scales = kScaled ? v_scale->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();

  tidal::parallel_items(static_cast<int64_t>(items.size()), [&](tidal::ItemSource& source) {
    std::vector<float> qt(DIM * kRows), ot(DIM * kRows), tile(kScaled ? 2 * kKeys * DIM : 0);
    std::vector<int64_t> offsets, at_scales, token(kRows), head(kRows);
    int64_t offsets_of = -1;  // the request `offsets` was made for
    for (int64_t i; (i = source.next()) >= 0;) {
      const Item& item = items[i];
      const Chunk c = {qsl[item.request], qsl[item.request + 1], lens[item.request]};
      const int64_t cached = c.len - (c.last - c.first);
      const int64_t rows = std::min(kRows, (c.last - c.first) * group - item.first_row);
      V positions;
      for (int64_t k = 0; k < kRows; ++k) {  // lanes past the last row repeat it, unwritten
        const int64_t row = item.first_row + std::min(k, rows - 1);
        token[k] = c.first + row / group;
        head[k] = item.kv_head * group + row % group;
        positions[k] = static_cast<float>(cached + row / group);
        const float* qk = q + token[k] * query.stride(0) + head[k] * DIM;
        for (int64_t d = 0; d < DIM; ++d) qt[d * kRows + k] = qk[d] * scale;
      }
      if (offsets_of != item.request) {
        tidal::context_offsets(table + item.request * block_table.stride(0), c.len,
                               key_cache.size(1), key_cache.stride(0), key_cache.stride(1),
                               offsets);
        if (kScaled) tidal::scale_offsets(offsets, DIM, at_scales);
        offsets_of = item.request;
      }
      const int64_t kv_offset = item.kv_head * DIM;
      const Scales scales = kScaled ? Scales{key_scales + item.kv_head,
                                             value_scales + item.kv_head, at_scales.data()}
                                    : Scales{nullptr, nullptr, nullptr};
      V row_max;
      V sums = attend_rows<DIM>(qt.data(), positions, keys + kv_offset, values + kv_offset,
                                offsets.data(), scales, tile.data(), ot.data(), window, softcap,
                                row_max);
      if (sinks != nullptr)  // a sink is a logit with no value: it joins the sums only
        for (int64_t k = 0; k < kRows; ++k) sums[k] += std::exp(sinks[head[k]] - row_max[k]);
      for (int64_t d = 0; d < DIM; ++d)  // one vector division per dimension, not one per row
        tidal::store(ot.data() + d * kRows, tidal::load<V>(ot.data() + d * kRows) / sums);
      for (int64_t k = 0; k < rows; ++k) {
        float* ok = o + token[k] * out.stride(0) + head[k] * DIM;
        for (int64_t d = 0; d < DIM; ++d) ok[d] = ot[d * kRows + k];
      }
    }
  });
}

// prefill_kernel for the query's head_dim.
template <typename cache_t, typename... Args>
void dispatch_dim(torch::Tensor& out, const torch::Tensor& query, Args&&... args) {
  switch (query.size(2)) {
    case 32: return prefill_kernel<32, cache_t>(out, query, args...);
    case 64: return prefill_kernel<64, cache_t>(out, query, args...);
    case 80: return prefill_kernel<80, cache_t>(out, query, args...);
    case 96: return prefill_kernel<96, cache_t>(out, query, args...);
    case 128: return prefill_kernel<128, cache_t>(out, query, args...);
    case 256: return prefill_kernel<256, cache_t>(out, query, args...);
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", query.size(2), " unsupported");
  }
}

}  // namespace

void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor block_table,
                       torch::Tensor seq_lens, torch::Tensor query_start_loc,
                       torch::Tensor requests, double scale,
                       c10::optional<torch::Tensor> k_scale,
                       c10::optional<torch::Tensor> v_scale, int64_t window, double softcap,
                       c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  check_inputs(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
               requests, k_scale, v_scale);
  const float* sink = tidal::sink_logits(sinks, query.size(1));
  if (key_cache.scalar_type() == torch::kInt8) return dispatch_dim<int8_t>(
      out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, requests,
      static_cast<float>(scale), k_scale, v_scale, window, static_cast<float>(softcap), sink);
  dispatch_dim<float>(out, query, key_cache, value_cache, block_table, seq_lens,
                      query_start_loc, requests, static_cast<float>(scale), k_scale, v_scale,
                      window, static_cast<float>(softcap), sink);
}
