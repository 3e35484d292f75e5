// Kernels defined in their own source files and bound into the module by kernels.cpp, and
// kernels.cpp's own, which decoder.cpp calls too.
#pragma once

#include <torch/extension.h>

#include <functional>
#include <memory>
#include <tuple>
#include <vector>

// kernels.cpp: RMSNorm of a contiguous x's rows, normalised in float32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

// kernels.cpp: (x + delta, RMSNorm(x + delta)) in one pass.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta,
                                                      torch::Tensor weight, double eps);

// kernels.cpp: rotate-half RoPE of query and key [tokens, heads, head_dim], in place.
void rotary_embedding(torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                      torch::Tensor sin, torch::Tensor positions);

// kernels.cpp: key/value rows into the paged caches at their slots (-1: skipped); into an int8
// cache quantized per head vector, with the scales into k_scale/v_scale.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slot_mapping,
              c10::optional<torch::Tensor> k_scale = c10::nullopt,
              c10::optional<torch::Tensor> v_scale = c10::nullopt);

// linear.cpp: W [out_features, in_features] float32 -> the panels packed_linear reads.
torch::Tensor pack_linear_weight(torch::Tensor weight);

// linear.cpp: y = x W^T + b for x [rows, in_features], from pack_linear_weight's panels.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                            c10::optional<torch::Tensor> bias);

// linear.cpp: the columns in one panel of pack_linear_weight's layout (it depends on the ISA
// the kernels were built for).
int64_t linear_panel_width();

// mkl_linear.cpp: W [out_features, in_features] float32 -> MKL's packed form of W^T, or
// None where torch has no MKL.
c10::optional<torch::Tensor> mkl_pack_linear_weight(torch::Tensor weight);

// mkl_linear.cpp: y = x W^T + b by MKL over its packed W^T (the pack carries no shape to check
// against x).
torch::Tensor mkl_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                         c10::optional<torch::Tensor> bias);

// quant_linear.cpp: (floats in one register, output rows per item) of quant_linear's layout.
std::vector<int64_t> quant_linear_tile();

// quant_linear.cpp: whether quant_linear takes bits-bit values in groups of group_size.
bool quant_linear_supports(int64_t bits, int64_t group_size, int64_t in_features);

// quant_linear.cpp: y = x W^T + b for float32 (or bfloat16) x, W quantized in
// quant_linear_tile's layout.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor params,
                           int64_t bits, int64_t group_size, int64_t out_features,
                           c10::optional<torch::Tensor> bias);

// dot_linear.cpp: (output rows per item, inputs of x per int8 block, the bias an int8 weight's
// bytes carry: 128 or 0) of dot_linear's layout (0 rows: this build has no such kernel).
std::vector<int64_t> dot_linear_tile();

// dot_linear.cpp: whether dot_linear takes bits-bit values in groups of group_size.
bool dot_linear_supports(int64_t bits, int64_t group_size, int64_t in_features);

// dot_linear.cpp: y = x W^T + b with x's rows rounded to int8 per block and multiplied by W's
// integers (dot_linear_tile's layout, float16 params).
torch::Tensor dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor params,
                         int64_t bits, int64_t group_size, int64_t out_features,
                         c10::optional<torch::Tensor> bias);

// dot_linear.cpp: y[e] = x[e] W_e^T (x's one row for every e when it has one), the weights
// alike in shape and format, in one parallel region (a MoE block's experts for a lone row).
torch::Tensor dot_linear_experts(torch::Tensor x, std::vector<torch::Tensor> packed,
                                 std::vector<torch::Tensor> params, int64_t bits,
                                 int64_t group_size, int64_t out_features);

// dot_linear.cpp: rows starts[g] .. starts[g] + counts[g] of x times weight g, into the same
// rows of y, each weight's rows as dot_linear multiplies them, all in one parallel region (a MoE
// block's experts over their tokens' rows); rows no weight covers are left unset.
torch::Tensor dot_linear_groups(torch::Tensor x, std::vector<torch::Tensor> packed,
                                std::vector<torch::Tensor> params, std::vector<int64_t> starts,
                                std::vector<int64_t> counts, int64_t bits, int64_t group_size,
                                int64_t out_features);

// planned_linear.cpp: a linear layer whose plan names, for each row count, which packed copy
// of its weight runs it. Methods: 0 tidal's panels, 1 MKL's pack, 2 oneDNN's pack, 3 torch's
// at::linear over the plain weight [out_features, in_features]; for a quantized weight
// (QuantPack), 4 tidal's quant_linear, 5 torch's fused int8/int4 op, 6 at::linear over the
// weight dequantized for the call, 7 tidal's dot_linear.
enum LinearMethod : int64_t {
  kPanels = 0, kMkl = 1, kOneDnn = 2, kTorch = 3, kQuantTidal = 4, kQuantAten = 5, kQuantTorch = 6,
  kQuantDot = 7
};

// A quantized weight in the layouts its plan uses (gpu/quantization/linear.py's QuantPacks).
struct QuantPack {
  int64_t bits, group_size, out_features;
  c10::optional<torch::Tensor> packed, params;            // quant_linear's layout
  c10::optional<torch::Tensor> aten_weight, aten_scales;  // torch's int8pack / int4pack forms
  c10::optional<torch::Tensor> q, scales, offsets;        // the weight's own form
  c10::optional<torch::Tensor> dot_packed, dot_params;    // dot_linear's layout

  torch::Tensor operator()(int64_t method, const torch::Tensor& x,
                           const c10::optional<torch::Tensor>& bias) const;
};

