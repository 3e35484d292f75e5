// Decode attention on the CPU, reading the paged KV cache in place, in one pass.
//
// Each decode row attends over its whole context: out = softmax(scale * q.K) V. Its keys and
// values are read once, straight from their blocks, a block of positions at a time, with the
// softmax kept online (a running maximum and sum per head, the partial output rescaled when the
// maximum grows), so there is no scores buffer and no separate softmax. A block's dot products
// are summed across their lanes together (tidal::sum_each) into one vector of scores. Rows are
// split over torch's threads with tidal::parallel_items; fewer rows than threads, their KV heads
// too.
//
// The kernel works in the target's own vectors (vec.h's vnative), a block being one vector's
// lanes of positions: 16 with AVX-512, 8 with AVX2. A block's partial dot products, the slice
// of the query they multiply, and the output's accumulators must fit the target's register file
// (32 registers with AVX-512, 16 with AVX2); where a head is too wide for that, the block works
// through it in slices of chunks. Written in 16-float vectors, which are two registers each with
// AVX2, the same kernel spilled its tile to the stack there and ran several times slower.
//
// While a row works on one block, the cache lines of its next are prefetched a few at a time,
// spread over the block kernel's loop: asked for all at once, they filled the core's miss
// buffers and stalled it until they arrived, so fetching and arithmetic took turns. The
// addresses are kept four lines to an entry: with one entry per line, building and reading the
// list took more instructions than the arithmetic, which showed where the cache sat in L2 or L3.
//
// bfloat16 caches of a head_dim divisible by two vectors' lanes (with AVX-512, all supported
// sizes but 80) are read two vectors of elements at a time as one vector of 32-bit words, whose
// low and high halves are the even and odd elements (PairedBf16Rows): one load and one shift or
// mask per vector of floats, where widening the halves takes four instructions.
//
// An int8 cache (gpu/attention/kv_quant.py) is read a vector of elements at a time, widened to
// float32 in registers (Int8Rows). Its scales, one per position and KV head, are applied to a
// block at once: a block's scores are multiplied lane by lane by its keys' scales, and its
// softmax weights by its values' scales before they weight the values (the softmax sums take
// the weights unscaled). The query and output stay in the model's dtype.
//
// A sliding-window layer (window > 0) attends only to the last `window` positions of a row's
// context: the row starts at the block holding the first of them, whose earlier lanes are
// masked. Soft-capping (softcap > 0) maps each score s to softcap * tanh(s / softcap) before
// the softmax. Both are runtime arguments checked once a block, so the plain path is unchanged.
//
// bench/decode_attention.py times the kernel against the torch backend; docs/cpu-backend.md
// keeps what was measured.
//
// Shapes: query/out [tokens, heads, head_dim]; key_cache/value_cache
// [blocks, block_size, kv_heads, head_dim] (int8: with k_scale/v_scale
// [blocks, block_size, kv_heads]); block_table [requests, max_blocks] int32;
// seq_lens [requests] int32; requests and query_rows [n] int64: the i-th attended row is
// request requests[i], whose query is query[query_rows[i]]. head_dim is one of those
// decode_attention_supports names. Every index is checked before any is used.

#pragma GCC optimize("fp-contract=fast")  // a * b + c as one FMA in this file only

#include "decode_rows.h"
#include "kernels.h"
#include "paged.h"
#include "parallel.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using V = tidal::vnative;
constexpr int64_t kLanes = tidal::kNativeLanes;  // positions in a block; floats in a chunk
using tidal::decode::Int8Rows;
using tidal::decode::PairedBf16Rows;
using tidal::decode::PlainRows;
using tidal::decode::Scales;
constexpr int64_t kPrefetchAhead = kLanes;  // positions between a prefetch and its use
// Registers a block kernel's pass may fill with its tile, leaving two for loads and broadcasts.
constexpr int kTileRegisters = tidal::kNativeRegisters - 2;
// Cache lines prefetched per address kept: one address per line cost more instructions than
// the arithmetic it fed where the cache was in L2 or L3.
constexpr int kLinesPerGroup = 4;
constexpr int64_t kGroupBytes = 64 * kLinesPerGroup;

