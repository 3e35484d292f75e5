// CPU kernels: decode attention that reads the paged KV cache in place, the cache write,
// RMSNorm and rotary embeddings fused into one pass each (torch runs them as 6 and 14 small
// ops, whose fixed costs dominate at decode batch sizes), and a switch that flushes denormal
// floats to zero on torch's worker threads.
//
// The torch path gathers every decode row's context into a contiguous copy before attending,
// which moves each layer's whole KV context through memory three times a step. These two
// kernels read each key and value once, straight from its block: `decode_scores` computes the
// scaled q.k of every context position, torch's softmax normalises them, and
// `decode_weighted_values` sums the values under those weights. Work is split over
// requests with at::parallel_for, on torch's own thread pool.
//
// Shapes: query/out [tokens, heads, head_dim]; key_cache/value_cache
// [blocks, block_size, kv_heads, head_dim]; block_table [requests, max_blocks] int32;
// seq_lens [requests] int32; requests and query_rows [n] int64: the i-th attended row is
// request requests[i], whose query is query[query_rows[i]]; scores/probs [n, heads, max_len]
// float32. Every index is checked before any is used.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "cpu_linear.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define TIDAL_HAS_MXCSR 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// float32, float64, bfloat16 and float16: the element type is scalar_t inside the lambda.
#define TIDAL_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, TYPE, NAME, \
                                  __VA_ARGS__)

namespace {

struct Paged {
  int64_t block_size, block_stride, token_stride;
  const int32_t* block_table;
  int64_t table_stride;

  // Offset of (position p, kv head h) of request r in the cache, in elements.
  inline int64_t offset(int64_t r, int64_t p, int64_t h, int64_t head_dim) const {
    const int64_t block = block_table[r * table_stride + p / block_size];
    return block * block_stride + (p % block_size) * token_stride + h * head_dim;
  }
};

Paged paged_view(const torch::Tensor& cache, const torch::Tensor& block_table) {
  return Paged{cache.size(1), cache.stride(0), cache.stride(1),
               block_table.data_ptr<int32_t>(), block_table.stride(0)};
}

void check_inputs(const torch::Tensor& query, const torch::Tensor& cache,
                  const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                  const torch::Tensor& requests, const torch::Tensor& query_rows,
                  int64_t max_len) {
  TORCH_CHECK(query.device().is_cpu() && cache.device().is_cpu() &&
                  block_table.device().is_cpu() && seq_lens.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query/out must be [tokens, heads, head_dim] with contiguous rows");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "cache must be contiguous 4-D");
  TORCH_CHECK(query.scalar_type() == cache.scalar_type(), "query/out and cache dtypes differ");
  TORCH_CHECK(query.size(2) == cache.size(3), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == torch::kInt32 &&
                  block_table.stride(1) == 1,
              "block_table must be 2-D int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
  TORCH_CHECK(requests.scalar_type() == torch::kInt64 &&
                  query_rows.scalar_type() == torch::kInt64 && requests.is_contiguous() &&
                  query_rows.is_contiguous() && requests.numel() == query_rows.numel(),
              "requests and query_rows must be contiguous int64 of one length");
  const int64_t* req = requests.data_ptr<int64_t>();
  const int64_t* qrow = query_rows.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t num_requests = std::min(seq_lens.numel(), block_table.size(0));
  const int64_t block_size = cache.size(1), num_blocks = cache.size(0);
  for (int64_t i = 0; i < requests.numel(); ++i) {
    const int64_t r = req[i];
    TORCH_CHECK(r >= 0 && r < num_requests, "request ", r, " out of range");
    TORCH_CHECK(qrow[i] >= 0 && qrow[i] < query.size(0), "query row ", qrow[i], " out of range");
    const int64_t len = lens[r];
    TORCH_CHECK(len >= 1 && len <= max_len && len <= block_table.size(1) * block_size,
                "seq_len ", len, " of request ", r, " exceeds the scores or the block table");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int32_t block = table[r * block_table.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " out of range");
    }
  }
}

// What both decode kernels read about their rows: the i-th attends as request req_of[i] over
// lens[req_of[i]] positions, with its query (or output) at row qrow[i]; scores and probs rows
// are [heads, width] per i.
struct DecodeRows {
  int64_t n, heads, dim, group, width;
  const int32_t* lens;
  const int64_t* req_of;
  const int64_t* qrow;
  Paged cache;
};

DecodeRows decode_rows(const torch::Tensor& rows_tensor, const torch::Tensor& cache,
                       const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                       const torch::Tensor& requests, const torch::Tensor& query_rows,
                       const torch::Tensor& weights) {
  const int64_t heads = rows_tensor.size(1);
  return DecodeRows{requests.numel(), heads, rows_tensor.size(2), heads / cache.size(2),
                    weights.size(2), seq_lens.data_ptr<int32_t>(),
                    requests.data_ptr<int64_t>(), query_rows.data_ptr<int64_t>(),
                    paged_view(cache, block_table)};
}

// scores[i, head, p] = scale * q.k over each position p of the row's context.
template <typename scalar_t>
void scores_kernel(const DecodeRows& rows, const torch::Tensor& query,
                   const torch::Tensor& key_cache, double scale, torch::Tensor& scores) {
  const int64_t heads = rows.heads, dim = rows.dim, width = rows.width;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  float* out = scores.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t q_stride = query.stride(0);

  // One request per task, all its heads at once: each cached token's keys for every head
  // are one contiguous row, so a block is read front to back.
  at::parallel_for(0, rows.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rows.req_of[i], len = rows.lens[r];
      const scalar_t* qr = q + rows.qrow[i] * q_stride;
      for (int64_t j = 0; j < heads * dim; ++j) qf[j] = static_cast<float>(qr[j]) * s;
      float* sc = out + i * heads * width;
      for (int64_t p = 0; p < len; ++p) {
        const scalar_t* kp = k + rows.cache.offset(r, p, 0, dim);
        for (int64_t head = 0; head < heads; ++head) {
          const float* qh = qf.data() + head * dim;
          const scalar_t* kh = kp + (head / rows.group) * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * static_cast<float>(kh[d]);
          sc[head * width + p] = dot;
        }
      }
    }
  });
}

