// y = x W^T + b with W quantized (int8, or 4-bit values) and x quantized too: each row of x is
// rounded to int8 in blocks of kBlock inputs, one float scale per block (as llama.cpp's q8_0
// activations), so the inner loop multiplies bytes by bytes into int32 sums: AVX-512 VNNI's or
// AVX-VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd. Where quant_linear.cpp widens every
// weight to a float, this reads 16 (AVX-512) or 8 (AVX2) products per instruction.
//
// What it computes is W times x's rounded rows, exactly up to float rounding: with a_b the
// scale of x's block b and xq its int8 values,
//   y[n] = sum_g s[n, g] sum_{b in g} a_b (q[n, .] . xq_b) + o[n, g] sum_{b in g} a_b sum(xq_b).
// The second term carries the offsets (int4's minimum, and for int8 the 128 the stored bytes
// are biased by where vpdpbusd needs unsigned weights), so it uses the rounded sums too.
//
// Layout (gpu/quantization/linear.py's pack_for_dot, for dot_linear_rows() output rows an item):
// the lanes of one register are kR output rows, each lane holding four consecutive inputs'
// bytes, so a broadcast of four bytes of x multiplies all kR rows at once. An int8 item is K / 4
// registers (byte = q + dot_linear_tile()[2]: 128 where vpdpbusd takes unsigned weights, else
// q itself); a 4-bit one K / 8, the low nibbles inputs k..k+3 and the high
// ones k+4..k+7. params: each item's groups in turn, kR scales then (if any) kR offsets, as
// float16.
//
// A codebook weight (MXFP4's: a 4-bit value indexes 16 small integers, each group of inputs has
// a power-of-two scale) is packed as 4-bit values, and its params are bytes: the codebook's 16
// int8 values, then each item's groups' kR scale exponents b (the scale 2^(b - 127); b = 0 reads
// as 0). A table shuffle turns each nibble into its entry minus the codebook's least, an
// unsigned byte the 4-bit path multiplies as it does int4's; the least comes back as an offset
// of least * scale, as int4's minimum does.

#pragma GCC optimize("fp-contract=fast")

#include "kernels.h"
#include "parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // inputs of x sharing one scale
constexpr int64_t kCodebook = 16;  // a codebook weight's entries (its params' first bytes)
constexpr int kCodebookRange = 32;  // the most its entries may span (int16 sums, no VNNI)

}  // namespace

#if defined(__AVX2__)