void check_inputs(const torch::Tensor& out, const torch::Tensor& query,
                  const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                  const torch::Tensor& requests, const torch::Tensor& query_rows,
                  const tidal::OptionalTensor& k_scale, const tidal::OptionalTensor& v_scale) {
  tidal::check_paged_attention_inputs(out, query, key_cache, value_cache, block_table, seq_lens,
                                      k_scale, v_scale);
  for (const auto& t : {requests, query_rows})
    TORCH_CHECK(t.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(requests.scalar_type() == torch::kInt64 &&
                  query_rows.scalar_type() == torch::kInt64 && requests.is_contiguous() &&
                  query_rows.is_contiguous() && requests.numel() == query_rows.numel(),
              "requests and query_rows must be contiguous int64 of one length");
  const int64_t* req = requests.data_ptr<int64_t>();
  const int64_t* qrow = query_rows.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t num_requests = std::min(seq_lens.numel(), block_table.size(0));
  std::vector<bool> written(query.size(0));
  for (int64_t i = 0; i < requests.numel(); ++i) {
    const int64_t r = req[i];
    TORCH_CHECK(r >= 0 && r < num_requests, "request ", r, " out of range");
    TORCH_CHECK(qrow[i] >= 0 && qrow[i] < query.size(0), "query row ", qrow[i], " out of range");
    TORCH_CHECK(!written[qrow[i]], "query row ", qrow[i], " given twice");
    written[qrow[i]] = true;
    tidal::check_context(block_table, key_cache.size(0), key_cache.size(1), r, lens[r]);
  }
}

// The cache lines of positions [from, from + kLanes) (those before len), kLinesPerGroup at a time:
// where each group of every KV head's key and value rows starts, in `groups`; returns how many.
// A row whose size is not a whole number of groups has its last group run on into the next
// position's row (a prefetch past the end of a row never faults).
template <typename scalar_t>
int64_t future_groups(const scalar_t* keys, const scalar_t* values, const int64_t* offsets,
                      int64_t from, int64_t len, int64_t row_elements,
                      std::vector<const char*>& groups) {
  const int64_t bytes = row_elements * static_cast<int64_t>(sizeof(scalar_t));
  int64_t count = 0;
  for (int64_t p = from; p < std::min(from + kLanes, len); ++p) {
    const char* k = reinterpret_cast<const char*>(keys + offsets[p]);
    const char* v = reinterpret_cast<const char*>(values + offsets[p]);
    for (int64_t b = 0; b < bytes; b += kGroupBytes) {
      groups[count++] = k + b;
      groups[count++] = v + b;
    }
  }
  return count;
}

// Always inlined: GCC takes a function that only prefetches for one without side effects, and
// where a caller kept it out of line, deleted the calls.
TIDAL_INLINE void prefetch_group(const char* at) {
  for (int l = 0; l < kLinesPerGroup; ++l) __builtin_prefetch(at + 64 * l, 0, 3);
}

// Online softmax state of one query head: the running maximum, and in `acc` the output so far
// (unnormalised) in two halves summed at the end, then a vector of the sums of exp(score -
// maximum), reduced at the end.
struct HeadState {
  float max;
  float* acc;  // (2 x head_dim + kLanes) floats
};

// Groups of cache lines for one call of the block kernel to prefetch, spread over its
// positions.
struct Groups {
  const char* const* at;
  int64_t count;
};

// The largest divisor of `chunks` not above `most`: the chunks of a head one slice of a pass
// holds in registers.
constexpr int slice_of(int chunks, int most) {
  int s = chunks < most ? chunks : most;
  while (chunks % s != 0) --s;
  return s;
}

// The scores of one query head against the kLanes keys at `offsets` (lane j: key j). The
// partial dot products (one vector per key) stay in registers across the head's slices, each
// slice's query chunks beside them; with AVX-512 every supported head but 256 is one slice.
// The block's prefetches are spread over the first slice's keys.
template <int CHUNKS, typename Rows>
TIDAL_INLINE V block_scores(const float* q, const typename Rows::type* keys,
                            const int64_t* offsets, Groups fetch) {
  constexpr int kSlice = slice_of(CHUNKS, kTileRegisters - kLanes);
  V partial[kLanes];
#pragma GCC unroll 16
  for (int c0 = 0; c0 < CHUNKS; c0 += kSlice) {
    V qv[kSlice];
    for (int c = 0; c < kSlice; ++c) qv[c] = tidal::load<V>(q + (c0 + c) * kLanes);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kLanes; ++j) {
      if (c0 == 0)
        for (int64_t f = j; f < fetch.count; f += kLanes) prefetch_group(fetch.at[f]);
      const auto* k = keys + offsets[j];
      V sum = c0 == 0 ? qv[0] * Rows::chunk(k, 0) : partial[j] + qv[0] * Rows::chunk(k, c0);
      for (int c = 1; c < kSlice; ++c) sum += qv[c] * Rows::chunk(k, c0 + c);
      partial[j] = sum;
    }
  }
  return tidal::sum_each(partial);
}

