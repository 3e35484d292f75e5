// A Llama-family decoder's decode step (one new token per request) in one call, for float32
// and bfloat16 models on the CPU. It calls the kernels the Python model calls, in the same
// order and by the same plans (its linears are the model's PlannedLinears), so its hidden
// states are bitwise the same. What it removes is the interpreter between the kernels, a good
// part of a small model's step, and it holds no GIL from start to end, so a server's event
// loop runs its Python while the step computes instead of between the step's kernels. An int8
// KV cache (gpu/attention/kv_quant.py) takes the same path: each layer then has four cache
// tensors, the int8 keys and values and their scales, which the cache write and decode
// attention take as the Python model's do. Qwen3's per-head query and key norms run between the
// qkv projection and the rotary embedding, as in the Python model. A layer's feed-forward block
// is a dense gated MLP or a mixture of quantized experts (moe_block.cpp: Qwen3-MoE, Mixtral),
// the same block object the Python model calls.

#include <torch/extension.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

struct Layer {
  torch::Tensor input_norm, post_norm;
  PlannedLinear qkv, o;
  std::vector<PlannedLinear> mlp;        // a dense MLP's gate/up and down, or none
  std::shared_ptr<const MoeBlock> moe;   // else a mixture of experts (moe_block.cpp)
  c10::optional<torch::Tensor> q_norm, k_norm;  // per-head norms (Qwen3), or none

