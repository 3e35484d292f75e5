// A linear layer that runs each call on the implementation its plan names for that many rows
// (gpu/cpu/selector.py times them on the host): tidal's panel GEMM (linear.cpp), MKL's packed
// GEMM (mkl_linear.cpp), oneDNN's packed linear, or torch's own at::linear; for a quantized
// weight, tidal's quant_linear.cpp or dot_linear.cpp, torch's fused int8/int4 ops or the
// dequantized weight. The
// Python layers (PackedLinear, QuantLinear) and the one-call decode step (decoder.cpp) both
// call it, so the two follow one plan.

#include "kernels.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <string>

namespace {

// torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], ""), the call torch
// makes for a weight reordered by torch.ops.mkldnn._reorder_linear_weight.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::List<c10::optional<c10::Scalar>> scalars;
  scalars.push_back(c10::nullopt);
  torch::jit::Stack stack{x, weight, bias, std::string("none"), scalars, std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

const torch::Tensor& need(const c10::optional<torch::Tensor>& t, const char* what) {
  TORCH_CHECK(t.has_value(), "the plan names ", what, " but that layout was not packed");
  return *t;
}

}  // namespace

PlannedLinear::PlannedLinear(int64_t out_features, c10::optional<torch::Tensor> bias,
                             c10::optional<torch::Tensor> panels,
                             c10::optional<torch::Tensor> mkl_packed,
                             c10::optional<torch::Tensor> onednn_packed,
                             c10::optional<torch::Tensor> plain, std::vector<int64_t> by_rows)
    : out_features(out_features), bias(std::move(bias)), panels(std::move(panels)),
      mkl_packed(std::move(mkl_packed)), onednn_packed(std::move(onednn_packed)),
      plain(std::move(plain)), by_rows(std::move(by_rows)) {
  TORCH_CHECK(!this->by_rows.empty(), "a plan needs at least one choice");
  for (int64_t m : this->by_rows)
    TORCH_CHECK(m >= kPanels && m <= kTorch, "unknown linear method ", m);
}

PlannedLinear::PlannedLinear(c10::optional<torch::Tensor> bias, const QuantPack& quant,
                             std::vector<int64_t> by_rows)
    : out_features(quant.out_features), bias(std::move(bias)),
      quant(std::make_shared<const QuantPack>(quant)), by_rows(std::move(by_rows)) {
  TORCH_CHECK(!this->by_rows.empty(), "a plan needs at least one choice");
  for (int64_t m : this->by_rows)
    TORCH_CHECK(m >= kQuantTidal && m <= kQuantDot, "unknown quantized linear method ", m);
}

int64_t PlannedLinear::method(int64_t rows) const {
  const size_t i = std::min<size_t>(static_cast<size_t>(rows), by_rows.size() - 1);
  return by_rows[i];
}

torch::Tensor PlannedLinear::operator()(const torch::Tensor& x) const {
  const int64_t m = method(x.size(0));
  if (quant) return (*quant)(m, x, bias);
  switch (m) {
    case kPanels:
      return packed_linear(x, need(panels, "panels"), out_features, bias);
    case kMkl:
      return mkl_linear(x, need(mkl_packed, "MKL's pack"), out_features, bias);
    case kOneDnn:
      return onednn_linear(x, need(onednn_packed, "oneDNN's pack"), bias);
    default:
      return at::linear(x, need(plain, "a plain weight"), bias);
  }
}

void bind_planned_linear(py::module& m) {
  py::class_<QuantPack>(m, "QuantPack")
      .def(py::init([](int64_t bits, int64_t group_size, int64_t out_features,
                       c10::optional<torch::Tensor> packed, c10::optional<torch::Tensor> params,
                       c10::optional<torch::Tensor> aten_weight,
                       c10::optional<torch::Tensor> aten_scales, c10::optional<torch::Tensor> q,
                       c10::optional<torch::Tensor> scales,
                       c10::optional<torch::Tensor> offsets,
                       c10::optional<torch::Tensor> dot_packed,
                       c10::optional<torch::Tensor> dot_params) {
             return QuantPack{bits, group_size, out_features, packed, params, aten_weight,
                              aten_scales, q, scales, offsets, dot_packed, dot_params};
           }),
           py::arg("bits"), py::arg("group_size"), py::arg("out_features"), py::arg("packed"),
           py::arg("params"), py::arg("aten_weight"), py::arg("aten_scales"), py::arg("q"),
           py::arg("scales"), py::arg("offsets"),
           py::arg("dot_packed") = py::none(), py::arg("dot_params") = py::none())
      .def("__call__", &QuantPack::operator(), py::call_guard<py::gil_scoped_release>(),
           "y = x W^T + b by method (kQuantTidal, kQuantAten, kQuantTorch or kQuantDot)");
  py::class_<PlannedLinear>(m, "PlannedLinear")
      .def(py::init<int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, std::vector<int64_t>>(),
           py::arg("out_features"), py::arg("bias"), py::arg("panels"), py::arg("mkl_packed"),
           py::arg("onednn_packed"), py::arg("plain"), py::arg("by_rows"))
      .def(py::init<c10::optional<torch::Tensor>, const QuantPack&, std::vector<int64_t>>(),
           py::arg("bias"), py::arg("quant"), py::arg("by_rows"))
      .def("__call__", &PlannedLinear::operator(), py::call_guard<py::gil_scoped_release>(),
           "y = x W^T + b for x [rows, in_features], by the plan's method for that many rows")
      .def("method", &PlannedLinear::method, "the method index the plan names for rows");
}