// The head's accumulated output (two sums, of alternate positions, for independent FMA chains)
// scaled by `rescale`, plus the first n values at `offsets` weighted by `weights`, a slice of
// chunks at a time so that both sums of a slice stay in registers.
template <int CHUNKS, typename Rows>
TIDAL_INLINE void add_values(float* out, float rescale, V weights,
                             const typename Rows::type* values, const int64_t* offsets,
                             int64_t n) {
  constexpr int kSlice = slice_of(CHUNKS, kTileRegisters / 2);
  for (int c0 = 0; c0 < CHUNKS; c0 += kSlice) {
    V acc[2][kSlice];
    for (int c = 0; c < kSlice; ++c) {
      acc[0][c] = tidal::load<V>(out + (c0 + c) * kLanes);
      acc[1][c] = tidal::load<V>(out + (CHUNKS + c0 + c) * kLanes);
    }
    if (rescale != 1.f) {  // the maximum grew: rare once it settles
      for (int c = 0; c < kSlice; ++c) {
        acc[0][c] *= rescale;
        acc[1][c] *= rescale;
      }
    }
    const auto add = [&](int64_t j) {
      const auto* v = values + offsets[j];
      const float w = weights[j];
      for (int c = 0; c < kSlice; ++c) acc[j & 1][c] += w * Rows::chunk(v, c0 + c);
    };
    if (n == kLanes) {
#pragma GCC unroll 16
      for (int64_t j = 0; j < kLanes; ++j) add(j);
    } else {  // a row's last block: its padded lanes are skipped, as 0 * inf would be NaN
      for (int64_t j = 0; j < n; ++j) add(j);
    }
    for (int c = 0; c < kSlice; ++c) {
      tidal::store(out + (c0 + c) * kLanes, acc[0][c]);
      tidal::store(out + (CHUNKS + c0 + c) * kLanes, acc[1][c]);
    }
  }
}

// One query head over positions [p0, p0 + kLanes) (or fewer at the end; the first `skip`
// lanes masked, before a sliding window): their scores, soft-capped where softcap > 0, then
// the online-softmax update of the head's state. CHUNKS is head_dim / kLanes, fixed at compile
// time so the tiles stay in registers; `offsets` always names kLanes rows (context_offsets pads
// them). q and the state are in Rows' chunk order.
template <int CHUNKS, typename Rows>
void attend_block(const float* q, HeadState& state, const typename Rows::type* keys,
                  const typename Rows::type* values, const int64_t* offsets, int64_t n,
                  Groups fetch, Scales scales, int64_t skip, float softcap) {
  V scores = block_scores<CHUNKS, Rows>(q, keys, offsets, fetch);
  V value_scales;
  if constexpr (Rows::kScaled) {  // int8: q.k is the key's scale times q.(its int8 values)
    value_scales = tidal::load<V>(scales.v);
    scores *= tidal::load<V>(scales.k);
  }
  if (softcap > 0.f) scores = tidal::soft_cap(scores, softcap);
  for (int64_t j = 0; j < skip; ++j) scores[j] = -std::numeric_limits<float>::infinity();
  for (int64_t j = n; j < kLanes; ++j) scores[j] = -std::numeric_limits<float>::infinity();
  float* sums = state.acc + 2 * CHUNKS * kLanes;
  V weight_sums = tidal::load<V>(sums);
  const float block_max = tidal::max(scores);
  float rescale = 1.f;
  if (block_max > state.max) {  // rescale what came before
    rescale = std::exp(state.max - block_max);  // 0 on the first finite block
    weight_sums *= rescale;
    state.max = block_max;
  }
  // Scores are shifted by the maximum, or by 0 while every score so far is -inf (where
  // -inf - -inf would make every later weight NaN); an all -inf row ends as 0 / 0, as in torch.
  const float shift = state.max == -std::numeric_limits<float>::infinity() ? 0.f : state.max;
  const V weights = tidal::exp_nonpositive(scores - shift);
  tidal::store(sums, weight_sums + weights);
  if constexpr (Rows::kScaled) {  // each value weighted by its weight and its scale
    add_values<CHUNKS, Rows>(state.acc, rescale, weights * value_scales, values, offsets, n);
  } else {
    add_values<CHUNKS, Rows>(state.acc, rescale, weights, values, offsets, n);
  }
}

