// y = x W^T + b for float32 x (bfloat16 rows are widened first), with W kept quantized (int8, or 4-bit values two to a byte) in
// groups of inputs that share a scale and an offset: W[n, k] = q[n, k] * s[n, g] + o[n, g].
//
// A decode step at small batch reads every weight once, so its time is the weight's bytes over
// the memory's bandwidth: 4-bit values are half int8's bytes and an eighth of float32's. The
// weight is never dequantized into memory: each block of values is widened and turned into
// floats in registers (q * s + o, one FMA), then multiplied into the rows of x.
//
// Layout (made by gpu/quantization/linear.py's pack_for_kernel from the tile shape this build
// reports, quant_linear_tile): output rows are taken kRows at a time (an item; the last one
// padded with zero rows), and an item's weight is one sequential stream of k-blocks, each kRows
// runs of kL bytes (kL: floats in one register of the target). An int8 k-block holds kL inputs
// of each row; a 4-bit one 2 kL, byte j holding input j in its low nibble and input j + kL in
// its high one, so one load gives two registers of values with a mask and a shift. params holds
// each item's groups in turn: kRows scales, then kRows offsets.
//
// Every item multiplies up to kXRows rows of x at a time, so the weight is streamed from memory
// once and re-read from L1 for the other row tiles; items go to torch's threads through
// tidal::parallel_items. The accumulator tile (kXRows x kRows registers) fits the target's
// register file: 4 x 4 of AVX-512's 32, 4 x 2 of AVX2's 16. Sums run in k order per lane, then
// across the lanes; whether this kernel or torch's runs a shape is measured
// (gpu/cpu/selector.py).

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in this file only

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

#include <ATen/ATen.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>

namespace {

using tidal::vnative;
constexpr int64_t kL = tidal::kNativeLanes;
constexpr int64_t kRows = tidal::kNativeRegisters == 32 ? 4 : 2;  // output rows per item
constexpr int64_t kXRows = 4;                                      // rows of x per tile
constexpr int64_t kChunk = 64;  // rows of x kept in cache while every item passes

typedef tidal::Vectors<kL>::i ivec;

// kL bytes from p, each widened to an int32 lane (zero- or sign-extended). GCC 12 turns
// __builtin_convertvector of a byte vector into one scalar load and insert per byte, which made
// the widening cost more than the rest of the kernel; the x86 targets get their one
// instruction (vpmovzxbd / vpmovsxbd), the others the portable loop.
template <bool kSigned>
TIDAL_INLINE ivec widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<ivec>(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<ivec>(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  ivec v;
  for (int i = 0; i < kL; ++i)
    v[i] = kSigned ? static_cast<int32_t>(static_cast<int8_t>(p[i])) : p[i];
  return v;
#endif
}

// The values one k-block holds per row: kL int8 values, or 2 kL 4-bit ones.
constexpr int64_t block_values(bool four) { return four ? 2 * kL : kL; }

struct Tile {
  const float* x;  // kXRows (or fewer) rows of x, K apart
  int64_t K;
  const uint8_t* w;        // this item's k-blocks
  const float* params;     // this item's groups: kRows scales, kRows offsets each
  int64_t group_blocks;    // k-blocks per group
  const uint8_t* next;     // the next item's k-blocks, to prefetch (nullptr: none)
  float* y;
  int64_t ldy, cols;       // y's row stride; output columns this item writes (<= kRows)
  const float* bias;       // this item's, or nullptr
};

template <bool kFour>
TIDAL_INLINE void dequantize(const uint8_t* p, vnative s, vnative o, vnative& lo, vnative& hi) {
  const ivec b = widen_bytes<!kFour>(p);
  if constexpr (kFour) {
    lo = __builtin_convertvector(b & 15, vnative) * s + o;
    hi = __builtin_convertvector(b >> 4, vnative) * s + o;
  } else {
    lo = __builtin_convertvector(b, vnative) * s + o;
  }
}

template <int M, bool kFour>
void tile(const Tile& t) {
  vnative acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = vnative{};
  const int64_t blocks = t.K / block_values(kFour), groups = blocks / t.group_blocks;
  const uint8_t* w = t.w;
  const char* ahead = reinterpret_cast<const char*>(t.next);
  for (int64_t g = 0; g < groups; ++g) {
    const float* p = t.params + g * 2 * kRows;
    for (int64_t b = 0; b < t.group_blocks; ++b, w += kRows * kL) {
      if (ahead != nullptr && ((w - t.w) & 63) == 0) __builtin_prefetch(ahead + (w - t.w), 0, 2);
      const int64_t k = (g * t.group_blocks + b) * block_values(kFour);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        vnative lo, hi;
        dequantize<kFour>(w + r * kL, tidal::splat<vnative>(p[r]),
                          tidal::splat<vnative>(p[kRows + r]), lo, hi);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          const float* xm = t.x + m * t.K + k;
          acc[m][r] += lo * tidal::load_native(xm);
          if constexpr (kFour) acc[m][r] += hi * tidal::load_native(xm + kL);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int64_t r = 0; r < t.cols; ++r)
      t.y[m * t.ldy + r] = tidal::sum(acc[m][r]) + (t.bias != nullptr ? t.bias[r] : 0.f);
}

template <bool kFour>
void run_tile(int64_t rows, const Tile& t) {
  switch (rows) {
    case 1: return tile<1, kFour>(t);
    case 2: return tile<2, kFour>(t);
    case 3: return tile<3, kFour>(t);
    default: return tile<4, kFour>(t);
  }
}

void check_packed(const torch::Tensor& x, const torch::Tensor& packed,
                  const torch::Tensor& params, int64_t bits, int64_t group_size,
                  int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_linear: x must be a contiguous float32 [rows, in_features]");
  TORCH_CHECK(quant_linear_supports(bits, group_size, x.size(1)),
              "quant_linear: this build takes no ", bits, "-bit groups of ", group_size);
  const int64_t items = (out_features + kRows - 1) / kRows;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == items * kRows * x.size(1) * bits / 8,
              "quant_linear: packed weight of the wrong size");
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() &&
                  params.numel() == items * (x.size(1) / group_size) * 2 * kRows,
              "quant_linear: params of the wrong size");
}

}  // namespace

