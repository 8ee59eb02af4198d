#ifndef ATTNSERVE_TESTS_CORE_REFERENCE_ATTENTION_H_
#define ATTNSERVE_TESTS_CORE_REFERENCE_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::testing {

// What the layer (or the core) computes, in double precision, with S the
// queries' and T the keys' max_length.
struct ReferenceResult {
  // Layer: [layout.rows(), d_model], padding rows 0. Core: [batch, num_heads,
  // S, head_dim] (the same as context_heads).
  std::vector<double> output;
  std::vector<double> per_head_maps;  // [batch, num_heads, S, T]
  std::vector<double> mean_maps;      // [batch, S, T]
  std::vector<double> entropy;        // [batch, num_heads]
  std::vector<double> max_weight;     // [batch, num_heads]
  std::vector<double> contribution;   // [batch, num_heads]; layer only
  // The heads the attention works on (after the projections and RoPE), padded
  // and head-major, 0 past each sequence's length:
  std::vector<double> q;              // [batch, num_heads, S, head_dim]
  std::vector<double> k;              // [batch, num_kv_heads, T, head_dim]
  std::vector<double> v;              // [batch, num_kv_heads, T, head_dim]
  std::vector<double> context_heads;  // [batch, num_heads, S, head_dim], 0 past lengths
};

// A naive double-precision attention layer, straight from the math; inputs
// as core::LayerInputs (all features: padded/packed layouts, cross-attention,
// causal, explicit masks, head mask, RoPE). Per sequence b and head h,
// g = h / (num_heads / num_kv_heads):
//   Q = X w_q + b_q, K = C w_k + b_k, V = C w_v + b_v   (C = X in self-attention;
//   X is [.., d_model], C [.., context_dim])
//   RoPE (rotate half) on Q at position_offsets[b] + i and on K at the same
//   positions (self) or at i (cross)
//   s_ij = Q_i K_j^T * scale (+ additive mask), -inf where j is past the keys'
//   length, j > i (causal) or the mask forbids it
//   P_i = softmax(s_i) (0 when every s_ij is -inf), times head_mask[h]
//   out = concat_h(P_h V_g) w_o + b_o
// `config` must be resolved and `weights` valid for it. Meant for small shapes.
ReferenceResult ReferenceLayer(const core::HeadConfig& config,
                               const core::AttentionWeights& weights,
                               const core::LayerInputs& inputs);

// How a value is rounded to BF16's 8 significant bits: to nearest, ties to
// even (what the kernels do), or toward zero (truncation: a wrong kernel the
// tests' negative controls stand for).
enum class Bf16Rounding { kNearestEven, kTowardZero };

// `x` rounded to BF16's 8 significant bits, in double (written from the
// format, apart from core/bf16.h). 0, inf and NaN stay; x must lie in BF16's
// normal range or be 0.
double RoundToBf16(double x, Bf16Rounding rounding = Bf16Rounding::kNearestEven);

// Where ReferenceLayerWithBf16Operands rounds, beyond the operands every BF16
// path rounds (below).
struct Bf16Operands {
  Bf16Rounding rounding = Bf16Rounding::kNearestEven;
  // Which probabilities the P V product takes in BF16.
  enum class Probabilities {
    // The materialized path: P = softmax(s) * head_mask[h], rounded.
    kNormalized,
    // The blocked path with one key block per query row: p_j = exp(s_j -
    // max_j s_j), rounded, with the row's sum l of the unrounded p_j, and
    // context = (sum_j p_j V_j) * head_mask[h] / l.
    kRelativeToRowMax,
  };
  Probabilities probabilities = Probabilities::kNormalized;
};

// ReferenceLayer with BF16 where the BF16 layer has it, everything else in
// double: rounded are the hidden states and the context, w_q, w_k, w_v and w_o
// (biases stay), Q, K and V after the projections' bias and RoPE, the
// probabilities as `bf16` says, and the context heads before the output
// projection. `output` and `context_heads` are what those rounded operands
// give; maps and statistics are the unrounded probabilities'.
ReferenceResult ReferenceLayerWithBf16Operands(const core::HeadConfig& config,
                                               const core::AttentionWeights& weights,
                                               const core::LayerInputs& inputs,
                                               const Bf16Operands& bf16);

// The same attention on heads given already projected (core::CoreInputs).
ReferenceResult ReferenceCore(const core::HeadConfig& config, const core::CoreInputs& inputs);

// The maps `maps` selects out of a result's full maps (batch sequences of S
// queries and T keys), in the layout of core::MapSelection.
std::vector<double> SelectMaps(const ReferenceResult& result, const core::HeadConfig& config,
                               int64_t batch, int64_t s, int64_t t, const core::MapSelection& maps);

// Each head's entropy (-sum p log p) and max weight of the rows [from, from +
// n) of one sequence's per-head maps `maps` ([num_heads, length, length], as
// ReferenceResult::per_head_maps of a batch of 1): [num_heads, n] each.
struct RowStatistics {
  std::vector<double> entropy;
  std::vector<double> max_weight;
};
RowStatistics ReferenceRowStatistics(absl::Span<const double> maps, int64_t num_heads,
                                     int64_t length, int64_t from, int64_t n);

// ||actual - expected||_F / ||expected||_F (the absolute error when expected
// is all zeros). Infinity when the sizes differ or `actual` is not finite.
double RelativeFrobeniusError(absl::Span<const float> actual, absl::Span<const double> expected);

// The largest |sum of a row - 1| over the rows of `row_length` elements in `maps`.
double MaxRowSumError(absl::Span<const float> maps, int64_t row_length);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_REFERENCE_ATTENTION_H_