template <typename Rows>
using BlockKernel = void (*)(const float*, HeadState&, const typename Rows::type*,
                             const typename Rows::type*, const int64_t*, int64_t, Groups,
                             Scales, int64_t, float);

// The block kernel for head_dim, or nullptr for a size without one.
template <typename Rows>
BlockKernel<Rows> block_kernel(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_block<32 / kLanes, Rows>;
    case 64: return attend_block<64 / kLanes, Rows>;
    case 80: return attend_block<80 / kLanes, Rows>;
    case 96: return attend_block<96 / kLanes, Rows>;
    case 128: return attend_block<128 / kLanes, Rows>;
    case 256: return attend_block<256 / kLanes, Rows>;
    default: return nullptr;
  }
}

// An int8 cache's key and value scales of a block's kLanes positions (whose scales sit at
// `at`), for each KV head in turn: gathered once a block into vectors that every query head of
// the KV head's group loads, where gathering them lane by lane in each head's block kernel cost
// as much as its arithmetic.
void gather_block_scales(const float* key_scales, const float* value_scales, const int64_t* at,
                         int64_t kv_heads, float* out) {
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh, out += 2 * kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      out[j] = key_scales[at[j] + kvh];
      out[kLanes + j] = value_scales[at[j] + kvh];
    }
  }
}

// Rows: how the cache is read; scalar_t: the query's and output's element type.
template <typename Rows, typename scalar_t>
void decode_attention_kernel(torch::Tensor& out, const torch::Tensor& query,
                             const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                             const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                             const torch::Tensor& requests, const torch::Tensor& query_rows,
                             float scale, const tidal::OptionalTensor& k_scale,
                             const tidal::OptionalTensor& v_scale, int64_t window,
                             float softcap, const float* sinks) {
  using cache_t = typename Rows::type;
  const int64_t rows = requests.numel(), heads = query.size(1), dim = query.size(2);
  const int64_t group = heads / key_cache.size(2);
  const int64_t row_elements = key_cache.stride(1);  // every KV head of one position
  const BlockKernel<Rows> attend = block_kernel<Rows>(dim);
  const int64_t* req = requests.data_ptr<int64_t>();
  const int64_t* qrow = query_rows.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* keys = key_cache.data_ptr<cache_t>();
  const cache_t* values = value_cache.data_ptr<cache_t>();
  const float* key_scales = Rows::kScaled ? k_scale->data_ptr<float>() : nullptr;
  const float* value_scales = Rows::kScaled ? v_scale->data_ptr<float>() : nullptr;
  scalar_t* o = out.data_ptr<scalar_t>();
  std::vector<int64_t> element(dim);  // where lane l of chunk c sits in a head's row
  for (int64_t e = 0; e < dim; ++e) element[e] = Rows::element(e / kLanes, e % kLanes);

  // A task is one row's KV heads [kv0, kv1): the whole row, or where rows are fewer than
  // threads (a single stream), a part of its heads, so that every thread has work. Each head
  // takes its turn on each block of positions before the next, so the positions' cache rows
  // (the task's KV heads) are read together, front to back.
  const int64_t kv_heads = key_cache.size(2);
  const int64_t parts = std::clamp<int64_t>(at::get_num_threads() / std::max<int64_t>(rows, 1),
                                            1, kv_heads);
  tidal::parallel_items(rows * parts, [&](tidal::ItemSource& items) {
    const int64_t state_floats = 2 * dim + kLanes;
    std::vector<float> qf(heads * dim), acc(heads * state_floats);
    std::vector<HeadState> states(heads);
    std::vector<int64_t> offsets, at_scales;
    std::vector<float> block_scales(Rows::kScaled ? 2 * kv_heads * kLanes : 0);
    std::vector<const char*> groups(
        2 * kLanes * ((row_elements * sizeof(cache_t) + kGroupBytes - 1) / kGroupBytes));
    for (int64_t item; (item = items.next()) >= 0;) {
      const int64_t i = item / parts, part = item % parts;
      const int64_t kv0 = kv_heads * part / parts, kv1 = kv_heads * (part + 1) / parts;
      const int64_t h0 = kv0 * group, h1 = kv1 * group, task_elements = (kv1 - kv0) * dim;
      const int64_t r = req[i], len = lens[r];
      // a sliding window's first position, and the block it falls in
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t start = first - first % kLanes;
      const scalar_t* qi = q + qrow[i] * query.stride(0);
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t e = 0; e < dim; ++e)
          qf[h * dim + e] = static_cast<float>(qi[h * dim + element[e]]) * scale;
      std::fill(acc.begin() + h0 * state_floats, acc.begin() + h1 * state_floats, 0.f);
      for (int64_t h = h0; h < h1; ++h)
        states[h] = HeadState{-std::numeric_limits<float>::infinity(),
                              acc.data() + h * state_floats};
      tidal::context_offsets(table + r * block_table.stride(0), len, key_cache.size(1),
                      key_cache.stride(0), key_cache.stride(1), offsets);
      if (Rows::kScaled) tidal::scale_offsets(offsets, dim, at_scales);
      // the task's part of each position's cache row, for the prefetches
      const cache_t* task_keys = keys + kv0 * dim;
      const cache_t* task_values = values + kv0 * dim;
      const int64_t first_groups = future_groups(task_keys, task_values, offsets.data(), start,
                                                 len, task_elements, groups);
      for (int64_t g = 0; g < first_groups; ++g) prefetch_group(groups[g]);
      for (int64_t p0 = start; p0 < len; p0 += kLanes) {
        const int64_t n = std::min(kLanes, len - p0);
        const int64_t count = future_groups(task_keys, task_values, offsets.data(),
                                            p0 + kPrefetchAhead, len, task_elements, groups);
        const int64_t per_head = (count + h1 - h0 - 1) / (h1 - h0);
        if (Rows::kScaled) gather_block_scales(key_scales, value_scales, at_scales.data() + p0,
                                               kv_heads, block_scales.data());
        for (int64_t h = h0; h < h1; ++h) {
          const int64_t head_offset = (h / group) * dim;
          const int64_t head_first = std::min(count, (h - h0) * per_head);
          const float* kv_scales = block_scales.data() + 2 * (h / group) * kLanes;
          const Scales head_scales{kv_scales, kv_scales + kLanes};
          attend(qf.data() + h * dim, states[h], keys + head_offset, values + head_offset,
                 offsets.data() + p0, n,
                 Groups{groups.data() + head_first, std::min(count, head_first + per_head) -
                                                        head_first},
                 head_scales, std::max<int64_t>(0, first - p0), softcap);
        }
      }
      scalar_t* oi = o + qrow[i] * out.stride(0);
      for (int64_t h = h0; h < h1; ++h) {
        const float* a = states[h].acc;
        float total = tidal::sum(tidal::load<V>(a + 2 * dim));
        // a sink is a logit with no value: it joins the softmax's sum only
        if (sinks != nullptr) total += std::exp(sinks[h] - states[h].max);
        for (int64_t e = 0; e < dim; ++e)
          oi[h * dim + element[e]] = static_cast<scalar_t>((a[e] + a[dim + e]) / total);
      }
    }
  });
}

}  // namespace