struct PlannedLinear {
  int64_t out_features;
  c10::optional<torch::Tensor> bias, panels, mkl_packed, onednn_packed, plain;
  std::shared_ptr<const QuantPack> quant;  // set for a quantized weight
  std::vector<int64_t> by_rows;  // the method for 0, 1, 2, ... rows; the last for more

  PlannedLinear(int64_t out_features, c10::optional<torch::Tensor> bias,
                c10::optional<torch::Tensor> panels, c10::optional<torch::Tensor> mkl_packed,
                c10::optional<torch::Tensor> onednn_packed, c10::optional<torch::Tensor> plain,
                std::vector<int64_t> by_rows);
  PlannedLinear(c10::optional<torch::Tensor> bias, const QuantPack& quant,
                std::vector<int64_t> by_rows);
  int64_t method(int64_t rows) const;
  torch::Tensor operator()(const torch::Tensor& x) const;
};

void bind_planned_linear(py::module& m);

// moe_block.cpp: a MoE block of quantized experts (gpu/moe.py's grouped path; a lone row's
// experts in one dot_linear_experts call per projection where their plans allow).
struct MoeBlock {
  PlannedLinear router;
  std::vector<PlannedLinear> gate_up, down;  // one per expert
  int64_t top_k;
  bool renormalize, float32_weights;  // gpu/moe.py's Routing
  c10::optional<torch::Tensor> gate_up_bias, down_bias;  // gpt-oss's, [E, 2I] and [E, H]
  double swiglu_limit, swiglu_alpha;  // gpt-oss's clamped SwiGLU; limit 0: SiLU(gate) * up
  bool softmax_after_topk;            // gpt-oss's routing

  MoeBlock(PlannedLinear router, std::vector<PlannedLinear> gate_up,
           std::vector<PlannedLinear> down, int64_t top_k, bool renormalize,
           bool float32_weights, c10::optional<torch::Tensor> gate_up_bias,
           c10::optional<torch::Tensor> down_bias, double swiglu_limit, double swiglu_alpha,
           bool softmax_after_topk);
  torch::Tensor operator()(const torch::Tensor& x) const;

 private:
  bool plain() const;  // no biases, SiLU
  torch::Tensor activation(const torch::Tensor& gate_up_rows) const;
  torch::Tensor biased(const torch::Tensor& y, const c10::optional<torch::Tensor>& bias,
                       int64_t e) const;
  torch::Tensor each_expert(
      const torch::Tensor& rows, const std::vector<int64_t>& counts,
      const std::function<torch::Tensor(const torch::Tensor&, int64_t)>& f) const;
  torch::Tensor expert(const torch::Tensor& rows, int64_t e) const;
  torch::Tensor lone_row(const torch::Tensor& x, const torch::Tensor& ids) const;
  torch::Tensor grouped(const torch::Tensor& x, const torch::Tensor& ids) const;
  // rows sorted by expert (counts[e] of expert e's) through each expert's projection
  torch::Tensor project(const std::vector<PlannedLinear>& linears, const torch::Tensor& rows,
                        const std::vector<int64_t>& counts) const;
};

void bind_moe_block(py::module& m);

// attention.cpp: whether decode_attention takes this head_dim.
bool decode_attention_supports(int64_t head_dim);

// attention.cpp: out[query_rows[i]] = softmax(scale * q.K) V over request requests[i]'s
// paged context, for every decode row i; an int8 cache comes with its scales. window > 0:
// only the context's last `window` positions; softcap > 0: scores soft-capped by it; sinks
// (float32 [heads]): a logit per head that joins each row's softmax with no value (gpt-oss).
void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                      torch::Tensor value_cache, torch::Tensor block_table,
                      torch::Tensor seq_lens, torch::Tensor requests, torch::Tensor query_rows,
                      double scale, c10::optional<torch::Tensor> k_scale = c10::nullopt,
                      c10::optional<torch::Tensor> v_scale = c10::nullopt,
                      int64_t window = 0, double softcap = 0.0,
                      c10::optional<torch::Tensor> sinks = c10::nullopt);

// prefill_attention.cpp: causal attention of the query rows of every request in
// `requests` (rows query_start_loc[r]:query_start_loc[r + 1], the last ones of its context)
// over its paged context, into the same rows of out; float32 queries over a float32 cache, or
// an int8 one with its scales; decode_attention's head sizes, window, softcap and sinks.
void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor block_table,
                       torch::Tensor seq_lens, torch::Tensor query_start_loc,
                       torch::Tensor requests, double scale,
                       c10::optional<torch::Tensor> k_scale = c10::nullopt,
                       c10::optional<torch::Tensor> v_scale = c10::nullopt,
                       int64_t window = 0, double softcap = 0.0,
                       c10::optional<torch::Tensor> sinks = c10::nullopt);

// activation.cpp: SiLU(x[..., :n]) * x[..., n:] for x [..., 2n], rounded as torch's two ops.
torch::Tensor silu_and_mul(torch::Tensor x);

// argmax.cpp: each row's argmax of a float32 [rows, width], with torch's max(dim=-1) rules.
torch::Tensor argmax_rows(torch::Tensor x);

// inputs.cpp: a decode step's [input_ids, positions, slot_mapping, seq_lens (int32),
// query_start_loc (int32), block_table (int32, num_block_columns wide)] for the requests at
// `rows` of the persistent batch, each with one new token at `positions`.
std::vector<torch::Tensor> decode_inputs(const std::vector<int64_t>& rows,
                                         const std::vector<int64_t>& positions,
                                         torch::Tensor token_ids, torch::Tensor block_table,
                                         int64_t block_size, int64_t num_block_columns);

// decoder.cpp: binds DecodeStack, a float32 Llama decode step in one call.
void bind_decode_stack(py::module& m);
