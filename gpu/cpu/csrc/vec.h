// 16-float vectors for the CPU kernels, in GCC's portable vector extensions: one AVX-512
// register where the CPU has them, two AVX2 or four SSE registers elsewhere, with no
// intrinsics to port. Include only from files that set `#pragma GCC optimize("fp-contract=fast")`
// before it, so a * b + c becomes one FMA.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

// For the helpers the kernels call in their innermost loops: GCC's heuristics left some of them
// out of line inside large unrolled loops, which spilled their vector arguments to the stack.
#define TIDAL_INLINE inline __attribute__((always_inline))

namespace tidal {

constexpr int64_t kLanes = 16;  // floats in a vec16

// One register's worth of floats on the target: GCC keeps a vec16 that spans two or four
// registers in memory between loop iterations where it is held in an array (as a GEMM's
// accumulators are), so kernels whose state must stay in registers use this type instead.
#if defined(__AVX512F__)
#define TIDAL_NATIVE_BYTES 64
#elif defined(__AVX__)
#define TIDAL_NATIVE_BYTES 32
#else
#define TIDAL_NATIVE_BYTES 16
#endif
constexpr int64_t kNativeLanes = TIDAL_NATIVE_BYTES / 4;
typedef float vnative __attribute__((vector_size(TIDAL_NATIVE_BYTES), aligned(4), may_alias));
inline vnative load_native(const float* p) { return *reinterpret_cast<const vnative*>(p); }
inline void store_native(float* p, vnative v) { *reinterpret_cast<vnative*>(p) = v; }

// may_alias: vectors are read from and written to float buffers; aligned(4): any float address.
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef uint32_t uvec16 __attribute__((vector_size(64)));
typedef uint16_t u16vec16 __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u32vec16_any __attribute__((vector_size(64), aligned(2), may_alias));

inline vec16 splat(float x) { return vec16{} + x; }
inline void store(float* p, vec16 v) { *reinterpret_cast<vec16*>(p) = v; }

// 16 consecutive elements as float32.
inline vec16 load(const float* p) { return *reinterpret_cast<const vec16*>(p); }
inline vec16 load(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
  const uvec16 wide = __builtin_convertvector(*reinterpret_cast<const u16vec16*>(p), uvec16);
  return reinterpret_cast<vec16>(wide << 16);
}
// 32 consecutive bfloat16 as two float32 vectors: `even` holds elements 0, 2, ..., 30 and `odd`
// elements 1, 3, ..., 31. One load and one shift or mask each: cheaper than widening 16 halves.
inline void load_pairs(const c10::BFloat16* p, vec16& even, vec16& odd) {
  const uvec16 words = *reinterpret_cast<const u32vec16_any*>(p);  // element 2i in the low half
  even = reinterpret_cast<vec16>(words << 16);
  odd = reinterpret_cast<vec16>(words & 0xFFFF0000u);
}
// Each lane rounded to the nearest bfloat16 (ties to even), kept as a float32: what storing it
// as a bfloat16 and loading it back gives, NaN included.
inline vec16 round_to_bf16(vec16 v) {
  const uvec16 bits = reinterpret_cast<uvec16>(v);
  const uvec16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const vec16 nan = reinterpret_cast<vec16>(uvec16{} + 0x7FC00000u);  // c10's NaN
  return v != v ? nan : reinterpret_cast<vec16>(rounded);
}
inline void store(c10::BFloat16* p, vec16 v) {  // rounds to nearest, ties to even
  const uvec16 top = reinterpret_cast<uvec16>(round_to_bf16(v)) >> 16;
  *reinterpret_cast<u16vec16*>(p) = __builtin_convertvector(top, u16vec16);
}
// load_pairs' inverse: 32 bfloat16 from their even and odd elements, each rounded.
inline void store_pairs(c10::BFloat16* p, vec16 even, vec16 odd) {
  const uvec16 low = reinterpret_cast<uvec16>(round_to_bf16(even)) >> 16;
  const uvec16 high = reinterpret_cast<uvec16>(round_to_bf16(odd));
  *reinterpret_cast<u32vec16_any*>(p) = high | low;
}
inline vec16 load(const c10::Half* p) {
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return load(f);
}

// Horizontal sum and maximum as shuffle trees (four rounds), not 16 dependent steps. Each
// round's pattern is a compile-time constant, so each round is one permute by a constant index;
// built lane by lane at run time, the patterns had cost more than the sums.
template <int Width>
TIDAL_INLINE vec16 swap_lanes(vec16 v) {  // lanes i and i ^ Width trade places
  constexpr ivec16 index{0 ^ Width,  1 ^ Width,  2 ^ Width,  3 ^ Width,  4 ^ Width,  5 ^ Width,
                         6 ^ Width,  7 ^ Width,  8 ^ Width,  9 ^ Width,  10 ^ Width, 11 ^ Width,
                         12 ^ Width, 13 ^ Width, 14 ^ Width, 15 ^ Width};
  return __builtin_shuffle(v, index);
}

TIDAL_INLINE float sum(vec16 v) {
  v += swap_lanes<8>(v);
  v += swap_lanes<4>(v);
  v += swap_lanes<2>(v);
  v += swap_lanes<1>(v);
  return v[0];
}

// a where a > b, else b (so b where either is NaN).
TIDAL_INLINE vec16 max_lanes(vec16 a, vec16 b) { return a > b ? a : b; }

TIDAL_INLINE float max(vec16 v) {
  v = max_lanes(swap_lanes<8>(v), v);
  v = max_lanes(swap_lanes<4>(v), v);
  v = max_lanes(swap_lanes<2>(v), v);
  v = max_lanes(swap_lanes<1>(v), v);
  return v[0];
}

// exp of each lane for x <= 0 (softmax's shifted scores); lanes below -87.3, -inf among them,
// give 0, so no denormal is made. Range reduction x = n ln2 + r, |r| <= ln2/2, then the
// polynomial of Cephes' expf for exp(r) and the exponent bits for 2^n.
TIDAL_INLINE vec16 exp_nonpositive(vec16 x) {
  const vec16 low = splat(-87.3f);
  const ivec16 underflow = x < low;
  x = underflow ? low : x;
  const vec16 shifter = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec16 n = (x * 1.44269504088896341f + shifter) - shifter;
  vec16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec16 poly = p * r * r + r + 1.f;
  const ivec16 bits = (__builtin_convertvector(n, ivec16) + 127) << 23;
  const vec16 result = poly * reinterpret_cast<vec16>(bits);
  return underflow ? vec16{} : result;
}

// Lane j of the result is the sum of v[j]'s 16 lanes: four rounds of pairing, each halving the
// vectors and doubling the sums per vector, so 16 dot products cost 15 adds and 30 shuffles
// instead of 16 separate horizontal sums.
TIDAL_INLINE vec16 sum_each(const vec16 v[16]) {
  constexpr ivec16 lo8{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  constexpr ivec16 hi8{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  constexpr ivec16 lo4{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  constexpr ivec16 hi4{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  constexpr ivec16 lo2{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  constexpr ivec16 hi2{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  constexpr ivec16 lo1{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  constexpr ivec16 hi1{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vec16 a[8], b[4], c[2];
  for (int t = 0; t < 8; ++t)
    a[t] = __builtin_shuffle(v[2 * t], v[2 * t + 1], lo8) +
           __builtin_shuffle(v[2 * t], v[2 * t + 1], hi8);
  for (int t = 0; t < 4; ++t)
    b[t] = __builtin_shuffle(a[2 * t], a[2 * t + 1], lo4) +
           __builtin_shuffle(a[2 * t], a[2 * t + 1], hi4);
  for (int t = 0; t < 2; ++t)
    c[t] = __builtin_shuffle(b[2 * t], b[2 * t + 1], lo2) +
           __builtin_shuffle(b[2 * t], b[2 * t + 1], hi2);
  return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

}  // namespace tidal