bool decode_attention_supports(int64_t head_dim) {
  return block_kernel<PlainRows<float>>(head_dim) != nullptr;
}

void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                      torch::Tensor value_cache, torch::Tensor block_table,
                      torch::Tensor seq_lens, torch::Tensor requests, torch::Tensor query_rows,
                      double scale, c10::optional<torch::Tensor> k_scale,
                      c10::optional<torch::Tensor> v_scale, int64_t window, double softcap,
                      c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  check_inputs(out, query, key_cache, value_cache, block_table, seq_lens, requests, query_rows,
               k_scale, v_scale);
  const float* sink = tidal::sink_logits(sinks, query.size(1));
  const auto run = [&](auto rows, auto element) {
    decode_attention_kernel<decltype(rows), decltype(element)>(
        out, query, key_cache, value_cache, block_table, seq_lens, requests, query_rows,
        static_cast<float>(scale), k_scale, v_scale, window, static_cast<float>(softcap),
        sink);
  };
  const bool int8 = key_cache.scalar_type() == torch::kInt8;
  switch (query.scalar_type()) {
    case at::ScalarType::Float:
      return int8 ? run(Int8Rows{}, float{}) : run(PlainRows<float>{}, float{});
    case at::ScalarType::BFloat16:
      if (int8) return run(Int8Rows{}, c10::BFloat16{});
      if (query.size(2) % (2 * kLanes) == 0) return run(PairedBf16Rows{}, c10::BFloat16{});
      return run(PlainRows<c10::BFloat16>{}, c10::BFloat16{});
    case at::ScalarType::Half:
      return int8 ? run(Int8Rows{}, c10::Half{}) : run(PlainRows<c10::Half>{}, c10::Half{});
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16 expected");
  }
}
