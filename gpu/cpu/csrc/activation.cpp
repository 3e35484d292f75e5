// The gated MLP's activation, SiLU(gate) * up, in one pass over [rows, 2 x width] (gate then
// up, as the fused gate_up projection writes them). torch runs it as two ops with a
// [rows, width] intermediate between them; at prefill sizes (2,048 rows of 1,408) each op is a
// trip through memory, and its SiLU runs a scalar-rounded exp.
//
// Rounding follows HF's `F.silu(gate) * up`: SiLU is rounded to the input dtype, then the
// product. SiLU(x) = x / (1 + e^-x) is formed from e = exp(-|x|) (<= 1, from
// tidal::exp_nonpositive, so nothing overflows): x / (1 + e) for x >= 0, x e / (1 + e) below.

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in this file only

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

using tidal::vnative;

namespace {

// One register of the target a step: GCC lowers a vec16's selects (x < 0 ? a : b) lane by lane
// where a vec16 spans two AVX2 registers.
constexpr int64_t kStep = tidal::kNativeLanes;

template <typename V>
TIDAL_INLINE V silu(V x) {
  const V e = tidal::exp_nonpositive(x < 0 ? x : -x);
  const V r = 1.f / (1.f + e);
  return x < 0 ? x * e * r : x * r;
}

inline float silu(float x) {
  const vnative v = silu(tidal::splat<vnative>(x));
  return v[0];
}

// Each lane rounded to scalar_t and back, as storing and reloading it would.
template <typename scalar_t>
TIDAL_INLINE vnative rounded(vnative v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return tidal::round_to_bf16(v);
  } else {
    alignas(64) float r[kStep];
    for (int i = 0; i < kStep; ++i) r[i] = static_cast<float>(static_cast<scalar_t>(v[i]));
    return tidal::load<vnative>(r);
  }
}

template <typename scalar_t>
TIDAL_INLINE void store(scalar_t* p, vnative v) {
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    for (int i = 0; i < kStep; ++i) p[i] = static_cast<scalar_t>(v[i]);
  } else {
    tidal::store(p, v);
  }
}

template <typename scalar_t>
void silu_and_mul_kernel(torch::Tensor& out, const torch::Tensor& x) {
  const int64_t width = out.size(-1), rows = out.numel() / width;
  const scalar_t* in = x.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = in + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* orow = o + r * width;
      int64_t j = 0;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // two registers at a time
        for (; j + 2 * kStep <= width; j += 2 * kStep) {
          vnative g[2], u[2];
          tidal::load_pairs(gate + j, g[0], g[1]);
          tidal::load_pairs(up + j, u[0], u[1]);
          tidal::store_pairs(orow + j, tidal::round_to_bf16(silu(g[0])) * u[0],
                             tidal::round_to_bf16(silu(g[1])) * u[1]);
        }
      }
      for (; j + kStep <= width; j += kStep)
        store(orow + j, rounded<scalar_t>(silu(tidal::load<vnative>(gate + j))) *
                            tidal::load<vnative>(up + j));
      for (; j < width; ++j) {
        const scalar_t s = static_cast<scalar_t>(silu(static_cast<float>(gate[j])));
        orow[j] = static_cast<scalar_t>(static_cast<float>(s) * static_cast<float>(up[j]));
      }
    }
  });
}

}  // namespace

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: a contiguous CPU tensor whose last dimension is even expected");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  torch::Tensor out = torch::empty(sizes, x.options());
  if (out.numel() == 0) return out;
  switch (x.scalar_type()) {
    case at::ScalarType::Float: silu_and_mul_kernel<float>(out, x); break;
    case at::ScalarType::BFloat16: silu_and_mul_kernel<c10::BFloat16>(out, x); break;
    case at::ScalarType::Half: silu_and_mul_kernel<c10::Half>(out, x); break;
    default: TORCH_CHECK(false, "silu_and_mul: float32, bfloat16 or float16 expected");
  }
  return out;
}
