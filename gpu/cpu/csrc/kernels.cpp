// CPU kernels: the cache write, RMSNorm (alone, or with the residual add before it) and rotary
// embeddings fused into one pass each (torch runs them as 6, 7 and 14 small ops, whose fixed
// costs dominate at decode batch sizes), and a switch that flushes denormal floats to zero on
// torch's worker threads. This file also binds the module, with decode attention
// (attention.cpp), the float32 GEMM (linear.cpp), SiLU(gate) * up (activation.cpp),
// the greedy sampler's argmax (argmax.cpp) and the one-call decode step (decoder.cpp).
//
// Kernels are split over tokens with at::parallel_for, on torch's own thread pool. Every index
// is checked before any is used.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "kernels.h"
#include "parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define TIDAL_HAS_MXCSR 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>

// float32, float64, bfloat16 and float16: the element type is scalar_t inside the lambda.
#define TIDAL_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, TYPE, NAME, \
                                  __VA_ARGS__)

namespace {

// RMSNorm of x's rows into out; with a delta, of x + delta, whose rows (rounded to scalar_t, as
// torch's add leaves them) are stored into sum first: the residual add and the norm after it
// in one pass.
template <typename scalar_t>
void rms_norm_kernel(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                     double eps, const torch::Tensor* delta = nullptr,
                     torch::Tensor* sum = nullptr) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const scalar_t* in = x.data_ptr<scalar_t>();
  const scalar_t* w = weight.data_ptr<scalar_t>();
  const scalar_t* d = delta ? delta->data_ptr<scalar_t>() : nullptr;
  scalar_t* s = sum ? sum->data_ptr<scalar_t>() : nullptr;
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = in + r * dim;
      if (d != nullptr) {
        const scalar_t* dr = d + r * dim;
        scalar_t* sr = s + r * dim;
        for (int64_t j = 0; j < dim; ++j)
          sr[j] = static_cast<scalar_t>(static_cast<float>(xr[j]) + static_cast<float>(dr[j]));
        xr = sr;
      }
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

// Quantizes each head vector of rows [n, kv_heads, head_dim] of x into an int8 cache at its
// slot, with its scale (max |x| / 127, times the float32 of 1/127 as the torch reference does)
// beside it: as gpu/attention/kv_quant.py's quantize_heads, to the bit.
template <typename scalar_t>
void quantize_rows(const torch::Tensor& x, const int64_t* slots, int64_t n, torch::Tensor& cache,
                   torch::Tensor& scales) {
  const int64_t heads = cache.size(2), dim = cache.size(3);
  const scalar_t* in = x.data_ptr<scalar_t>();
  int8_t* to = cache.data_ptr<int8_t>();
  float* scale_to = scales.data_ptr<float>();
  constexpr float kInverse127 = static_cast<float>(1.0 / 127.0);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* row = in + t * x.stride(0) + h * x.stride(1);
        float most = 0.f;
        for (int64_t e = 0; e < dim; ++e)
          most = std::max(most, std::abs(static_cast<float>(row[e])));
        const float scale = most * kInverse127;
        const float divisor = scale > 0.f ? scale : 1.f;
        int8_t* q = to + (slots[t] * heads + h) * dim;
        for (int64_t e = 0; e < dim; ++e) {
          const float v = std::nearbyint(static_cast<float>(row[e]) / divisor);
          q[e] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        }
        scale_to[slots[t] * heads + h] = scale;
      }
    }
  });
}

}  // namespace

