// Prefill attention on the CPU: every prefill chunk of a step in one call, reading the paged
// KV cache in place.
//
// A chunk's m query rows are the last m positions of its request's context (the positions
// before them are cached: earlier chunks or a shared prefix), and row i attends causally over
// positions [0, cached + i]. The work is split into items of 16 query rows of one KV head: the
// rows of that head's query heads (GQA), position by position, so a key and value row read from
// the cache serves every query head that shares it.
//
// An item keeps its 16 rows side by side, one per vector lane: the queries transposed
// (q^T[d] holds dimension d of all 16 rows), the output transposed likewise, and the online
// softmax's running maximum and sum as vectors. For each 16 positions of the context, the
// scores of key j are then sum_d q^T[d] * K[j][d], one multiply-add per element with the key's
// element broadcast from the cache, and the output gains sum_j p[j] * V[j][d] the same way.
// Softmax needs no horizontal sums or maxima: everything is lane-wise across the rows. Key
// tiles past an item's last position are skipped, and only tiles that cross the diagonal are
// masked.
//
// bench/prefill_attention.py times it against torch's fused attention over gathered copies,
// one call per request (the torch backend's path).
//
// Shapes as in paged.h; query_start_loc [requests + 1] int32 (request r's rows are
// query[query_start_loc[r]:query_start_loc[r + 1]]); requests [n] int64, the requests to
// attend. float32 only: other dtypes keep torch's path.

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in this file only

#include "kernels.h"
#include "paged.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <limits>
#include <vector>

using tidal::kLanes;
using tidal::splat;
using tidal::vec16;

namespace {

constexpr int64_t kDimStep = 8;  // output dimensions accumulated in registers at a time
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// 16 query rows of one KV head of one request.
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
                  const torch::Tensor& query_start_loc, const torch::Tensor& requests) {
  tidal::check_paged_attention_inputs(out, query, key_cache, value_cache, block_table, seq_lens);
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

// Scores of the item's 16 rows against the 16 keys at `offsets` (lane k of s[j]: row k, key j).
template <int DIM>
void tile_scores(const float* qt, const float* keys, const int64_t* offsets, vec16 s[kLanes]) {
  for (int64_t j = 0; j < kLanes; ++j) s[j] = vec16{};
  for (int d0 = 0; d0 < DIM; d0 += 4) {
    vec16 q[4];
    for (int dd = 0; dd < 4; ++dd) q[dd] = tidal::load(qt + (d0 + dd) * kLanes);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      const float* k = keys + offsets[j] + d0;
      for (int dd = 0; dd < 4; ++dd) s[j] += q[dd] * k[dd];
    }
  }
}

// ot (the output so far, transposed) scaled by alpha, plus the first n values at `offsets`
// weighted by p.
template <int DIM>
void tile_values(float* ot, vec16 alpha, const vec16 p[kLanes], const float* values,
                 const int64_t* offsets, int64_t n) {
  for (int d0 = 0; d0 < DIM; d0 += kDimStep) {
    vec16 acc[kDimStep];
    for (int dd = 0; dd < kDimStep; ++dd) acc[dd] = tidal::load(ot + (d0 + dd) * kLanes) * alpha;
    const auto add = [&](int64_t j) {
      const float* v = values + offsets[j] + d0;
      for (int dd = 0; dd < kDimStep; ++dd) acc[dd] += p[j] * v[dd];
    };
    if (n == kLanes) {
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j) add(j);
    } else {
      for (int64_t j = 0; j < n; ++j) add(j);
    }
    for (int dd = 0; dd < kDimStep; ++dd) tidal::store(ot + (d0 + dd) * kLanes, acc[dd]);
  }
}

