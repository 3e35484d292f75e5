// Float vectors for the CPU kernels, in GCC's portable vector extensions, with no intrinsics to
// port: `vec16` (16 floats: one AVX-512 register, two AVX2 or four SSE or NEON registers) for
// kernels that stream through memory, and `vnative` (one register of the target: 16 floats with
// AVX-512, 8 with AVX2, 4 otherwise) for kernels whose tiles must stay in registers. The helpers
// below are templates over the vector type, so a kernel written for one works for the other.
// Include only from files that set `#pragma GCC optimize("fp-contract=fast")` before it, so
// a * b + c becomes one FMA.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// For the helpers the kernels call in their innermost loops: GCC's heuristics left some of them
// out of line inside large unrolled loops, which spilled their vector arguments to the stack.
#define TIDAL_INLINE inline __attribute__((always_inline))

namespace tidal {

// A vector of N floats (N a power of two), with the integer vectors of its lanes and its loads'
// views of memory. may_alias: vectors are read from and written to float buffers; aligned(4)
// (aligned(2) for 16-bit elements): any element's address.
template <int N>
struct Vectors {
  typedef float f __attribute__((vector_size(4 * N), aligned(4), may_alias));
  typedef int32_t i __attribute__((vector_size(4 * N)));
  typedef uint32_t u __attribute__((vector_size(4 * N)));
  typedef uint16_t u16_any __attribute__((vector_size(2 * N), aligned(2), may_alias));
  typedef uint32_t u32_any __attribute__((vector_size(4 * N), aligned(2), may_alias));
  typedef int8_t i8_any __attribute__((vector_size(N), aligned(1), may_alias));
};
static_assert(alignof(Vectors<8>::f) == 4 && alignof(Vectors<16>::f) == 4 &&
                  alignof(Vectors<16>::u16_any) == 2 && alignof(Vectors<16>::u32_any) == 2,
              "loads through these types must take any element's address");
template <typename V>
constexpr int kLanesOf = sizeof(V) / sizeof(float);
// The helpers below take the vector type as a template parameter, where GCC drops a typedef's
// attributes (aligned, may_alias): they reach memory through VectorsOf<V>'s types, which keep
// them, never through V itself (whose loads would assume a whole vector's alignment).
template <typename V>
using VectorsOf = Vectors<kLanesOf<V>>;

constexpr int64_t kLanes = 16;  // floats in a vec16
typedef Vectors<16>::f vec16;
typedef Vectors<16>::i ivec16;
typedef Vectors<16>::u uvec16;

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
typedef Vectors<kNativeLanes>::f vnative;
// Vector registers the target has: what a kernel's tile of vnative accumulators must fit in.
// AVX-512 and AArch64 have 32; AVX2, AVX and SSE on x86-64 have 16.
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kNativeRegisters = 32;
#else
constexpr int kNativeRegisters = 16;
#endif

template <typename V = vec16>
TIDAL_INLINE V splat(float x) { return V{} + x; }

// kLanesOf<V> consecutive elements as float32 (V defaults to vec16).
template <typename V = vec16>
TIDAL_INLINE V load(const float* p) {
  return *reinterpret_cast<const typename VectorsOf<V>::f*>(p);
}
template <typename V>
TIDAL_INLINE void store(float* p, V v) { *reinterpret_cast<typename VectorsOf<V>::f*>(p) = v; }
inline vnative load_native(const float* p) { return load<vnative>(p); }
inline void store_native(float* p, vnative v) { store(p, v); }

template <typename V = vec16>
TIDAL_INLINE V load(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
  using W = VectorsOf<V>;
  const auto wide = __builtin_convertvector(*reinterpret_cast<const typename W::u16_any*>(p),
                                            typename W::u);
  return reinterpret_cast<V>(wide << 16);
}
// 2 kLanesOf<V> consecutive bfloat16 as two float32 vectors: `even` holds elements 0, 2, 4, ...
// and `odd` elements 1, 3, 5, ... One load and one shift or mask each: cheaper than widening
// the halves one vector at a time.
template <typename V>
TIDAL_INLINE void load_pairs(const c10::BFloat16* p, V& even, V& odd) {
  using W = VectorsOf<V>;
  const typename W::u words = *reinterpret_cast<const typename W::u32_any*>(p);
  even = reinterpret_cast<V>(words << 16);  // element 2i is in word i's low half
  odd = reinterpret_cast<V>(words & 0xFFFF0000u);
}
// Each lane rounded to the nearest bfloat16 (ties to even), kept as a float32: what storing it
// as a bfloat16 and loading it back gives, NaN included.
template <typename V>
TIDAL_INLINE V round_to_bf16(V v) {
  using U = typename VectorsOf<V>::u;
  const U bits = reinterpret_cast<U>(v);
  const U rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const V nan = reinterpret_cast<V>(U{} + 0x7FC00000u);  // c10's NaN
  return v != v ? nan : reinterpret_cast<V>(rounded);
}
template <typename V>
TIDAL_INLINE void store(c10::BFloat16* p, V v) {  // rounds to nearest, ties to even
  using W = VectorsOf<V>;
  const auto top = reinterpret_cast<typename W::u>(round_to_bf16(v)) >> 16;
  *reinterpret_cast<typename W::u16_any*>(p) = __builtin_convertvector(top, typename W::u16_any);
}
// load_pairs' inverse: 2 kLanesOf<V> bfloat16 from their even and odd elements, each rounded.
template <typename V>
TIDAL_INLINE void store_pairs(c10::BFloat16* p, V even, V odd) {
  using W = VectorsOf<V>;
  const auto low = reinterpret_cast<typename W::u>(round_to_bf16(even)) >> 16;
  const auto high = reinterpret_cast<typename W::u>(round_to_bf16(odd));
  *reinterpret_cast<typename W::u32_any*>(p) = high | low;
}
// kLanesOf<V> consecutive int8 (an int8 KV cache's values), widened to float32. GCC 12 turns
// __builtin_convertvector from int8 lanes into one scalar conversion per lane (an int8 cache's
// decode attention ran 3.5x slower than a float32 cache's), so x86 targets sign-extend and
// convert a register at a time with the instructions made for it.
template <typename V = vec16>
TIDAL_INLINE V load(const int8_t* p) {
#if defined(__AVX512F__)
  if constexpr (kLanesOf<V> == 16)
    return reinterpret_cast<V>(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#endif
#if defined(__AVX2__)
  if constexpr (kLanesOf<V> == 8)
    return reinterpret_cast<V>(_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
  return __builtin_convertvector(*reinterpret_cast<const typename VectorsOf<V>::i8_any*>(p), V);
}
template <typename V = vec16>
TIDAL_INLINE V load(const c10::Half* p) {
  alignas(64) float f[kLanesOf<V>];
  for (int i = 0; i < kLanesOf<V>; ++i) f[i] = static_cast<float>(p[i]);
  return load<V>(f);
}

// Horizontal sum and maximum as shuffle trees (log2 of the lanes rounds), not one dependent
// step per lane. Each round's pattern is a compile-time constant, so each round is one permute
// by a constant index; built lane by lane at run time, the patterns had cost more than the sums.
template <int Width, typename V, int... Lane>
TIDAL_INLINE V swap_lanes(V v, std::integer_sequence<int, Lane...>) {
  constexpr typename VectorsOf<V>::i index{(Lane ^ Width)...};
  return __builtin_shuffle(v, index);
}
template <int Width, typename V>
TIDAL_INLINE V swap_lanes(V v) {  // lanes i and i ^ Width trade places
  return swap_lanes<Width>(v, std::make_integer_sequence<int, kLanesOf<V>>{});
}

template <typename V, int Width = kLanesOf<V> / 2>
TIDAL_INLINE float sum(V v) {
  if constexpr (Width == 0) {
    return v[0];
  } else {
    return sum<V, Width / 2>(v + swap_lanes<Width>(v));
  }
}

// a where a > b, else b (so b where either is NaN).
template <typename V>
TIDAL_INLINE V max_lanes(V a, V b) { return a > b ? a : b; }

template <typename V, int Width = kLanesOf<V> / 2>
TIDAL_INLINE float max(V v) {
  if constexpr (Width == 0) {
    return v[0];
  } else {
    return max<V, Width / 2>(max_lanes(swap_lanes<Width>(v), v));
  }
}

// exp of each lane for x <= 0 (softmax's shifted scores); lanes below -87.3, -inf among them,
// give 0, so no denormal is made. Range reduction x = n ln2 + r, |r| <= ln2/2, then the
// polynomial of Cephes' expf for exp(r) and the exponent bits for 2^n.
template <typename V>
TIDAL_INLINE V exp_nonpositive(V x) {
  using I = typename VectorsOf<V>::i;
  const V low = splat<V>(-87.3f);
  const I underflow = x < low;
  x = underflow ? low : x;
  const V shifter = splat<V>(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x * 1.44269504088896341f + shifter) - shifter;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = splat<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V poly = p * r * r + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  const V result = poly * reinterpret_cast<V>(bits);
  return underflow ? V{} : result;
}

// cap * tanh(x / cap) of each lane (attention logit soft-capping, Gemma 2), as
// (1 - e) / (1 + e) with e = exp(-2 |x / cap|) <= 1, the sign put back after.
template <typename V>
TIDAL_INLINE V soft_cap(V x, float cap) {
  const V t = x * (1.f / cap);
  const V magnitude = t < 0.f ? -t : t;
  const V e = exp_nonpositive(magnitude * -2.f);
  const V tanh_magnitude = (1.f - e) / (1.f + e);
  return (t < 0.f ? -tanh_magnitude : tanh_magnitude) * cap;
}

// One round of sum_each: lanes of a and b summed in pairs Width apart, a's sums in the lower
// half of the result and b's in the upper (each block of Width lanes from one block of 2 Width).
template <int Width, typename V, int... Lane>
TIDAL_INLINE V fold_pair(V a, V b, std::integer_sequence<int, Lane...>) {
  constexpr typename VectorsOf<V>::i lo{(Lane / Width * 2 * Width + Lane % Width)...};
  constexpr typename VectorsOf<V>::i hi{(Lane / Width * 2 * Width + Lane % Width + Width)...};
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
template <int Width, int Count, typename V>
TIDAL_INLINE void fold_rounds(V* v) {  // Count vectors in v[0, Count), each round halving them
  if constexpr (Width >= 1) {
#pragma GCC unroll 16
    for (int t = 0; t < Count / 2; ++t)
      v[t] = fold_pair<Width>(v[2 * t], v[2 * t + 1],
                              std::make_integer_sequence<int, kLanesOf<V>>{});
    fold_rounds<Width / 2, Count / 2>(v);
  }
}

// Lane j of the result is the sum of v[j]'s lanes, for N = kLanesOf<V> vectors: log2(N) rounds
// of pairing, each halving the vectors and doubling the sums per vector, so N dot products cost
// N - 1 adds and 2 (N - 1) shuffles instead of N separate horizontal sums.
template <typename V>
TIDAL_INLINE V sum_each(const V v[kLanesOf<V>]) {
  constexpr int N = kLanesOf<V>;
  V t[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) t[i] = v[i];
  fold_rounds<N / 2, N>(t);
  return t[0];
}

}  // namespace tidal