// out[qrow[i], head] = sum over positions p of probs[i, head, p] * v[p].
template <typename scalar_t>
void weighted_values_kernel(const DecodeRows& rows, const torch::Tensor& probs,
                            const torch::Tensor& value_cache, torch::Tensor& out) {
  const int64_t heads = rows.heads, dim = rows.dim, width = rows.width;
  const float* pr = probs.data_ptr<float>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t o_stride = out.stride(0);

  at::parallel_for(0, rows.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads * dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rows.req_of[i], len = rows.lens[r];
      const float* w = pr + i * heads * width;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const scalar_t* vp = v + rows.cache.offset(r, p, 0, dim);
        for (int64_t head = 0; head < heads; ++head) {
          float* ah = acc.data() + head * dim;
          const scalar_t* vh = vp + (head / rows.group) * dim;
          const float wh = w[head * width + p];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ah[d] += wh * static_cast<float>(vh[d]);
        }
      }
      scalar_t* o_row = o + rows.qrow[i] * o_stride;
      for (int64_t j = 0; j < heads * dim; ++j) o_row[j] = static_cast<scalar_t>(acc[j]);
    }
  });
}

template <typename scalar_t>
void rms_norm_kernel(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                     double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const scalar_t* in = x.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = in + r * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < dim; ++j) {
        const float v = static_cast<float>(xr[j]);
        squares += v * v;
      }
      const float mean = squares / static_cast<float>(dim);
      const float inv = 1.f / std::sqrt(mean + static_cast<float>(eps));
      scalar_t* orow = o + r * dim;
      // as HF: normalise in float32, round to the input dtype, then scale by the weight
      for (int64_t j = 0; j < dim; ++j) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[j]) * inv);
        orow[j] = static_cast<scalar_t>(static_cast<float>(w[j]) * static_cast<float>(normed));
      }
    }
  });
}

// Non-interleaved ("rotate half") rotation of every head of x [tokens, heads, head_dim], in
// place, by the float32 cos/sin rows [max_positions, head_dim] of each token's position.
template <typename scalar_t>
void rotate_in_place(torch::Tensor& x, const float* cos, const float* sin, const int64_t* pos,
                     int64_t begin, int64_t end) {
  const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  scalar_t* base = x.data_ptr<scalar_t>();
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + pos[t] * dim;
    const float* s = sin + pos[t] * dim;
    for (int64_t h = 0; h < heads; ++h) {
      scalar_t* xh = base + t * token_stride + h * head_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
        xh[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
        xh[i + half] = static_cast<scalar_t>(x2 * c[i + half] + x1 * s[i + half]);
      }
    }
  }
}

}  // namespace

// Stores key/value rows [tokens, kv_heads, head_dim] (rows may be strided, heads contiguous)
// at their cache slots; a slot of -1 (a padded row) is skipped.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slot_mapping) {
  const int64_t n = slot_mapping.numel();
  for (const auto& x : {key, value}) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 &&
                    x.stride(1) == x.size(2) && x.size(0) >= n &&
                    x.size(1) * x.size(2) == key_cache.stride(1) &&
                    x.scalar_type() == key_cache.scalar_type(),
                "key/value must be [tokens, kv_heads, head_dim] rows in the cache's dtype");
  }
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "caches must be contiguous CPU tensors of one shape and dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " out of range");
  }
  const int64_t row_bytes = key_cache.stride(1) * key_cache.element_size();
  auto copy_rows = [&](const torch::Tensor& src, torch::Tensor& cache) {
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(cache.data_ptr());
    const int64_t src_stride = src.stride(0) * src.element_size();
    for (int64_t t = 0; t < n; ++t) {
      if (slots[t] >= 0) std::memcpy(to + slots[t] * row_bytes, from + t * src_stride, row_bytes);
    }
  };
  copy_rows(key, key_cache);
  copy_rows(value, value_cache);
}