// One item over its context: qt [DIM][16] (scaled queries), positions[k] the position of row k,
// in increasing order; leaves the unnormalised output in ot [DIM][16] and returns the softmax
// sums.
template <int DIM>
vec16 attend_rows(const float* qt, vec16 positions, const float* keys, const float* values,
                  const int64_t* offsets, float* ot) {
  std::fill(ot, ot + DIM * kLanes, 0.f);
  vec16 running_max = splat(kMinusInf), sums{};
  const float first_position = positions[0];
  const int64_t end = static_cast<int64_t>(positions[kLanes - 1]) + 1;  // keys to attend
  for (int64_t k0 = 0; k0 < end; k0 += kLanes) {
    vec16 s[kLanes], p[kLanes];
    tile_scores<DIM>(qt, keys, offsets + k0, s);
    if (k0 + kLanes - 1 > first_position) {  // the tile crosses the diagonal: mask the future
      for (int64_t j = 0; j < kLanes; ++j)
        s[j] = positions < static_cast<float>(k0 + j) ? splat(kMinusInf) : s[j];
    }
    vec16 tile_max = s[0];
    for (int64_t j = 1; j < kLanes; ++j) tile_max = s[j] > tile_max ? s[j] : tile_max;
    const vec16 new_max = tile_max > running_max ? tile_max : running_max;
    // shifted by the maximum, or by 0 while a row's every score is -inf (-inf - -inf is NaN)
    const vec16 shift = new_max == splat(kMinusInf) ? vec16{} : new_max;
    const vec16 alpha = tidal::exp_nonpositive(running_max - shift);
    const int64_t n = std::min(kLanes, end - k0);
    vec16 tile_sum{};
    for (int64_t j = 0; j < n; ++j) {
      p[j] = tidal::exp_nonpositive(s[j] - shift);
      tile_sum += p[j];
    }
    sums = sums * alpha + tile_sum;
    running_max = new_max;
    tile_values<DIM>(ot, alpha, p, values, offsets + k0, n);
  }
  return sums;
}

template <int DIM>
void prefill_kernel(torch::Tensor& out, const torch::Tensor& query,
                    const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                    const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                    const torch::Tensor& query_start_loc, const torch::Tensor& requests,
                    float scale) {
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
      for (int64_t first = 0; first < rows; first += kLanes) items.push_back({req[i], h, first});
  }
  const float* q = query.data_ptr<float>();
  const float* keys = key_cache.data_ptr<float>();
  const float* values = value_cache.data_ptr<float>();
  float* o = out.data_ptr<float>();

  tidal::parallel_items(static_cast<int64_t>(items.size()), [&](tidal::ItemSource& source) {
    std::vector<float> qt(DIM * kLanes), ot(DIM * kLanes);
    std::vector<int64_t> offsets, token(kLanes), head(kLanes);
    int64_t offsets_of = -1;  // the request `offsets` was made for
    for (int64_t i; (i = source.next()) >= 0;) {
      const Item& item = items[i];
      const Chunk c = {qsl[item.request], qsl[item.request + 1], lens[item.request]};
      const int64_t cached = c.len - (c.last - c.first);
      const int64_t rows = std::min(kLanes, (c.last - c.first) * group - item.first_row);
      vec16 positions;
      for (int64_t k = 0; k < kLanes; ++k) {  // lanes past the last row repeat it, unwritten
        const int64_t row = item.first_row + std::min(k, rows - 1);
        token[k] = c.first + row / group;
        head[k] = item.kv_head * group + row % group;
        positions[k] = static_cast<float>(cached + row / group);
        const float* qk = q + token[k] * query.stride(0) + head[k] * DIM;
        for (int64_t d = 0; d < DIM; ++d) qt[d * kLanes + k] = qk[d] * scale;
      }
      if (offsets_of != item.request) {
        tidal::context_offsets(table + item.request * block_table.stride(0), c.len,
                               key_cache.size(1), key_cache.stride(0), key_cache.stride(1),
                               offsets);
        offsets_of = item.request;
      }
      const int64_t kv_offset = item.kv_head * DIM;
      const vec16 sums = attend_rows<DIM>(qt.data(), positions, keys + kv_offset,
                                          values + kv_offset, offsets.data(), ot.data());
      for (int64_t d = 0; d < DIM; ++d)  // one vector division per dimension, not 16
        tidal::store(ot.data() + d * kLanes, tidal::load(ot.data() + d * kLanes) / sums);
      for (int64_t k = 0; k < rows; ++k) {
        float* ok = o + token[k] * out.stride(0) + head[k] * DIM;
        for (int64_t d = 0; d < DIM; ++d) ok[d] = ot[d * kLanes + k];
      }
    }
  });
}

}  // namespace

void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor block_table,
                       torch::Tensor seq_lens, torch::Tensor query_start_loc,
                       torch::Tensor requests, double scale) {
  check_inputs(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
               requests);
  const auto run = [&](auto kernel) {
    kernel(out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, requests,
           static_cast<float>(scale));
  };
  switch (query.size(2)) {
    case 32: return run(prefill_kernel<32>);
    case 64: return run(prefill_kernel<64>);
    case 80: return run(prefill_kernel<80>);
    case 96: return run(prefill_kernel<96>);
    case 128: return run(prefill_kernel<128>);
    case 256: return run(prefill_kernel<256>);
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", query.size(2), " unsupported");
  }
}
