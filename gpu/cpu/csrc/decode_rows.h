// How decode attention (attention.cpp) reads a cache row, or a query, as chunks of one
// vector each: float rows as they are, bfloat16 rows in even/odd pairs, int8 rows widened with
// their scales applied by the kernel. Each reader names its element type, whether its rows carry
// scales (kScaled), how chunk c of a row is loaded, and where lane l of chunk c sits in the row.
#pragma once

#include "vec.h"

#include <cstdint>

namespace tidal::decode {

using V = vnative;
constexpr int64_t kLanes = kNativeLanes;

// How a cache row (or a query) is read as chunks of one vector each. Plain: chunk c holds
// elements [c kLanes, (c + 1) kLanes).
template <typename scalar_t>
struct PlainRows {
  using type = scalar_t;
  static constexpr bool kScaled = false;
  static V chunk(const scalar_t* row, int c) { return load<V>(row + c * kLanes); }
  static int64_t element(int c, int lane) { return c * kLanes + lane; }
};

// bfloat16 rows of a head_dim divisible by 2 kLanes, read in pairs of chunks
// (load_pairs): chunks 2m and 2m + 1 hold the even and the odd elements of
// [2m kLanes, (2m + 2) kLanes). The query is permuted the same way and the output back, so the
// sums are those of PlainRows, in a different order.
struct PairedBf16Rows {
  using type = c10::BFloat16;
  static constexpr bool kScaled = false;
  static V chunk(const c10::BFloat16* row, int c) {
    V even, odd;
    load_pairs(row + (c / 2) * 2 * kLanes, even, odd);
    return c % 2 == 0 ? even : odd;
  }
  static int64_t element(int c, int lane) { return (c / 2) * 2 * kLanes + 2 * lane + c % 2; }
};

// An int8 cache's rows: chunk c holds elements [c kLanes, (c + 1) kLanes) widened to float32;
// each row's scale is applied by attend_block.
struct Int8Rows {
  using type = int8_t;
  static constexpr bool kScaled = true;
  static V chunk(const int8_t* row, int c) { return load<V>(row + c * kLanes); }
  static int64_t element(int c, int lane) { return c * kLanes + lane; }
};

// An int8 cache's scales for one KV head and block: kLanes floats each, lane j position j's
// key (k) or value (v) scale. Unused for float caches.
struct Scales {
  const float* k;
  const float* v;
};

}  // namespace tidal::decode