  torch::Tensor feed_forward(const torch::Tensor& h) const {
    return moe ? (*moe)(h) : mlp[1](silu_and_mul(mlp[0](h)));
  }
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(torch::Tensor embedding, torch::Tensor final_norm, torch::Tensor cos,
              torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double eps, double scale)
      : embedding_(embedding), final_norm_(final_norm), cos_(cos), sin_(sin),
        num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, const PlannedLinear& qkv,
                 const PlannedLinear& o, const PlannedLinear& gate_up, const PlannedLinear& down,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "a query norm and a key norm, or neither");
    layers_.push_back(
        Layer{input_norm, post_norm, qkv, o, {gate_up, down}, nullptr, q_norm, k_norm});
  }

  // A layer whose feed-forward block is a mixture of experts.
  void add_moe_layer(torch::Tensor input_norm, torch::Tensor post_norm, const PlannedLinear& qkv,
                     const PlannedLinear& o, const MoeBlock& moe,
                     c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "a query norm and a key norm, or neither");
    layers_.push_back(Layer{input_norm, post_norm, qkv, o, {},
                            std::make_shared<const MoeBlock>(moe), q_norm, k_norm});
  }

  // Final normalised hidden states [tokens, hidden] of a step whose every request has one
  // query row; kv_caches is (key, value) of each layer in turn, or for an int8 cache (key,
  // value, key scales, value scales).
  torch::Tensor forward(torch::Tensor input_ids, torch::Tensor positions,
                        const std::vector<torch::Tensor>& kv_caches, torch::Tensor slot_mapping,
                        torch::Tensor block_table, torch::Tensor seq_lens,
                        torch::Tensor requests, torch::Tensor query_rows) const {
    const size_t per_layer = layers_.empty() ? 2 : kv_caches.size() / layers_.size();
    TORCH_CHECK((per_layer == 2 || per_layer == 4) &&
                    kv_caches.size() == per_layer * layers_.size(),
                "a key and a value cache per layer (with their scales for an int8 cache)");
    torch::Tensor x = embedding_.index_select(0, input_ids), delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      torch::Tensor h;
      if (i == 0) {
        h = rms_norm(x, layer.input_norm, eps_);
      } else {
        std::tie(x, h) = add_rms_norm(x, delta, layer.input_norm, eps_);
      }
      const torch::Tensor* caches = kv_caches.data() + per_layer * i;
      torch::Tensor attn = attention(layer, h, positions, caches, per_layer == 4, slot_mapping,
                                     block_table, seq_lens, requests, query_rows);
      std::tie(x, h) = add_rms_norm(x, attn, layer.post_norm, eps_);
      delta = layer.feed_forward(h);
    }
    return std::get<1>(add_rms_norm(x, delta, final_norm_, eps_));
  }

  // A draft model's greedy guesses (gpu/draft_runner.py) in one call, the interpreter out of
  // its loop. First the rows input_ids at positions, each a one-token query of request
  // row_requests[i] over that request's blocks (block_table [requests, width]); then each
  // request guess_requests[g] takes the greedy token after its row last_rows[g], and steps - 1
  // more, each the greedy token after the one before, one position on. Returns [guesses,
  // steps] int64.
  torch::Tensor propose(torch::Tensor input_ids, torch::Tensor positions,
                        const std::vector<torch::Tensor>& kv_caches, torch::Tensor block_table,
                        torch::Tensor row_requests, torch::Tensor guess_requests,
                        torch::Tensor last_rows, const PlannedLinear& head, int64_t steps,
                        int64_t block_size) const {
    TORCH_CHECK(steps > 0 && block_size > 0 && block_table.scalar_type() == torch::kInt32 &&
                    positions.scalar_type() == torch::kInt64,
                "propose: steps > 0, an int32 block table and int64 positions");
    torch::Tensor out = torch::empty({last_rows.size(0), steps}, positions.options());
    torch::Tensor hidden = one_token_rows(input_ids, positions, kv_caches,
                                          block_table.index_select(0, row_requests), block_size);
    torch::Tensor guess = greedy(head, hidden.index_select(0, last_rows));
    out.select(1, 0).copy_(guess);
    const torch::Tensor table = block_table.index_select(0, guess_requests);
    torch::Tensor position = positions.index_select(0, last_rows);
    for (int64_t j = 1; j < steps; ++j) {
      position = position + 1;
      guess = greedy(head, one_token_rows(guess, position, kv_caches, table, block_size));
      out.select(1, j).copy_(guess);
    }
    return out;
  }

 private:
  // forward() over rows that are each a request of one token at its position, row i over
  // table's row i.
  torch::Tensor one_token_rows(const torch::Tensor& ids, const torch::Tensor& positions,
                               const std::vector<torch::Tensor>& kv_caches,
                               const torch::Tensor& table, int64_t block_size) const {
    const int64_t n = ids.size(0);
    const torch::Tensor pos = positions.contiguous(), blocks = table.contiguous();
    torch::Tensor slots = torch::empty({n}, pos.options());
    torch::Tensor seq_lens = torch::empty({n}, blocks.options());
    const int64_t* p = pos.data_ptr<int64_t>();
    const int32_t* t = blocks.data_ptr<int32_t>();
    int64_t* slot = slots.data_ptr<int64_t>();
    int32_t* len = seq_lens.data_ptr<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(p[i] >= 0 && p[i] / block_size < blocks.size(1),
                  "propose: a position past its request's block table");
      const int64_t block = t[i * blocks.size(1) + p[i] / block_size];
      slot[i] = block * block_size + p[i] % block_size;
      len[i] = static_cast<int32_t>(p[i] + 1);
    }
    const torch::Tensor rows = torch::arange(n, pos.options());
    return forward(ids, pos, kv_caches, slots, blocks, seq_lens, rows, rows);
  }

  // Each row's greedy token: the head's logits' argmax (bfloat16 logits widened exactly).
  static torch::Tensor greedy(const PlannedLinear& head, const torch::Tensor& hidden) {
    const torch::Tensor logits = head(hidden.contiguous());
    return argmax_rows(logits.scalar_type() == torch::kFloat32 ? logits
                                                                : logits.to(torch::kFloat32));
  }

  // caches: the layer's key and value caches, then their scales where `scaled` (int8).
  torch::Tensor attention(const Layer& layer, const torch::Tensor& h,
                          const torch::Tensor& positions, const torch::Tensor* caches,
                          bool scaled, const torch::Tensor& slot_mapping,
                          const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                          const torch::Tensor& requests, const torch::Tensor& query_rows) const {
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor qkv = layer.qkv(h);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads_, head_dim_});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, num_kv_heads_, head_dim_});
    if (layer.q_norm.has_value()) {  // on copies of the views, as the Python model's norms
      q = rms_norm(q.contiguous(), *layer.q_norm, eps_);
      k = rms_norm(k.contiguous(), *layer.k_norm, eps_);
    }
    rotary_embedding(q, k, cos_, sin_, positions);
    c10::optional<torch::Tensor> k_scale, v_scale;
    if (scaled) {
      k_scale = caches[2];
      v_scale = caches[3];
    }
    write_kv(k, v, caches[0], caches[1], slot_mapping, k_scale, v_scale);
    torch::Tensor out = torch::empty({q.size(0), num_heads_, head_dim_}, q.options());
    decode_attention(out, q, caches[0], caches[1], block_table, seq_lens, requests, query_rows,
                     scale_, k_scale, v_scale);
    return layer.o(out.view({-1, q_size}));
  }

  torch::Tensor embedding_, final_norm_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

void bind_decode_stack(py::module& m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                    int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_moe_layer", &DecodeStack::add_moe_layer)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("propose", &DecodeStack::propose, py::call_guard<py::gil_scoped_release>());
}