namespace {

constexpr int64_t kChunk = 64;  // rows of x quantized and kept in cache while every item passes

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kR = 16;
constexpr int kXRows = 4;
typedef __m512i ivec;
typedef __m512 fvec;
inline ivec izero() { return _mm512_setzero_si512(); }
inline fvec fzero() { return _mm512_setzero_ps(); }
inline ivec load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec splat4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline ivec low_nibbles(ivec w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
inline ivec high_nibbles(ivec w) {
  return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15));
}
inline fvec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
inline fvec splat(float v) { return _mm512_set1_ps(v); }
inline fvec fma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline ivec add_pairs(ivec acc, ivec u, ivec s) {  // no VNNI: u * s in int16 pairs, then int32
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                 _mm512_set1_epi16(1)));
}
inline ivec add_nibble_pairs(ivec acc16, ivec u0, ivec s0, ivec u1, ivec s1) {  // u < 16 only
  return _mm512_add_epi16(acc16, _mm512_add_epi16(_mm512_maddubs_epi16(u0, s0),
                                                  _mm512_maddubs_epi16(u1, s1)));
}
inline ivec widen_pairs(ivec acc16) { return _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)); }
inline ivec add_i32(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec load_table(const uint8_t* p) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline ivec lookup(ivec table, ivec nibbles) { return _mm512_shuffle_epi8(table, nibbles); }
inline fvec load_exponent_scales(const uint8_t* p) {  // kR bytes b -> 2^(b - 127) as floats
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b, 23));
}
inline fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
#if defined(__AVX512VNNI__)
#define TIDAL_VNNI 1
inline ivec dot_unsigned(ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
inline ivec dot_signed(ivec acc, ivec q, ivec s) {  // |q| as the unsigned side, q's sign on s
  const __mmask64 negative = _mm512_movepi8_mask(q);
  return add_pairs(acc, _mm512_abs_epi8(q), _mm512_mask_sub_epi8(s, negative, izero(), s));
}
#endif

#else  // AVX2

constexpr int64_t kR = 8;
constexpr int kXRows = 2;
typedef __m256i ivec;
typedef __m256 fvec;
inline ivec izero() { return _mm256_setzero_si256(); }
inline fvec fzero() { return _mm256_setzero_ps(); }
inline ivec load_bytes(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline ivec splat4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline ivec low_nibbles(ivec w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
inline ivec high_nibbles(ivec w) {
  return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15));
}
inline fvec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
inline fvec splat(float v) { return _mm256_set1_ps(v); }
inline fvec fma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec load_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline ivec add_pairs(ivec acc, ivec u, ivec s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
}
inline ivec add_nibble_pairs(ivec acc16, ivec u0, ivec s0, ivec u1, ivec s1) {  // u < 16 only
  return _mm256_add_epi16(acc16, _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0),
                                                  _mm256_maddubs_epi16(u1, s1)));
}
inline ivec widen_pairs(ivec acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
inline ivec add_i32(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec load_table(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline ivec lookup(ivec table, ivec nibbles) { return _mm256_shuffle_epi8(table, nibbles); }
inline fvec load_exponent_scales(const uint8_t* p) {  // kR bytes b -> 2^(b - 127) as floats
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(b, 23));
}
inline fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
#if defined(__AVXVNNI__)
#define TIDAL_VNNI 1
inline ivec dot_unsigned(ivec acc, ivec u, ivec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
inline ivec dot_signed(ivec acc, ivec q, ivec s) {
  return add_pairs(acc, _mm256_sign_epi8(q, q), _mm256_sign_epi8(s, q));
}
#endif

#endif

// An int8 weight's stored bytes are q + 128 where vpdpbusd multiplies them as they are (the
// 128 comes back through the offsets). Without VNNI they are q itself: vpmaddubsw's int16 pairs
// would overflow on 255 * 127, so |q| is the unsigned side and q's sign goes onto x.
// A 4-bit register's two halves (u0, u1 < 16) against two broadcasts of x: without VNNI, their
// vpmaddubsw pairs (at most 2 * 15 * 127 each) are summed in int16 over a block's kRegs
// registers (4 * 2 * 3,810 = 30,480, inside int16) and widened to int32 once a block; a
// codebook's entries (up to kCodebookRange above its least) every two registers instead.
#if defined(TIDAL_VNNI)
constexpr int64_t kInt8Bias = 128;
inline ivec dot_int8(ivec acc, ivec w, ivec s) { return dot_unsigned(acc, w, s); }
inline ivec dot_nibbles(ivec acc, ivec u0, ivec s0, ivec u1, ivec s1) {
  return dot_unsigned(dot_unsigned(acc, u0, s0), u1, s1);
}
#else
constexpr int64_t kInt8Bias = 0;
inline ivec dot_int8(ivec acc, ivec w, ivec s) { return dot_signed(acc, w, s); }
inline ivec dot_nibbles(ivec acc16, ivec u0, ivec s0, ivec u1, ivec s1) {
  return add_nibble_pairs(acc16, u0, s0, u1, s1);
}
#endif

// Rows of x rounded to int8 per block: q = round(x * (127 / amax)), scale amax / 127, and
// each group's sum of the rounded values times their scales.
struct QuantizedRows {
  std::vector<int8_t> q;     // [rows, K]
  std::vector<float> scale;  // [rows, K / kBlock]
  std::vector<float> sums;   // [rows, K / group_size]
};

// One block of kBlock floats to int8 (rounded to nearest, ties to even); returns the sum of
// the int8 values.
inline int32_t round_block(const float* x, float inv, int8_t* q) {
  int32_t total = 0;
#if defined(__AVX512F__)
  for (int i = 0; i < kBlock; i += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(v));
    total += _mm512_reduce_add_epi32(v);
  }
#else
  for (int i = 0; i < kBlock; i += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
    for (int j = 0; j < 8; ++j) {
      q[i + j] = static_cast<int8_t>(lanes[j]);
      total += lanes[j];
    }
  }
#endif
  return total;
}

inline float abs_max(const float* x) {
  float m = 0.f;
  for (int i = 0; i < kBlock; ++i) m = std::max(m, std::abs(x[i]));
  return m;
}

void quantize_rows(const float* x, int64_t rows, int64_t K, int64_t group_size,
                   QuantizedRows& out) {
  const int64_t blocks = K / kBlock, groups = K / group_size, per_group = group_size / kBlock;
  out.q.resize(rows * K);
  out.scale.resize(rows * blocks);
  out.sums.assign(rows * groups, 0.f);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kBlock;
      const float amax = abs_max(xb);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const float scale = amax / 127.f;
      const int32_t total = round_block(xb, inv, out.q.data() + m * K + b * kBlock);
      out.scale[m * blocks + b] = scale;
      out.sums[m * groups + b / per_group] += scale * static_cast<float>(total);
    }
  }
}

