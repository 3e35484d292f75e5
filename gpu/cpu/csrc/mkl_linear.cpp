// MKL's packed-weight GEMM (cblas_sgemm_pack / cblas_sgemm_compute) for the float32 linear
// layers, where torch was built with MKL: x86-64 wheels export these from libtorch_cpu.
//
// MKL's plain sgemm re-packs the weight on every call; its packed form is made once at load
// time. Which rows counts it runs is decided by timing it on the host (gpu/cpu/selector.py).
//
// The symbols are weak: a torch without MKL leaves them null, and mkl_pack_linear_weight
// answers None, so the callers keep the panels alone.

#include "kernels.h"

#include <algorithm>
#include <cstdint>

extern "C" {
// LP64 CBLAS (MKL_INT is int); the enum values are CBLAS's.
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k,
                         const float* a, int lda, const float* b, int ldb, float beta, float* c,
                         int ldc) __attribute__((weak));
}

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;
constexpr int kPackHintRows = 128;  // the m MKL is told at packing; any m may use the pack

bool have_mkl() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr &&
         cblas_sgemm_compute != nullptr;
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= INT32_MAX, what, " ", v, " is beyond MKL's 32-bit sizes");
  return static_cast<int>(v);
}

}  // namespace

c10::optional<torch::Tensor> mkl_pack_linear_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == torch::kFloat32,
              "weight must be a 2-D float32 CPU tensor [out_features, in_features]");
  if (!have_mkl()) return c10::nullopt;
  const auto w = weight.contiguous();
  const int N = checked_int(w.size(0), "out_features"), K = checked_int(w.size(1), "in_features");
  const size_t bytes = cblas_sgemm_pack_get_size(kBMatrix, kPackHintRows, N, K);
  // MKL keeps metadata inside the buffer tied to its address: the tensor must never be copied.
  auto packed = torch::empty({static_cast<int64_t>((bytes + 3) / 4)}, w.options());
  // B = W^T, [K, N], read from W [N, K] row-major as a transposed matrix.
  cblas_sgemm_pack(kRowMajor, kBMatrix, kTrans, kPackHintRows, N, K, 1.f, w.data_ptr<float>(),
                   K, packed.data_ptr<float>());
  return packed;
}

torch::Tensor mkl_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(have_mkl(), "MKL's packed GEMM is not in this torch build");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat32 &&
                  (x.stride(1) == 1 || x.size(1) == 1),
              "x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kFloat32,
              "packed must come from mkl_pack_linear_weight");
  const int M = checked_int(x.size(0), "rows"), K = checked_int(x.size(1), "in_features");
  const int N = checked_int(out_features, "out_features");
  auto y = torch::empty({M, N}, x.options());
  float beta = 0.f;
  if (bias.has_value()) {  // y = bias, then y += x W^T: the order torch's addmm rounds in
    TORCH_CHECK(bias->device().is_cpu() && bias->numel() == N &&
                    bias->scalar_type() == torch::kFloat32,
                "bias must be a float32 CPU tensor of out_features");
    y.copy_(bias->reshape({1, N}).expand({M, N}));
    beta = 1.f;
  }
  // MKL wants rows at least a row apart (an expanded x repeats one row at stride 0).
  const torch::Tensor a = x.stride(0) >= K ? x : x.contiguous();
  const int lda = checked_int(std::max<int64_t>(a.stride(0), K), "row stride");
  cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, M, N, K, a.data_ptr<float>(), lda,
                      packed.data_ptr<float>(), K, beta, y.data_ptr<float>(), N);
  return y;
}
