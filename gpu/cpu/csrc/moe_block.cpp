// A mixture-of-experts block of quantized experts on the CPU, as gpu/moe.py's grouped path
// computes it: the router's softmax in float32, the top-k experts (renormalised where the model
// says), each expert's gated MLP over its own rows through its PlannedLinears, the outputs
// weighted and summed in the same torch ops. A lone row (decode at concurrency 1) runs the
// projections of all its chosen experts in one dot_linear_experts call each, where their plans
// give one row to the dot kernel. The Python block calls it, and so does the one-call decode
// step (decoder.cpp): what it saves is the per-expert Python loop of a step with many rows.

#include "kernels.h"

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
                   bool float32_weights)
    : router(std::move(router)), gate_up(std::move(gate_up)), down(std::move(down)),
      top_k(top_k), renormalize(renormalize), float32_weights(float32_weights) {
  TORCH_CHECK(!this->gate_up.empty() && this->gate_up.size() == this->down.size(),
              "a gate/up and a down projection for every expert");
  TORCH_CHECK(top_k > 0 && top_k <= static_cast<int64_t>(this->gate_up.size()),
              "top_k must be between 1 and the number of experts");
  for (const PlannedLinear& linear : this->gate_up)
    TORCH_CHECK(linear.quant, "the experts must be quantized linears");
}

torch::Tensor MoeBlock::operator()(const torch::Tensor& input) const {
  const torch::Tensor x = input.contiguous();
  torch::Tensor weights, ids;
  std::tie(weights, ids) = at::topk(at::softmax(router(x), -1, at::kFloat), top_k, -1);
  if (renormalize) weights = weights / weights.sum(-1, true);
  const int64_t tokens = x.size(0), hidden = x.size(1);
  torch::Tensor outputs = tokens == 1 ? lone_row(x, ids) : grouped(x, ids);
  torch::Tensor scale = float32_weights ? weights : weights.to(x.scalar_type());
  return (outputs.view({tokens, top_k, hidden}) * scale.unsqueeze(-1))
      .to(x.scalar_type())
      .sum(1);
}

torch::Tensor MoeBlock::expert(const torch::Tensor& rows, int64_t e) const {
  return down[e](silu_and_mul(gate_up[e](rows)));
}

torch::Tensor MoeBlock::lone_row(const torch::Tensor& x, const torch::Tensor& ids) const {
  const torch::Tensor chosen = ids.reshape(-1).contiguous();
  const int64_t* p = chosen.data_ptr<int64_t>();
  const std::vector<int64_t> e(p, p + chosen.numel());
  bool on_dot = true;
  for (int64_t i : e) on_dot = on_dot && dot_at_one_row(gate_up[i]) && dot_at_one_row(down[i]);
  if (on_dot) return together(down, e, silu_and_mul(together(gate_up, e, x)));
  std::vector<torch::Tensor> outputs;
  for (int64_t i : e) outputs.push_back(expert(x, i));
  return at::cat(outputs);
}

torch::Tensor MoeBlock::grouped(const torch::Tensor& x, const torch::Tensor& ids) const {
  const torch::Tensor flat = ids.reshape(-1);
  const torch::Tensor order = at::argsort(flat, /*stable=*/true, 0, false);
  const torch::Tensor counts =
      at::bincount(flat, {}, static_cast<int64_t>(gate_up.size())).contiguous();
  const torch::Tensor rows = x.index_select(0, at::floor_divide(order, top_k));
  torch::Tensor sorted_out = at::empty({flat.numel(), x.size(1)}, x.options());
  const int64_t* n = counts.data_ptr<int64_t>();
  for (int64_t e = 0, start = 0; e < counts.numel(); start += n[e], ++e)
    if (n[e]) sorted_out.narrow(0, start, n[e]).copy_(expert(rows.narrow(0, start, n[e]), e));
  return at::empty_like(sorted_out).index_copy_(0, order, sorted_out);
}

void bind_moe_block(py::module& m) {
  py::class_<MoeBlock>(m, "MoeBlock")
      .def(py::init<PlannedLinear, std::vector<PlannedLinear>, std::vector<PlannedLinear>,
                    int64_t, bool, bool>(),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"),
           py::arg("renormalize"), py::arg("float32_weights"))
      .def("__call__", &MoeBlock::operator(), py::call_guard<py::gil_scoped_release>(),
           "the block's output [tokens, hidden] for x [tokens, hidden]");
}
