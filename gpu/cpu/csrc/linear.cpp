// A float32 GEMM for the linear layers on the CPU: y = x W^T + b, with W packed once at load time
// into column panels.
//
// A decode step multiplies a few dozen rows by every weight of the model, each read once from
// memory. oneDNN and MKL compute a weight's product only once its bytes have arrived, so memory
// and arithmetic take turns. Here each panel is one sequential stream, and while the
// microkernel works through one panel it prefetches the next into L2, a slice per block of rows,
// so the next bytes arrive while these are multiplied.
//
// Layout: W [N, K] becomes panels [ceil(N / P), K, P]; panel p holds columns Pp..Pp+P-1 of
// W^T, row k contiguous (zero columns pad the last panel). The microkernel keeps an MR x P block
// of y in vector registers and, for each k, adds x[m, k] times the panel's row k. P is two of
// the target's registers wide (vec.h's vnative: 16 floats with AVX-512, 8 with AVX2, 4
// otherwise) and MR fits its register file: 32 columns by 8 rows on AVX-512, 16 by 6 on AVX2.
// A 16-float vector type spanning two AVX2 registers was kept in memory by GCC, not in
// registers, and ran many times slower than torch.
// Rows of x are taken 128 at a time so that chunk stays in cache across the panels; the
// panels of a chunk are split over torch's threads by tidal::parallel_items (a thread that
// finishes its run of panels takes the last ones of a thread held up). Sums run in k order in
// float32 (FMA). Whether this GEMM, MKL's, oneDNN's or torch's runs for a given row count is
// decided by timing them on the host (gpu/cpu/selector.py).

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in this file only

#include "kernels.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

// A panel is two native vectors wide; MR rows of it are 2 MR accumulator registers, plus two
// for the panel's row and one for x's broadcast: MR = 8 of AVX-512's 32 registers, 6 of
// AVX2's (or SSE's) 16.
constexpr int64_t kW = tidal::kNativeLanes;  // floats in one register
constexpr int64_t kPanel = 2 * kW;
constexpr int64_t kRowBlock = tidal::kNativeLanes == 16 ? 8 : 6;
constexpr int kVecs = 2;
constexpr int64_t kRowChunk = 128;  // rows of x kept in cache while every panel passes

using tidal::vnative;

// What a microkernel call prefetches: the next panel's bytes from `next` on, two 64-byte lines
// every `every` values of k.
struct Prefetch {
  const char* next;
  int64_t every;
};

template <int MR>
void microkernel(const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                 int64_t ldy, int64_t cols, const float* bias, Prefetch pf) {
  vnative acc[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = vnative{};
  int64_t countdown = pf.every;
  for (int64_t k = 0; k < K; ++k) {
    vnative b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = tidal::load_native(panel + k * kPanel + v * kW);
    if (--countdown == 0) {
      countdown = pf.every;
      __builtin_prefetch(pf.next, 0, 2);
      __builtin_prefetch(pf.next + 64, 0, 2);
      pf.next += 128;
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float a = x[m * ldx + k];
      for (int v = 0; v < kVecs; ++v) acc[m][v] += a * b[v];
    }
  }
  alignas(64) float bias_row[kPanel] = {};
  if (bias != nullptr) std::memcpy(bias_row, bias, cols * sizeof(float));
  for (int m = 0; m < MR; ++m) {
    alignas(64) float row[kPanel];
    for (int v = 0; v < kVecs; ++v)
      tidal::store_native(row + v * kW, acc[m][v] + tidal::load_native(bias_row + v * kW));
    std::memcpy(y + m * ldy, row, cols * sizeof(float));
  }
}

using Microkernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                             int64_t, const float*, Prefetch);
template <int... MR>
constexpr std::array<Microkernel, sizeof...(MR) + 1> microkernels(
    std::integer_sequence<int, MR...>) {
  return {nullptr, microkernel<MR + 1>...};
}
constexpr auto kMicrokernels = microkernels(std::make_integer_sequence<int, static_cast<int>(kRowBlock)>{});

// Rows [m0, m0 + rows) of y, over panel p.
void multiply_panel(const float* x, int64_t ldx, const float* panels, int64_t K, int64_t N,
                    const float* bias, float* y, int64_t m0, int64_t rows, int64_t p,
                    int64_t num_panels) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t panel_bytes = K * kPanel * sizeof(float);
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
  const float* panel = panels + p * K * kPanel;
  // The next panel is fetched a slice per row block, spread over that block's k loop.
  const char* next =
      reinterpret_cast<const char*>(panels + std::min(p + 1, num_panels - 1) * K * kPanel);
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t m = m0 + j * kRowBlock;
    const int mr = static_cast<int>(std::min(kRowBlock, m0 + rows - m));
    const Prefetch pf{next + panel_bytes * j / blocks, blocks};
    kMicrokernels[mr](x + m * ldx, ldx, panel, K, y + m * N + n0, N, cols,
                      bias == nullptr ? nullptr : bias + n0, pf);
  }
}

}  // namespace

torch::Tensor pack_linear_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == torch::kFloat32,
              "weight must be a 2-D float32 CPU tensor [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({num_panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({num_panels, kPanel, K}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias) {
  // A row of one feature is contiguous whatever its stride (a transposed column has one > 1).
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat32 &&
                  (x.stride(1) == 1 || x.size(1) == 1),
              "x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(panels.device().is_cpu() && panels.dim() == 3 && panels.size(2) == kPanel &&
                  panels.is_contiguous() && panels.scalar_type() == torch::kFloat32,
              "panels must come from pack_linear_weight");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "out_features ", N,
              " does not match the panels");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->numel() == N &&
                    bias->scalar_type() == torch::kFloat32,
                "bias must be a contiguous float32 CPU tensor of out_features");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    tidal::parallel_items(P, [&](tidal::ItemSource& panels) {
      for (int64_t p; (p = panels.next()) >= 0;)
        multiply_panel(xp, x.stride(0), w, K, N, b, yp, m0, rows, p, P);
    });
  }
  return y;
}

int64_t linear_panel_width() { return kPanel; }
