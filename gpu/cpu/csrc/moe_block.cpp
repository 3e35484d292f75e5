// A mixture-of-experts block of quantized experts on the CPU, as gpu/moe.py's grouped path
// computes it: the router's softmax in float32, the top-k experts (renormalised where the model
// says), each expert's gated MLP over its own rows through its PlannedLinears, the outputs
// weighted and summed in the same torch ops. A lone row (decode at concurrency 1) runs the
// projections of all its chosen experts in one dot_linear_experts call each, where their plans
// give one row to the dot kernel. With many rows, the experts whose plans give their row counts
// to the dot kernel run each projection in one dot_linear_groups call (each expert's products
// what its own call gives, bit for bit), the others one call each. The Python block calls it,
// and so does the one-call decode step (decoder.cpp): what it saves is the per-expert Python
// loop and a parallel region per expert and projection. gpt-oss's experts come with a bias per
// expert and projection, a clamped SwiGLU and the softmax after the top-k (gpu/moe.py's
// ExpertExtras, Routing): each expert's bias and activation then run over its own rows, as the
// Python path runs them, and a lone row's experts one by one.

#include "kernels.h"

#include <functional>
#include <utility>
#include <vector>

namespace {

bool dot_at_one_row(const PlannedLinear& linear) {
  return linear.quant && linear.quant->dot_packed.has_value() && linear.method(1) == kQuantDot;
}

// One projection of experts ids (each over its row of x, or over x's one row) in one call.
torch::Tensor together(const std::vector<PlannedLinear>& linears, const std::vector<int64_t>& ids,
                       const torch::Tensor& x) {
  std::vector<torch::Tensor> packed, params;
  for (int64_t e : ids) {
    packed.push_back(*linears[e].quant->dot_packed);
    params.push_back(*linears[e].quant->dot_params);
  }
  const QuantPack& first = *linears[ids[0]].quant;
  return dot_linear_experts(x, packed, params, first.bits, first.group_size, first.out_features);
}

}  // namespace

MoeBlock::MoeBlock(PlannedLinear router, std::vector<PlannedLinear> gate_up,
                   std::vector<PlannedLinear> down, int64_t top_k, bool renormalize,
                   bool float32_weights, c10::optional<torch::Tensor> gate_up_bias,
                   c10::optional<torch::Tensor> down_bias, double swiglu_limit,
                   double swiglu_alpha, bool softmax_after_topk)
    : router(std::move(router)), gate_up(std::move(gate_up)), down(std::move(down)),
      top_k(top_k), renormalize(renormalize), float32_weights(float32_weights),
      gate_up_bias(std::move(gate_up_bias)), down_bias(std::move(down_bias)),
      swiglu_limit(swiglu_limit), swiglu_alpha(swiglu_alpha),
      softmax_after_topk(softmax_after_topk) {
  const int64_t E = static_cast<int64_t>(this->gate_up.size());
  TORCH_CHECK(E > 0 && this->gate_up.size() == this->down.size(),
              "a gate/up and a down projection for every expert");
  TORCH_CHECK(top_k > 0 && top_k <= E, "top_k must be between 1 and the number of experts");
  for (const PlannedLinear& linear : this->gate_up)
    TORCH_CHECK(linear.quant, "the experts must be quantized linears");
  for (const auto* bias : {&this->gate_up_bias, &this->down_bias})
    TORCH_CHECK(!bias->has_value() || ((*bias)->dim() == 2 && (*bias)->size(0) == E),
                "expert biases must be [experts, out_features]");
}

torch::Tensor MoeBlock::operator()(const torch::Tensor& input) const {
  const torch::Tensor x = input.contiguous();
  torch::Tensor weights, ids;
  if (softmax_after_topk) {  // gpt-oss: the top-k logits, then their softmax in their dtype
    std::tie(weights, ids) = at::topk(router(x), top_k, -1);
    weights = at::softmax(weights, -1, weights.scalar_type());
  } else {
    std::tie(weights, ids) = at::topk(at::softmax(router(x), -1, at::kFloat), top_k, -1);
  }
  if (renormalize) weights = weights / weights.sum(-1, true);
  const int64_t tokens = x.size(0), hidden = x.size(1);
  torch::Tensor outputs = tokens == 1 ? lone_row(x, ids) : grouped(x, ids);
  torch::Tensor scale = float32_weights ? weights : weights.to(x.scalar_type());
  return (outputs.view({tokens, top_k, hidden}) * scale.unsqueeze(-1))
      .to(x.scalar_type())
      .sum(1);
}

bool MoeBlock::plain() const {
  return !gate_up_bias.has_value() && !down_bias.has_value() && swiglu_limit == 0;
}

torch::Tensor MoeBlock::activation(const torch::Tensor& gate_up_rows) const {
  if (swiglu_limit == 0) return silu_and_mul(gate_up_rows);
  const std::vector<torch::Tensor> halves = gate_up_rows.chunk(2, -1);  // as clamped_swiglu
  const torch::Tensor gate = at::clamp(halves[0], c10::nullopt, swiglu_limit);
  const torch::Tensor up = at::clamp(halves[1], -swiglu_limit, swiglu_limit);
  return (up + 1) * (gate * at::sigmoid(gate * swiglu_alpha));
}