// RMSNorm of the rows of a contiguous x ([..., dim]) into a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [dim] in x's dtype");
  torch::Tensor out = torch::empty_like(x);
  TIDAL_DISPATCH(x.scalar_type(), "rms_norm",
                 [&] { rms_norm_kernel<scalar_t>(out, x, weight, eps); });
  return out;
}

// Rotates query [tokens, heads, head_dim] and key [tokens, kv_heads, head_dim] in place
// (rows may be strided, as views into a fused qkv projection; each head contiguous).
void rotary_embedding(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                      torch::Tensor sin, torch::Tensor positions) {
  for (const auto& x : {query, key}) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 &&
                    x.size(2) == cos.size(1) && x.size(2) % 2 == 0 &&
                    x.size(0) == positions.numel() && x.scalar_type() == query.scalar_type(),
                "query/key must be [tokens, heads, head_dim] with contiguous heads");
  }
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "cos/sin must be contiguous float32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "positions must be contiguous int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t tokens = positions.numel(), max_positions = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "position ", pos[t], " out of range");
  }
  TIDAL_DISPATCH(query.scalar_type(), "rotary", [&] {
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      rotate_in_place<scalar_t>(query, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, begin,
                                end);
      rotate_in_place<scalar_t>(key, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, begin,
                                end);
    });
  });
}

// Scaled q.k scores [n, heads, max_len] (float32); positions past a row's length are left
// untouched, so callers pass a tensor filled with -inf.
void decode_scores(torch::Tensor scores, torch::Tensor query, torch::Tensor key_cache,
                   torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor requests,
                   torch::Tensor query_rows, double scale) {
  TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == torch::kFloat32 &&
                  scores.is_contiguous() && scores.size(0) == requests.numel() &&
                  scores.size(1) == query.size(1),
              "scores must be contiguous float32 [n, heads, max_len]");
  check_inputs(query, key_cache, block_table, seq_lens, requests, query_rows, scores.size(2));
  TIDAL_DISPATCH(query.scalar_type(), "decode_scores", [&] {
    scores_kernel<scalar_t>(
        decode_rows(query, key_cache, block_table, seq_lens, requests, query_rows, scores),
        query, key_cache, scale, scores);
  });
}

// out[query_rows[i]] = sum over positions of probs[i] * value (in place, in out's dtype).
void decode_weighted_values(torch::Tensor out, torch::Tensor probs, torch::Tensor value_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens,
                            torch::Tensor requests, torch::Tensor query_rows) {
  TORCH_CHECK(probs.dim() == 3 && probs.scalar_type() == torch::kFloat32 &&
                  probs.is_contiguous() && probs.size(0) == requests.numel() &&
                  probs.size(1) == out.size(1),
              "probs must be contiguous float32 [n, heads, max_len]");
  check_inputs(out, value_cache, block_table, seq_lens, requests, query_rows, probs.size(2));
  TIDAL_DISPATCH(out.scalar_type(), "decode_weighted_values", [&] {
    weighted_values_kernel<scalar_t>(
        decode_rows(out, value_cache, block_table, seq_lens, requests, query_rows, probs), probs,
        value_cache, out);
  });
}

// Sets flush-to-zero and denormals-are-zero on every thread of the calling thread's torch
// pool (each worker keeps its own floating-point control register). Returns false where the
// CPU has no such switch.
bool flush_denormals_in_pool() {
#ifdef TIDAL_HAS_MXCSR
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [](int64_t, int64_t) {
    _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
  });
  return true;
#else
  return false;
#endif
}

// Sets or clears flush-to-zero and denormals-are-zero on the calling thread only; returns
// whether they were set before.
bool set_thread_flush(bool on) {
#ifdef TIDAL_HAS_MXCSR
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(on ? (csr | 0x8040u) : (csr & ~0x8040u));
  return (csr & 0x8040u) == 0x8040u;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_thread_flush", &set_thread_flush,
        "set or clear denormal flushing on this thread; returns the previous setting");
  m.def("flush_denormals_in_pool", &flush_denormals_in_pool,
        "flush denormals to zero on torch's worker threads");
  m.def("write_kv", &write_kv, "store key/value rows at their cache slots");
  m.def("rms_norm", &rms_norm, "RMSNorm, normalised in float32 (HF's order of rounding)");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE of query and key, in place");
  m.def("decode_scores", &decode_scores, "scaled q.k over the paged cache");
  m.def("decode_weighted_values", &decode_weighted_values, "probs @ V over the paged cache");
  m.def("pack_linear_weight", &pack_linear_weight, "float32 W [N, K] -> GEMM panels");
  m.def("packed_linear", &packed_linear, "y = x W^T + b over packed panels (float32)");
}