// Stores key/value rows [tokens, kv_heads, head_dim] (rows may be strided, heads contiguous)
// at their cache slots; a slot of -1 (a padded row) is skipped.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slot_mapping,
              c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
  const int64_t n = slot_mapping.numel();
  const bool int8 = key_cache.scalar_type() == torch::kInt8;
  for (const auto& x : {key, value}) {
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 &&
                    x.stride(1) == x.size(2) && x.size(0) >= n &&
                    x.size(1) * x.size(2) == key_cache.stride(1) &&
                    x.scalar_type() == (int8 ? key.scalar_type() : key_cache.scalar_type()),
                "key/value must be [tokens, kv_heads, head_dim] rows in the cache's dtype (one "
                "dtype, any, for an int8 cache)");
  }
  if (int8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 cache needs its scales");
    for (const auto* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->device().is_cpu() && s->scalar_type() == torch::kFloat32 &&
                      s->is_contiguous() && s->numel() == key_cache.numel() / key_cache.size(3),
                  "scales must be contiguous float32 [blocks, block_size, kv_heads]");
  } else {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales go with an int8 cache");
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
  if (int8) {
    TIDAL_DISPATCH(key.scalar_type(), "write_kv", [&] {
      quantize_rows<scalar_t>(key, slots, n, key_cache, *k_scale);
      quantize_rows<scalar_t>(value, slots, n, value_cache, *v_scale);
    });
    return;
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

static void check_rms_norm_inputs(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [dim] in x's dtype");
}

// RMSNorm of the rows of a contiguous x ([..., dim]) into a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rms_norm_inputs(x, weight);
  torch::Tensor out = torch::empty_like(x);
  TIDAL_DISPATCH(x.scalar_type(), "rms_norm",
                 [&] { rms_norm_kernel<scalar_t>(out, x, weight, eps); });
  return out;
}

// (x + delta, RMSNorm(x + delta)) as two new tensors, for a residual add followed by a norm.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta,
                                                      torch::Tensor weight, double eps) {
  check_rms_norm_inputs(x, weight);
  TORCH_CHECK(delta.device().is_cpu() && delta.is_contiguous() && delta.sizes() == x.sizes() &&
                  delta.scalar_type() == x.scalar_type(),
              "delta must be a contiguous CPU tensor of x's shape and dtype");
  torch::Tensor sum = torch::empty_like(x), out = torch::empty_like(x);
  TIDAL_DISPATCH(x.scalar_type(), "add_rms_norm",
                 [&] { rms_norm_kernel<scalar_t>(out, x, weight, eps, &delta, &sum); });
  return {sum, out};
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

// Sets flush-to-zero and denormals-are-zero on every worker of the calling thread's torch
// pool (each keeps its own floating-point control register). The calling thread takes a share
// of the loop too, but gets its own register back: Python's float maths runs on it, and
// kernels.denormals_flushed sets it for a block only. Returns false where the CPU has no such
// switch.
bool flush_denormals_in_pool() {
#ifdef TIDAL_HAS_MXCSR
  const unsigned int caller = _mm_getcsr();
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [](int64_t, int64_t) {
    _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ (bit 15) and DAZ (bit 6)
  });
  _mm_setcsr(caller);
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

// Which thread of torch's pool did each of n items of tidal::parallel_items, and how many times
// each was done: [n, 2] int64 (thread, times). An item takes item_ms, and pool thread `stalled`
// sleeps stall_ms on its first. The tests check with it that a held-up thread's share goes to
// the others.
torch::Tensor parallel_items_probe(int64_t n, int64_t item_ms, int64_t stalled,
                                   int64_t stall_ms) {
  auto result = torch::zeros({n, 2}, torch::kInt64);
  int64_t* rows = result.data_ptr<int64_t>();
  std::unique_ptr<std::atomic<int64_t>[]> times(new std::atomic<int64_t>[n]);
  for (int64_t i = 0; i < n; ++i) times[i].store(0);
  tidal::parallel_items(n, [&](tidal::ItemSource& items) {
    const int64_t thread = at::get_thread_num();
    bool first = true;
    for (int64_t i; (i = items.next()) >= 0; first = false) {
      const bool held = first && thread == stalled;
      std::this_thread::sleep_for(std::chrono::milliseconds(held ? stall_ms : item_ms));
      rows[2 * i] = thread;
      times[i].fetch_add(1);
    }
  });
  for (int64_t i = 0; i < n; ++i) rows[2 * i + 1] = times[i].load();
  return result;
}

// The two long kernels (milliseconds a call) let go of the GIL, as torch's own ops do, so the
// event loop can stream tokens and take requests while a step computes: at concurrency 32 that
// gave 1,385-1,416 output tok/s against 1,338-1,346 with the GIL held.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_thread_flush", &set_thread_flush,
        "set or clear denormal flushing on this thread; returns the previous setting");
  m.def("flush_denormals_in_pool", &flush_denormals_in_pool,
        "flush denormals to zero on torch's worker threads");
  m.def("write_kv", &write_kv, "store key/value rows at their cache slots (int8: quantized)",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm, normalised in float32 (HF's order of rounding)");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta)) in one pass");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE of query and key, in place");
  m.def("decode_attention_supports", &decode_attention_supports,
        "whether decode_attention takes this head_dim");
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>(),
        "softmax(q.K) V of decode rows over the paged cache, in one pass", py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("requests"), py::arg("query_rows"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none());
  m.def("prefill_attention", &prefill_attention, py::call_guard<py::gil_scoped_release>(),
        "causal softmax(q.K) V of prefill chunks over the paged cache (float32)",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_table"), py::arg("seq_lens"), py::arg("query_start_loc"),
        py::arg("requests"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("argmax_rows", &argmax_rows, "each row's argmax (first maximum, first NaN)");
  m.def("decode_inputs", &decode_inputs, "a decode step's flattened inputs in one call");
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>(),
        "SiLU(gate) * up of a fused [..., 2n] gate_up projection");
  m.def("pack_linear_weight", &pack_linear_weight, "float32 W [N, K] -> GEMM panels");
  m.def("packed_linear", &packed_linear, py::call_guard<py::gil_scoped_release>(),
        "y = x W^T + b over packed panels (float32)");
  m.def("linear_panel_width", &linear_panel_width, "columns per panel of pack_linear_weight");
  m.def("mkl_pack_linear_weight", &mkl_pack_linear_weight,
        "float32 W [N, K] -> MKL's packed W^T, or None without MKL");
  m.def("mkl_linear", &mkl_linear, py::call_guard<py::gil_scoped_release>(),
        "y = x W^T + b over MKL's packed W^T (float32)");
  m.def("quant_linear", &quant_linear, py::call_guard<py::gil_scoped_release>(),
        "y = x W^T + b, W int8 or 4-bit in quant_linear_tile's layout (float32 x)");
  m.def("quant_linear_tile", &quant_linear_tile,
        "(floats in one register, output rows per item) of quant_linear's layout");
  m.def("quant_linear_supports", &quant_linear_supports,
        "whether quant_linear takes (bits, group_size, in_features)");
  m.def("dot_linear", &dot_linear, py::call_guard<py::gil_scoped_release>(),
        "y = x W^T + b, x rounded to int8 per block, W in dot_linear_tile's layout");
  m.def("dot_linear_experts", &dot_linear_experts, py::call_guard<py::gil_scoped_release>(),
        "y[e] = x[e] W_e^T over several weights of one shape in dot_linear_tile's layout");
  m.def("dot_linear_groups", &dot_linear_groups, py::call_guard<py::gil_scoped_release>(),
        "rows starts[g]:starts[g]+counts[g] of x times weight g, into the same rows of y");
  m.def("dot_linear_tile", &dot_linear_tile,
        "(output rows per item, inputs per int8 block of x) of dot_linear's layout");
  m.def("dot_linear_supports", &dot_linear_supports,
        "whether dot_linear takes (bits, group_size, in_features)");
  m.def("parallel_items_probe", &parallel_items_probe, py::call_guard<py::gil_scoped_release>(),
        "[n, 2] (thread, times done) per item of parallel_items, one thread held up");
  bind_planned_linear(m);
  bind_moe_block(m);
  bind_decode_stack(m);
}