// How a weight's bytes hold its values: int8, 4-bit integers, or 4-bit codebook indices.
enum class Format { kInt8, kNibbles, kCodes };

struct Item {
  const uint8_t* w;         // this item's registers of bytes
  const uint16_t* params;   // this item's groups' scales (and offsets), float16 (kCodes: unset)
  const uint8_t* exponents; // kCodes: this item's groups' scale exponents
  const uint8_t* next;      // the next item's bytes, to prefetch (nullptr: none)
  float* y;                 // y's row of this tile's first x row, at this item's first column
  int64_t cols;             // output columns this item writes (<= kR)
  const float* bias;        // this item's, or nullptr
};

struct Shape {
  int64_t K, blocks, groups, group_blocks, ldy;
  bool offsets;
  const uint8_t* table = nullptr;  // kCodes: each entry minus the least, kCodebook bytes
  float least = 0.f;               // kCodes: the codebook's least entry
};

// A weight's group scales (s) and offsets (o) for kR output rows.
template <Format F>
inline void group_params(const Shape& sh, const Item& t, int64_t g, fvec& s, fvec& o) {
  if constexpr (F == Format::kCodes) {
    s = load_exponent_scales(t.exponents + g * kR);
    o = mul(s, splat(sh.least));
    return;
  }
  const uint16_t* p = t.params + g * (sh.offsets ? 2 : 1) * kR;
  s = load_half(p);
  o = sh.offsets ? load_half(p + kR) : fzero();
  if constexpr (F == Format::kInt8 && kInt8Bias != 0) o = fma(s, splat(-float(kInt8Bias)), o);
}