std::vector<int64_t> quant_linear_tile() { return {kL, kRows}; }

bool quant_linear_supports(int64_t bits, int64_t group_size, int64_t in_features) {
  const int64_t block = block_values(bits == 4);
  return (bits == 4 || bits == 8) && group_size > 0 && group_size % block == 0 &&
         in_features % group_size == 0;
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor params,
                           int64_t bits, int64_t group_size, int64_t out_features,
                           c10::optional<torch::Tensor> bias) {
  if (x.scalar_type() != at::kFloat) {  // bfloat16 rows: widened, multiplied, rounded back
    c10::optional<torch::Tensor> wide_bias;
    if (bias.has_value()) wide_bias = bias->to(at::kFloat);
    return quant_linear(x.to(at::kFloat).contiguous(), packed, params, bits, group_size,
                        out_features, wide_bias).to(x.scalar_type());
  }
  check_packed(x, packed, params, bits, group_size, out_features);
  const int64_t M = x.size(0), K = x.size(1), items = (out_features + kRows - 1) / kRows;
  torch::Tensor y = torch::empty({M, out_features}, x.options());
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out_features &&
                bias->is_contiguous(), "quant_linear: bias must be float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  const int64_t item_bytes = K * bits / 8 * kRows, groups = K / group_size;
  const int64_t group_blocks = group_size / block_values(bits == 4);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* pr = params.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    tidal::parallel_items(items, [&](tidal::ItemSource& source) {
      for (int64_t i = source.next(); i >= 0; i = source.next()) {
        Tile t{nullptr, K, w + i * item_bytes, pr + i * groups * 2 * kRows, group_blocks,
               i + 1 < items ? w + (i + 1) * item_bytes : nullptr, nullptr, out_features,
               std::min(kRows, out_features - i * kRows), b == nullptr ? nullptr : b + i * kRows};
        for (int64_t m = 0; m < rows; m += kXRows) {
          t.x = xs + (m0 + m) * K;
          t.y = ys + (m0 + m) * out_features + i * kRows;
          if (bits == 4) run_tile<true>(std::min(kXRows, rows - m), t);
          else run_tile<false>(std::min(kXRows, rows - m), t);
        }
      }
    });
  }
  return y;
}

namespace {

const torch::Tensor& need(const c10::optional<torch::Tensor>& t, const char* what) {
  TORCH_CHECK(t.has_value(), "the plan names ", what, " but that layout was not packed");
  return *t;
}

// The weight dequantized for x's dtype, with gpu/quantization/weights.py's operations in its
// order, so at::linear over it gives what the Python path's F.linear gives.
torch::Tensor dequantize(const QuantPack& w, at::ScalarType dtype) {
  const torch::Tensor& q = need(w.q, "the weight's own form");
  const int64_t n = q.size(0), k = q.size(1);
  torch::Tensor d = q.to(at::kFloat).view({n, -1, w.group_size}) *
                    need(w.scales, "scales").to(at::kFloat).unsqueeze(-1);
  if (w.offsets.has_value()) d = d + w.offsets->to(at::kFloat).unsqueeze(-1);
  return d.view({n, k}).to(dtype);
}

}  // namespace

torch::Tensor QuantPack::operator()(int64_t method, const torch::Tensor& x,
                                    const c10::optional<torch::Tensor>& bias) const {
  if (method == kQuantDot)
    return dot_linear(x, need(dot_packed, "the dot layout"), need(dot_params, "its params"), bits,
                      group_size, out_features, bias);
  if (method == kQuantTidal)
    return quant_linear(x, need(packed, "tidal's pack"), need(params, "tidal's params"), bits,
                        group_size, out_features, bias);
  if (method == kQuantAten) {
    const torch::Tensor& w = need(aten_weight, "torch's pack");
    const torch::Tensor& s = need(aten_scales, "torch's scales");
    torch::Tensor y = bits == 8 ? at::_weight_int8pack_mm(x, w, s)
                                : at::_weight_int4pack_mm_for_cpu(x, w, group_size, s);
    return bias.has_value() ? y + *bias : y;
  }
  return at::linear(x, dequantize(*this, x.scalar_type()), bias);
}
