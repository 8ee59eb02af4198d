#include "core/kernels/materialized_sdpa.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/fork_grain.h"
#include "core/kernels/primitives.h"
#include "core/kernels/row_statistics.h"
#include "core/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"

// The attention of a chunk of n sequences, S queries and T keys each, with
// G = Hq / Hkv query heads per key/value head, viewed GQA-style so that one
// K/V head serves its G query heads without a copy:
//
//   scores [n, Hkv, G*S, T] = Q [n, Hkv, G*S, hd] x K^T [n, Hkv, hd, T] * scale
//                             (+ mask [n, 1, G*S, T], a binary add post-op)
//   P = softmax(scores)       softmax_v2 over the last axis, in place, FP32
//   fix-ups                   rows with every key masked -> 0 (softmax gives
//                             NaN there), rows past a query length -> 0,
//                             P_h *= head_mask[h], statistics
//   context [n, Hkv, G*S, hd] = P x V [n, Hkv, T, hd]
//
// K^T is K read through strides (no copy; stays on brg). The mask is built
// per chunk in the one 4-D layout oneDNN 2.6 keeps on its brg kernels
// ([B, 1, M, N]; other broadcasts fall back to ref:any). Output scales apply
// before post-ops, so scores = Q K^T * scale + mask. Without anything masked
// the scores matmul has no post-op at all.

namespace attnserve::core::internal {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

constexpr memory::data_type kF32 = memory::data_type::f32;
constexpr memory::data_type kBf16 = memory::data_type::bf16;

// Below this many elements a loop that computes per element (scaling, masks,
// statistics) runs on one thread; loops that only copy take kCopyForkGrain.
constexpr int64_t kParallelGrain = int64_t{1} << 14;

constexpr float kMasked = -std::numeric_limits<float>::infinity();

bool AnyShorter(absl::Span<const int64_t> lengths, int64_t first, int64_t n, int64_t full) {
  for (int64_t b = first; b < first + n; ++b) {
    if (lengths[b] < full) return true;
  }
  return false;
}

// Whether the maps of a full selection are the chunk's probabilities as they
// are: per head, every head and every row in order.
bool MapsAreProbabilities(const MapSelection& maps, int64_t num_heads, int64_t q_len) {
  if (maps.mode != AttentionMapMode::kPerHead) return false;
  auto identity = [](const std::vector<int64_t>& selection, int64_t size) {
    if (selection.empty()) return true;
    if (static_cast<int64_t>(selection.size()) != size) return false;
    for (int64_t i = 0; i < size; ++i) {
      if (selection[i] != i) return false;
    }
    return true;
  };
  return identity(maps.heads, num_heads) && identity(maps.query_rows, q_len);
}

// Writes the additive mask of the chunk, [n, 1, G * S, T] (0 or -inf plus
// the explicit mask; one [S, T] block per sequence, repeated G times), and
// dead [n, S] (a valid query row with every key masked); returns whether any
// row is dead.
bool BuildMask(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
               float* mask, uint8_t* dead) {
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t g = config.group_size();
  const ExplicitMask& explicit_mask = call.mask;
#pragma omp parallel for schedule(static) if (n * s * t * g > kParallelGrain)
  for (int64_t row = 0; row < n * s; ++row) {
    const int64_t c = row / s;
    const int64_t i = row % s;
    const int64_t b = first + c;
    const int64_t kv_length = call.kv_lengths[b];
    const int64_t visible = call.causal ? std::min(kv_length, i + 1) : kv_length;
    float* const out = mask + (c * g * s + i) * t;
    bool alive = false;
    for (int64_t j = 0; j < t; ++j) {
      float value = j < visible ? 0.0f : kMasked;
      if (j < visible) {
        switch (explicit_mask.kind) {
          case ExplicitMask::Kind::kNone:
            break;
          case ExplicitMask::Kind::kAllowed:
            if (ExplicitValue(explicit_mask, b, i, j) == 0.0f) value = kMasked;
            break;
          case ExplicitMask::Kind::kAdditive:
            value = ExplicitValue(explicit_mask, b, i, j);
            break;
        }
      }
      out[j] = value;
      alive = alive || value != kMasked;
    }
    // Rows past the query length are never read into a result.
    dead[row] = !alive && i < call.q_lengths[b];
    for (int64_t group = 1; group < g; ++group) {
      std::memcpy(out + group * s * t, out, static_cast<size_t>(t) * sizeof(float));
    }
  }
  return std::any_of(dead, dead + n * s, [](uint8_t d) { return d != 0; });
}

// Zeroes rows past the query lengths and dead rows (dead: [n, S], or
// nullptr), applies the head mask, accumulates the statistics. probs:
// [n, num_heads, S, T].
void FinishProbabilities(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
                         const uint8_t* dead, float* probs) {
  const int64_t heads = config.num_heads;
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
#pragma omp parallel for schedule(static) if (n * heads * s * t > kParallelGrain)
  for (int64_t item = 0; item < n * heads; ++item) {
    const int64_t c = item / heads;
    const int64_t h = item % heads;
    const int64_t b = first + c;
    const int64_t q_length = call.q_lengths[b];
    const int64_t kv_length = call.kv_lengths[b];
    const float weight = call.head_mask.empty() ? 1.0f : call.head_mask[h];
    double entropy_sum = 0.0;
    double max_sum = 0.0;
    for (int64_t i = 0; i < s; ++i) {
      float* const row = probs + (item * s + i) * t;
      if (i >= q_length || (dead != nullptr && dead[c * s + i] != 0)) {
        std::fill(row, row + t, 0.0f);  // a fully masked row counts 0 in the statistics
        continue;
      }
      if (weight != 1.0f) {
        for (int64_t j = 0; j < t; ++j) row[j] *= weight;
      }
      if (call.statistics) {
        // Masked keys are 0 and add nothing.
        const RowStatistics row_stats = StatisticsOfRow(absl::MakeConstSpan(row, kv_length));
        entropy_sum += row_stats.entropy;
        max_sum += row_stats.max_weight;
      }
    }
    if (call.statistics) {
      call.head_entropy[b * heads + h] = static_cast<float>(entropy_sum / q_length);
      call.head_max_weight[b * heads + h] = static_cast<float>(max_sum / q_length);
    }
  }
}

// Copies the selected maps of the chunk out of probs.
void GatherMaps(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
                const float* probs) {
  const MapSelection& maps = *call.maps;
  const int64_t heads = config.num_heads;
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t rows = maps.query_rows.empty() ? s : static_cast<int64_t>(maps.query_rows.size());
  auto query_row = [&maps](int64_t r) { return maps.query_rows.empty() ? r : maps.query_rows[r]; };
  float* const out = call.attention_maps.data();
  if (maps.mode == AttentionMapMode::kPerHead) {
    const int64_t selected = maps.heads.empty() ? heads : static_cast<int64_t>(maps.heads.size());
#pragma omp parallel for schedule(static) if (n * selected * rows * t > kCopyForkGrain)
    for (int64_t item = 0; item < n * selected * rows; ++item) {
      const int64_t c = item / (selected * rows);
      const int64_t sh = item / rows % selected;
      const int64_t r = item % rows;
      const int64_t h = maps.heads.empty() ? sh : maps.heads[sh];
      const float* const from = probs + ((c * heads + h) * s + query_row(r)) * t;
      std::memcpy(out + ((first + c) * selected * rows + sh * rows + r) * t, from,
                  static_cast<size_t>(t) * sizeof(float));
    }
  } else if (maps.mode == AttentionMapMode::kMeanOverHeads) {
    const float inverse_heads = static_cast<float>(1.0 / static_cast<double>(heads));
#pragma omp parallel for schedule(static) if (n * rows * heads * t > kParallelGrain)
    for (int64_t item = 0; item < n * rows; ++item) {
      const int64_t c = item / rows;
      const int64_t r = item % rows;
      float* const to = out + ((first + c) * rows + r) * t;
      std::fill(to, to + t, 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* const from = probs + ((c * heads + h) * s + query_row(r)) * t;
        for (int64_t j = 0; j < t; ++j) to[j] += from[j];
      }
      for (int64_t j = 0; j < t; ++j) to[j] *= inverse_heads;
    }
  }
}

}  // namespace