template <int M, Format F>
void tile(const Shape& sh, const int8_t* xq, const float* xscale, const float* xsums,
          const Item& t) {
  constexpr bool kFour = F != Format::kInt8;
  constexpr int kRegs = kFour ? 4 : 8;  // registers of weight bytes per block of x
  fvec acc[M];
  for (int m = 0; m < M; ++m) acc[m] = fzero();
  const ivec table = F == Format::kCodes ? load_table(sh.table) : izero();
  const uint8_t* w = t.w;
  const char* ahead = reinterpret_cast<const char*>(t.next);
  for (int64_t g = 0; g < sh.groups; ++g) {
    fvec group[M];
    for (int m = 0; m < M; ++m) group[m] = fzero();
    for (int64_t b = g * sh.group_blocks; b < (g + 1) * sh.group_blocks; ++b) {
      ivec sums[M], wide[M];
      for (int m = 0; m < M; ++m) sums[m] = wide[m] = izero();
      const int8_t* xb = xq + b * kBlock;
#pragma GCC unroll 8
      for (int j = 0; j < kRegs; ++j, w += sizeof(ivec)) {
        if (ahead != nullptr && (sizeof(ivec) == 64 || j % 2 == 0))  // once a cache line
          __builtin_prefetch(ahead + (w - t.w), 0, 2);
        const ivec v = load_bytes(w);
        if constexpr (kFour) {
          ivec lo = low_nibbles(v), hi = high_nibbles(v);
          if constexpr (F == Format::kCodes) lo = lookup(table, lo), hi = lookup(table, hi);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m)
            sums[m] = dot_nibbles(sums[m], lo, splat4(xb + m * sh.K + 8 * j), hi,
                                  splat4(xb + m * sh.K + 8 * j + 4));
#if !defined(TIDAL_VNNI)
          if (F == Format::kCodes && j % 2 == 1)  // int16 pairs widened every two registers
            for (int m = 0; m < M; ++m) wide[m] = add_i32(wide[m], widen_pairs(sums[m])),
                                        sums[m] = izero();
#endif
        } else {
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) sums[m] = dot_int8(sums[m], v, splat4(xb + m * sh.K + 4 * j));
        }
      }
      for (int m = 0; m < M; ++m) {
#if !defined(TIDAL_VNNI)
        if constexpr (F == Format::kNibbles) sums[m] = widen_pairs(sums[m]);  // int16 pairs
        if constexpr (F == Format::kCodes) sums[m] = wide[m];
#endif
        group[m] = fma(to_float(sums[m]), splat(xscale[m * sh.blocks + b]), group[m]);
      }
    }
    fvec s, o;
    group_params<F>(sh, t, g, s, o);
    for (int m = 0; m < M; ++m) {
      acc[m] = fma(group[m], s, acc[m]);
      acc[m] = fma(o, splat(xsums[m * sh.groups + g]), acc[m]);
    }
  }
  alignas(64) float out[kR];
  for (int m = 0; m < M; ++m) {
    store(out, acc[m]);
    for (int64_t r = 0; r < t.cols; ++r)
      t.y[m * sh.ldy + r] = out[r] + (t.bias != nullptr ? t.bias[r] : 0.f);
  }
}

template <Format F>
void run_tile(int64_t rows, const Shape& sh, const int8_t* xq, const float* xscale,
              const float* xsums, const Item& t) {
  switch (rows) {
    case 1: return tile<1, F>(sh, xq, xscale, xsums, t);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    case 2: return tile<2, F>(sh, xq, xscale, xsums, t);
    case 3: return tile<3, F>(sh, xq, xscale, xsums, t);
    default: return tile<4, F>(sh, xq, xscale, xsums, t);
#else
    default: return tile<2, F>(sh, xq, xscale, xsums, t);
#endif
  }
}

// Rows row.. row + n of x's quantized rows times item t, kXRows at a time, into t.y's rows.
void run_rows(Format f, const Shape& sh, const QuantizedRows& xq, int64_t row, int64_t n,
              Item t, int64_t ldy) {
  float* y = t.y;
  for (int64_t m = 0; m < n; m += kXRows) {
    const int64_t r = row + m, rows = std::min<int64_t>(kXRows, n - m);
    const int8_t* q = xq.q.data() + r * sh.K;
    const float* scale = xq.scale.data() + r * sh.blocks;
    const float* sums = xq.sums.data() + r * sh.groups;
    t.y = y + m * ldy;
    if (f == Format::kInt8) run_tile<Format::kInt8>(rows, sh, q, scale, sums, t);
    else if (f == Format::kNibbles) run_tile<Format::kNibbles>(rows, sh, q, scale, sums, t);
    else run_tile<Format::kCodes>(rows, sh, q, scale, sums, t);
  }
}