torch::Tensor MoeBlock::biased(const torch::Tensor& y, const c10::optional<torch::Tensor>& bias,
                               int64_t e) const {
  return bias.has_value() ? y + (*bias)[e] : y;
}

torch::Tensor MoeBlock::expert(const torch::Tensor& rows, int64_t e) const {
  return biased(down[e](activation(biased(gate_up[e](rows), gate_up_bias, e))), down_bias, e);
}

torch::Tensor MoeBlock::lone_row(const torch::Tensor& x, const torch::Tensor& ids) const {
  const torch::Tensor chosen = ids.reshape(-1).contiguous();
  const int64_t* p = chosen.data_ptr<int64_t>();
  const std::vector<int64_t> e(p, p + chosen.numel());
  bool on_dot = true;
  for (int64_t i : e) on_dot = on_dot && dot_at_one_row(gate_up[i]) && dot_at_one_row(down[i]);
  if (on_dot && plain()) return together(down, e, silu_and_mul(together(gate_up, e, x)));
  std::vector<torch::Tensor> outputs;
  for (int64_t i : e) outputs.push_back(expert(x, i));
  return at::cat(outputs);
}

torch::Tensor MoeBlock::grouped(const torch::Tensor& x, const torch::Tensor& ids) const {
  const torch::Tensor flat = ids.reshape(-1);
  const torch::Tensor order = at::argsort(flat, /*stable=*/true, 0, false);
  const torch::Tensor bins =
      at::bincount(flat, {}, static_cast<int64_t>(gate_up.size())).contiguous();
  const int64_t* n = bins.data_ptr<int64_t>();
  const std::vector<int64_t> counts(n, n + bins.numel());
  const torch::Tensor rows = x.index_select(0, at::floor_divide(order, top_k));
  const torch::Tensor up_out = project(gate_up, rows, counts);
  torch::Tensor sorted_out;
  if (plain()) {
    sorted_out = project(down, silu_and_mul(up_out), counts);
  } else {  // each expert's bias and activation over its own rows, as the Python path
    const torch::Tensor hidden =
        each_expert(up_out, counts, [&](const torch::Tensor& y, int64_t e) {
          return activation(biased(y, gate_up_bias, e));
        });
    sorted_out = each_expert(project(down, hidden, counts), counts,
                             [&](const torch::Tensor& y, int64_t e) {
                               return biased(y, down_bias, e);
                             });
  }
  return at::empty_like(sorted_out).index_copy_(0, order, sorted_out);
}

torch::Tensor MoeBlock::each_expert(
    const torch::Tensor& rows, const std::vector<int64_t>& counts,
    const std::function<torch::Tensor(const torch::Tensor&, int64_t)>& f) const {
  std::vector<torch::Tensor> parts;
  for (int64_t e = 0, start = 0; e < static_cast<int64_t>(counts.size()); start += counts[e++])
    if (counts[e]) parts.push_back(f(rows.narrow(0, start, counts[e]), e));
  return at::cat(parts);
}

torch::Tensor MoeBlock::project(const std::vector<PlannedLinear>& linears,
                                const torch::Tensor& rows,
                                const std::vector<int64_t>& counts) const {
  std::vector<torch::Tensor> packed, params;
  std::vector<int64_t> starts, sizes;
  std::vector<std::pair<int64_t, int64_t>> others;  // (expert, start): plans give them elsewhere
  for (int64_t e = 0, start = 0; e < static_cast<int64_t>(counts.size()); start += counts[e++]) {
    if (counts[e] == 0) continue;
    const PlannedLinear& linear = linears[e];
    if (linear.quant->dot_packed.has_value() && linear.method(counts[e]) == kQuantDot) {
      packed.push_back(*linear.quant->dot_packed);
      params.push_back(*linear.quant->dot_params);
      starts.push_back(start);
      sizes.push_back(counts[e]);
    } else {
      others.emplace_back(e, start);
    }
  }
  const QuantPack& first = *linears[0].quant;
  torch::Tensor y = packed.empty()  // none on the dot kernel (which may not take the shape)
                        ? at::empty({rows.size(0), first.out_features}, rows.options())
                        : dot_linear_groups(rows, packed, params, starts, sizes, first.bits,
                                            first.group_size, first.out_features);
  for (const auto& [e, start] : others)
    y.narrow(0, start, counts[e]).copy_(linears[e](rows.narrow(0, start, counts[e])));
  return y;
}

void bind_moe_block(py::module& m) {
  py::class_<MoeBlock>(m, "MoeBlock")
      .def(py::init<PlannedLinear, std::vector<PlannedLinear>, std::vector<PlannedLinear>,
                    int64_t, bool, bool, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, double, double, bool>(),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"),
           py::arg("renormalize"), py::arg("float32_weights"),
           py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none(),
           py::arg("swiglu_limit") = 0.0, py::arg("swiglu_alpha") = 1.702,
           py::arg("softmax_after_topk") = false)
      .def("__call__", &MoeBlock::operator(), py::call_guard<py::gil_scoped_release>(),
           "the block's output [tokens, hidden] for x [tokens, hidden]");
}
