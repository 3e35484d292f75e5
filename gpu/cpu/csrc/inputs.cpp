// A decode step's flattened inputs (one new token per request) from the model runner's
// persistent batch, in one call. The runner's numpy path takes a dozen small array operations
// for the same arrays, and right after a forward, with the caches cold, each costs several
// microseconds.

#include "kernels.h"

#include <algorithm>
#include <vector>

std::vector<torch::Tensor> decode_inputs(const std::vector<int64_t>& rows,
                                         const std::vector<int64_t>& positions,
                                         torch::Tensor token_ids, torch::Tensor block_table,
                                         int64_t block_size, int64_t num_block_columns) {
  TORCH_CHECK(token_ids.device().is_cpu() && token_ids.dim() == 2 &&
                  token_ids.scalar_type() == torch::kInt64 && token_ids.is_contiguous(),
              "decode_inputs: token_ids must be a contiguous int64 CPU [rows, max_model_len]");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.dim() == 2 &&
                  block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous(),
              "decode_inputs: block_table must be a contiguous int32 CPU [rows, max_blocks]");
  TORCH_CHECK(rows.size() == positions.size(), "decode_inputs: one position per row expected");
  TORCH_CHECK(block_size > 0 && num_block_columns >= 0 &&
                  num_block_columns <= block_table.size(1),
              "decode_inputs: bad block size or block column count");
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t max_len = token_ids.size(1), table_width = block_table.size(1);
  const auto long_opts = torch::TensorOptions().dtype(torch::kInt64);
  const auto int_opts = torch::TensorOptions().dtype(torch::kInt32);
  torch::Tensor input_ids = torch::empty({n}, long_opts);
  torch::Tensor position_out = torch::empty({n}, long_opts);
  torch::Tensor slots = torch::empty({n}, long_opts);
  torch::Tensor seq_lens = torch::empty({n}, int_opts);
  torch::Tensor query_start = torch::empty({n + 1}, int_opts);
  torch::Tensor table = torch::empty({n, num_block_columns}, int_opts);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  const int32_t* blocks = block_table.data_ptr<int32_t>();
  int64_t* id_out = input_ids.data_ptr<int64_t>();
  int64_t* pos_out = position_out.data_ptr<int64_t>();
  int64_t* slot_out = slots.data_ptr<int64_t>();
  int32_t* len_out = seq_lens.data_ptr<int32_t>();
  int32_t* start_out = query_start.data_ptr<int32_t>();
  int32_t* table_out = table.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rows[i], pos = positions[i];
    TORCH_CHECK(row >= 0 && row < token_ids.size(0) && pos >= 0 && pos < max_len &&
                    pos / block_size < num_block_columns,
                "decode_inputs: row ", row, " position ", pos, " outside the batch");
    const int32_t* row_blocks = blocks + row * table_width;
    id_out[i] = ids[row * max_len + pos];
    pos_out[i] = pos;
    slot_out[i] = static_cast<int64_t>(row_blocks[pos / block_size]) * block_size +
                  pos % block_size;
    len_out[i] = static_cast<int32_t>(pos + 1);
    start_out[i] = static_cast<int32_t>(i);
    std::copy(row_blocks, row_blocks + num_block_columns, table_out + i * num_block_columns);
  }
  start_out[n] = static_cast<int32_t>(n);
  return {input_ids, position_out, slots, seq_lens, query_start, table};
}