// A weight's params, checked: float16 scales (and offsets), or a codebook weight's bytes (whose
// codebook, turned into the table, goes into sh). Returns the format its values are in.
struct Params {
  Format format;
  const uint16_t* halves = nullptr;   // float16 params
  const uint8_t* exponents = nullptr; // a codebook weight's, after its codebook
  int64_t per_item;                   // params (halves or exponents) an item
};

Params check_params(const torch::Tensor& params, int64_t bits, int64_t items, int64_t groups,
                    Shape& sh, uint8_t* table, const char* name) {
  const int64_t per_item = groups * kR;
  if (params.scalar_type() == at::kByte) {
    TORCH_CHECK(bits == 4 && params.is_contiguous() &&
                    params.numel() == kCodebook + items * per_item,
                name, ": a codebook weight's params must be its 4-bit values' codebook and "
                "scale exponents");
    const int8_t* codes = reinterpret_cast<const int8_t*>(params.data_ptr<uint8_t>());
    const int8_t least = *std::min_element(codes, codes + kCodebook);
    const int8_t most = *std::max_element(codes, codes + kCodebook);
    TORCH_CHECK(most - least <= kCodebookRange, name, ": a codebook may span at most ",
                kCodebookRange);
    for (int i = 0; i < kCodebook; ++i) table[i] = static_cast<uint8_t>(codes[i] - least);
    sh.table = table;
    sh.least = least;
    sh.offsets = false;
    return {Format::kCodes, nullptr, params.data_ptr<uint8_t>() + kCodebook, per_item};
  }
  TORCH_CHECK(params.scalar_type() == at::kHalf && params.is_contiguous() &&
                  (params.numel() == items * per_item || params.numel() == 2 * items * per_item),
              name, ": params of the wrong size");
  sh.offsets = params.numel() == 2 * items * per_item;
  return {bits == 4 ? Format::kNibbles : Format::kInt8,
          reinterpret_cast<const uint16_t*>(params.data_ptr<at::Half>()), nullptr,
          per_item * (sh.offsets ? 2 : 1)};
}

// Item i of a weight whose params are pr.
Item item_of(const uint8_t* w, const Params& pr, int64_t i, int64_t item_bytes,
             const uint8_t* next, int64_t cols, const float* bias) {
  return {w + i * item_bytes,
          pr.halves == nullptr ? nullptr : pr.halves + i * pr.per_item,
          pr.exponents == nullptr ? nullptr : pr.exponents + i * pr.per_item,
          next, nullptr, cols, bias};
}

}  // namespace

std::vector<int64_t> dot_linear_tile() { return {kR, kBlock, kInt8Bias}; }

bool dot_linear_supports(int64_t bits, int64_t group_size, int64_t in_features) {
  return (bits == 4 || bits == 8) && group_size > 0 && group_size % kBlock == 0 &&
         in_features % group_size == 0;
}

