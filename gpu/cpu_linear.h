// The float32 linear layers of cpu_linear.cpp, bound into the kernels module by cpu_kernels.cpp.
#pragma once

#include <torch/extension.h>

// W [out_features, in_features] -> the panels packed_linear reads.
torch::Tensor pack_linear_weight(torch::Tensor weight);

// y = x W^T + b for x [rows, in_features], from pack_linear_weight's panels.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias);