absl::Status MaterializedSdpa(const HeadConfig& config, const SdpaCall& call, int64_t first,
                              int64_t n, const void* q, const void* k, const void* v,
                              float* context, WorkspaceState& workspace) {
  const int64_t heads = config.num_heads;
  const int64_t kv_heads = config.num_kv_heads;
  const int64_t g = config.group_size();
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t hd = config.head_dim;
  const int64_t scale_bits = std::bit_cast<int32_t>(config.scale);
  const memory::data_type operand = OperandType(call.bf16);

  const bool masked = call.causal || call.mask.kind != ExplicitMask::Kind::kNone ||
                      AnyShorter(call.kv_lengths, first, n, t);
  float* const mask = workspace.data<float>(Scratch::kMask);
  uint8_t* const dead = workspace.data<uint8_t>(Scratch::kDeadRows);
  const bool dead_rows = masked && BuildMask(config, call, first, n, mask, dead);

  // With all per-head maps asked for, the probabilities go straight to the
  // caller's buffer.
  const bool direct_maps = MapsAreProbabilities(*call.maps, heads, s);
  float* const probs =
      direct_maps ? call.attention_maps.data() + first * heads * s * t : workspace.data<float>(Scratch::kScores);

  // scores = Q K^T * scale (+ mask)
  const memory::desc q_desc({n, kv_heads, g * s, hd}, operand, Tag::abcd);
  const memory::desc k_t_desc({n, kv_heads, hd, t}, operand, Tag::abdc);
  const memory::desc scores_desc({n, kv_heads, g * s, t}, kF32, Tag::abcd);
  const memory::desc mask_desc({n, 1, g * s, t}, kF32, Tag::abcd);
  const Step scores = workspace.primitives.Get<dnnl::matmul>(
      {PrimitiveCache::kScores, n, kv_heads, g * s, t, hd, call.bf16, masked, scale_bits}, [&] {
    dnnl::primitive_attr attr = UserScratchpad();
    attr.set_output_scales(0, {config.scale});
    if (masked) {
      dnnl::post_ops post_ops;
      post_ops.append_binary(dnnl::algorithm::binary_add, mask_desc);
      attr.set_post_ops(post_ops);
    }
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(q_desc, k_t_desc, scores_desc), attr,
                                        workspace.engine);
  });
  Args scores_args = {{DNNL_ARG_SRC, Memory(workspace, q_desc, q)},
                      {DNNL_ARG_WEIGHTS, Memory(workspace, k_t_desc, k)},
                      {DNNL_ARG_DST, Memory(workspace, scores_desc, probs)}};
  if (masked) {
    scores_args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                        Memory(workspace, mask_desc, mask));
  }
  ATTNSERVE_RETURN_IF_ERROR(RunStep(workspace, scores, std::move(scores_args)));

  // P = softmax(scores), rows of [n * Hq * S, T], in place.
  const memory::desc rows_desc({n * heads * s, t}, kF32, Tag::ab);
  const Step softmax = workspace.primitives.Get<dnnl::softmax_v2_forward>(
      {PrimitiveCache::kSoftmax, n * heads * s, t}, [&] {
    return dnnl::softmax_v2_forward::primitive_desc(
        dnnl::softmax_v2_forward::desc(dnnl::prop_kind::forward_inference,
                                       dnnl::algorithm::softmax_accurate, rows_desc, rows_desc,
                                       /*softmax_axis=*/1),
        UserScratchpad(), workspace.engine);
  });
  const memory probs_rows = Memory(workspace, rows_desc, probs);
  ATTNSERVE_RETURN_IF_ERROR(RunStep(workspace, softmax, {{DNNL_ARG_SRC, probs_rows}, {DNNL_ARG_DST, probs_rows}}));
  // A row whose scores overflowed (all -inf after an additive mask, or +inf
  // from huge inputs) leaves softmax as NaN in every entry (its sum is NaN):
  // it gets weights 0, like a fully masked row. One entry tells.
  const int64_t prob_rows = n * heads * s;