torch::Tensor dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor params,
                         int64_t bits, int64_t group_size, int64_t out_features,
                         c10::optional<torch::Tensor> bias) {
  if (x.scalar_type() != at::kFloat) {  // bfloat16 rows: widened, multiplied, rounded back
    c10::optional<torch::Tensor> wide_bias;
    if (bias.has_value()) wide_bias = bias->to(at::kFloat);
    return dot_linear(x.to(at::kFloat).contiguous(), packed, params, bits, group_size,
                      out_features, wide_bias).to(x.scalar_type());
  }
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(),
              "dot_linear: x must be a contiguous float32 [rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1), items = (out_features + kR - 1) / kR;
  TORCH_CHECK(dot_linear_supports(bits, group_size, K), "dot_linear: no ", bits,
              "-bit groups of ", group_size, " over ", K, " inputs");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == items * kR * K * bits / 8,
              "dot_linear: packed weight of the wrong size");
  const int64_t groups = K / group_size;
  Shape sh{K, K / kBlock, groups, group_size / kBlock, out_features, false};
  uint8_t table[kCodebook];
  const Params pr = check_params(params, bits, items, groups, sh, table, "dot_linear");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features &&
                bias->is_contiguous(), "dot_linear: bias must be float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  torch::Tensor y = torch::empty({M, out_features}, x.options());
  const int64_t item_bytes = K * bits / 8 * kR;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  QuantizedRows xq;
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    quantize_rows(xs + m0 * K, rows, K, group_size, xq);
    tidal::parallel_items(items, [&](tidal::ItemSource& source) {
      for (int64_t i = source.next(); i >= 0; i = source.next()) {
        Item t = item_of(w, pr, i, item_bytes, i + 1 < items ? w + (i + 1) * item_bytes : nullptr,
                         std::min(kR, out_features - i * kR), b == nullptr ? nullptr : b + i * kR);
        t.y = ys + m0 * out_features + i * kR;
        run_rows(pr.format, sh, xq, 0, rows, t, out_features);
      }
    });
  }
  return y;
}

namespace {

// One weight of a group call: rows in_row.. of x's quantized rows times it, into rows out_row..
// of y (n rows; in_row is 0 for every weight where they all take x's one row).
struct Group {
  const uint8_t* w;
  Params params;
  int64_t in_row, out_row, n;
};

// Weights alike in shape and format, each over its own rows, in one parallel region, the rows of
// each tiled as dot_linear tiles them (so each weight's products are dot_linear's, bit for bit).
torch::Tensor run_groups(const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                         const std::vector<torch::Tensor>& params, std::vector<Group> groups,
                         int64_t y_rows, int64_t bits, int64_t group_size, int64_t out_features,
                         const char* name) {
  const int64_t G = static_cast<int64_t>(groups.size());
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == G && static_cast<int64_t>(params.size()) == G,
              name, ": one packed weight and one params tensor per group");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, name,
              ": x must be a contiguous float32 [rows, in_features]");
  const int64_t K = x.size(1), items = (out_features + kR - 1) / kR;
  TORCH_CHECK(dot_linear_supports(bits, group_size, K), name, ": no ", bits, "-bit groups of ",
              group_size, " over ", K, " inputs");
  const int64_t groups_k = K / group_size;
  torch::Tensor y = torch::empty({y_rows, out_features}, x.options());
  if (G == 0) return y;
  const int64_t item_bytes = K * bits / 8 * kR;
  Shape sh{K, K / kBlock, groups_k, group_size / kBlock, out_features, false};
  uint8_t table[kCodebook], other[kCodebook];
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(packed[g].scalar_type() == at::kByte && packed[g].is_contiguous() &&
                    packed[g].numel() == items * item_bytes,
                name, ": packed weight of the wrong size");
    Shape mine = sh;
    groups[g].params = check_params(params[g], bits, items, groups_k, g == 0 ? sh : mine,
                                    g == 0 ? table : other, name);
    TORCH_CHECK(groups[g].params.format == groups[0].params.format &&
                    (g == 0 || (mine.offsets == sh.offsets && mine.least == sh.least)) &&
                    (groups[g].params.format != Format::kCodes || g == 0 ||
                     std::equal(table, table + kCodebook, other)),
                name, ": the weights' formats differ");
    const Group& grp = groups[g];
    TORCH_CHECK(grp.n > 0 && grp.in_row >= 0 && grp.in_row + grp.n <= x.size(0) &&
                    grp.out_row >= 0 && grp.out_row + grp.n <= y_rows,
                name, ": a group's rows out of range");
    groups[g].w = packed[g].data_ptr<uint8_t>();
  }
  float* ys = y.data_ptr<float>();
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), x.size(0), K, group_size, xq);
  tidal::parallel_items(G * items, [&](tidal::ItemSource& source) {
    for (int64_t i = source.next(); i >= 0; i = source.next()) {
      const Group& grp = groups[i / items];
      const int64_t j = i % items;
      const uint8_t* next = j + 1 < items ? grp.w + (j + 1) * item_bytes
                                          : (i / items + 1 < G ? groups[i / items + 1].w : nullptr);
      Item t = item_of(grp.w, grp.params, j, item_bytes, next,
                       std::min(kR, out_features - j * kR), nullptr);
      t.y = ys + grp.out_row * out_features + j * kR;
      run_rows(grp.params.format, sh, xq, grp.in_row, grp.n, t, out_features);
    }
  });
  return y;
}

}  // namespace

