// The index of each row's largest value in a float32 [rows, width] tensor, as torch's
// max(dim=-1).indices gives it: the first index among equal maxima, and the first NaN's index
// where a row has one. torch runs it as a scalar loop; here each lane of a register keeps its own
// maximum and index over the row, and the lanes are compared once at the end.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

using tidal::vnative;

namespace {

// One register of the target: GCC lowers a vec16's selects lane by lane where a vec16 spans
// two AVX2 registers.
constexpr int64_t kLanes = tidal::kNativeLanes;
typedef tidal::Vectors<kLanes>::i ivnative;

int64_t first_nan(const float* row, int64_t width) {
  for (int64_t j = 0; j < width; ++j)
    if (std::isnan(row[j])) return j;
  return -1;
}

int64_t row_argmax(const float* row, int64_t width) {
  if (width < kLanes) {
    int64_t best = 0;
    for (int64_t j = 1; j < width; ++j)
      if (row[j] > row[best] || (std::isnan(row[j]) && !std::isnan(row[best]))) best = j;
    return best;
  }
  vnative best = tidal::load<vnative>(row);
  ivnative index, lane_index;
  for (int i = 0; i < kLanes; ++i) index[i] = lane_index[i] = i;
  ivnative nan = best != best;
  const int64_t vector_end = width / kLanes * kLanes;
  for (int64_t j = kLanes; j < vector_end; j += kLanes) {
    const vnative v = tidal::load<vnative>(row + j);
    const ivnative greater = v > best;  // strict: each lane keeps its first maximum
    best = greater ? v : best;
    index = greater ? lane_index + static_cast<int32_t>(j) : index;
    nan |= v != v;
  }
  for (int i = 0; i < kLanes; ++i)
    if (nan[i]) return first_nan(row, width);
  int64_t arg = index[0];
  float value = best[0];
  for (int i = 1; i < kLanes; ++i)
    if (best[i] > value || (best[i] == value && index[i] < arg)) {
      value = best[i];
      arg = index[i];
    }
  for (int64_t j = vector_end; j < width; ++j) {  // later than every lane's: strict > only
    if (std::isnan(row[j])) return j;
    if (row[j] > value) {
      value = row[j];
      arg = j;
    }
  }
  return arg;
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat32 &&
                  x.stride(1) == 1 && x.size(1) > 0 && x.size(1) < (int64_t{1} << 31),
              "argmax_rows: a float32 CPU tensor [rows, width] with contiguous rows expected");
  torch::Tensor out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  const float* data = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t width = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 65536 / width), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = row_argmax(data + r * stride, width);
  });
  return out;
}