#pragma omp parallel for schedule(static) if (prob_rows > kParallelGrain / 64)
  for (int64_t r = 0; r < prob_rows; ++r) {
    float* const row = probs + r * t;
    if (std::isnan(row[0])) std::fill(row, row + t, 0.0f);
  }

  const bool reweighted =
      std::any_of(call.head_mask.begin(), call.head_mask.end(), [](float w) { return w != 1.0f; });
  if (dead_rows || reweighted || call.statistics || AnyShorter(call.q_lengths, first, n, s)) {
    FinishProbabilities(config, call, first, n, dead_rows ? dead : nullptr, probs);
  }
  if (!direct_maps) GatherMaps(config, call, first, n, probs);

  // context = P V
  const void* p = probs;
  if (call.bf16) {
    const memory::desc bf16_rows_desc({n * heads * s, t}, kBf16, Tag::ab);
    const Step to_bf16 = workspace.primitives.Get<dnnl::reorder>(
        {PrimitiveCache::kToBf16, n * heads * s, t}, [&] {
      return dnnl::reorder::primitive_desc(workspace.engine, rows_desc, workspace.engine, bf16_rows_desc,
                                           UserScratchpad());
    });
    ATTNSERVE_RETURN_IF_ERROR(RunStep(workspace, 
        to_bf16,
        {{DNNL_ARG_FROM, probs_rows}, {DNNL_ARG_TO, Memory(workspace, bf16_rows_desc, workspace.data<Bf16>(Scratch::kProbsBf16))}}));
    p = workspace.data<Bf16>(Scratch::kProbsBf16);
  }
  const memory::desc p_desc({n, kv_heads, g * s, t}, operand, Tag::abcd);
  const memory::desc v_desc({n, kv_heads, t, hd}, operand, Tag::abcd);
  const memory::desc context_desc({n, kv_heads, g * s, hd}, kF32, Tag::abcd);
  const Step context_mm = workspace.primitives.Get<dnnl::matmul>(
      {PrimitiveCache::kContext, n, kv_heads, g * s, t, hd, call.bf16}, [&] {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(p_desc, v_desc, context_desc),
                                        UserScratchpad(), workspace.engine);
  });
  return RunStep(workspace, context_mm, {{DNNL_ARG_SRC, Memory(workspace, p_desc, p)},
                          {DNNL_ARG_WEIGHTS, Memory(workspace, v_desc, v)},
                          {DNNL_ARG_DST, Memory(workspace, context_desc, context)}});
}

}  // namespace attnserve::core::internal