// Several weights of one shape, each over its own row of x (or all over x's one row), in one
// parallel region: a MoE block's experts for a lone decode row, where a call per expert would
// spend more on each call's start and end than on its few hundred kilobytes of weights.
torch::Tensor dot_linear_experts(torch::Tensor x, std::vector<torch::Tensor> packed,
                                 std::vector<torch::Tensor> params, int64_t bits,
                                 int64_t group_size, int64_t out_features) {
  if (x.scalar_type() != at::kFloat)  // bfloat16 rows: widened, multiplied, rounded back
    return dot_linear_experts(x.to(at::kFloat).contiguous(), packed, params, bits, group_size,
                              out_features).to(x.scalar_type());
  const int64_t E = static_cast<int64_t>(packed.size());
  TORCH_CHECK(E > 0 && x.dim() == 2 && (x.size(0) == 1 || x.size(0) == E),
              "dot_linear_experts: x must be [1 or experts, in_features]");
  std::vector<Group> groups;
  for (int64_t e = 0; e < E; ++e)
    groups.push_back({nullptr, {}, x.size(0) == 1 ? 0 : e, e, 1});
  return run_groups(x, packed, params, std::move(groups), E, bits, group_size, out_features,
                    "dot_linear_experts");
}

torch::Tensor dot_linear_groups(torch::Tensor x, std::vector<torch::Tensor> packed,
                                std::vector<torch::Tensor> params, std::vector<int64_t> starts,
                                std::vector<int64_t> counts, int64_t bits, int64_t group_size,
                                int64_t out_features) {
  if (x.scalar_type() != at::kFloat)  // bfloat16 rows: widened, multiplied, rounded back
    return dot_linear_groups(x.to(at::kFloat).contiguous(), packed, params, starts, counts, bits,
                             group_size, out_features).to(x.scalar_type());
  TORCH_CHECK(starts.size() == packed.size() && counts.size() == packed.size(),
              "dot_linear_groups: a start and a count per weight");
  std::vector<Group> groups;
  for (size_t g = 0; g < packed.size(); ++g)
    groups.push_back({nullptr, {}, starts[g], starts[g], counts[g]});
  return run_groups(x, packed, params, std::move(groups), x.size(0), bits, group_size,
                    out_features, "dot_linear_groups");
}

#else  // no AVX2: not offered (dot_linear_supports says no)

std::vector<int64_t> dot_linear_tile() { return {0, kBlock, 0}; }

bool dot_linear_supports(int64_t, int64_t, int64_t) { return false; }

torch::Tensor dot_linear(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                         c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "dot_linear: this build has no integer dot products (AVX2 or later)");
}

torch::Tensor dot_linear_experts(torch::Tensor, std::vector<torch::Tensor>,
                                 std::vector<torch::Tensor>, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "dot_linear_experts: this build has no integer dot products (AVX2 or later)");
}

torch::Tensor dot_linear_groups(torch::Tensor, std::vector<torch::Tensor>,
                                std::vector<torch::Tensor>, std::vector<int64_t>,
                                std::vector<int64_t>, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "dot_linear_groups: this build has no integer dot products (AVX2 or later)");
}

#endif
