// Kernels defined in their own source files and bound into the module by cpu_kernels.cpp.
#pragma once

#include <torch/extension.h>

// cpu_linear.cpp: W [out_features, in_features] float32 -> the panels packed_linear reads.
torch::Tensor pack_linear_weight(torch::Tensor weight);

// cpu_linear.cpp: y = x W^T + b for x [rows, in_features], from pack_linear_weight's panels.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias);

// cpu_attention.cpp: whether decode_attention takes this head_dim.
bool decode_attention_supports(int64_t head_dim);

// cpu_attention.cpp: out[query_rows[i]] = softmax(scale * q.K) V over request requests[i]'s
// paged context, for every decode row i.
void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                      torch::Tensor value_cache, torch::Tensor block_table,
                      torch::Tensor seq_lens, torch::Tensor requests, torch::Tensor query_rows,
                      double scale);

// cpu_activation.cpp: SiLU(x[..., :n]) * x[..., n:] for x [..., 2n], rounded as torch's two ops.
torch::Tensor silu_and_mul(torch::Tensor x);

// cpu_argmax.cpp: each row's argmax of a float32 [rows, width], with torch's max(dim=-1) rules.
torch::Tensor argmax_rows(torch::Tensor x);
