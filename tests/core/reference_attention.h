#ifndef ATTNSERVE_TESTS_CORE_REFERENCE_ATTENTION_H_
#define ATTNSERVE_TESTS_CORE_REFERENCE_ATTENTION_H_

#include <vector>

#include "absl/types/span.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::testing {

// What the layer computes, in double precision.
struct ReferenceResult {
  std::vector<double> output;         // [batch, seq_len, d_model]
  std::vector<double> per_head_maps;  // [batch, num_heads, seq_len, seq_len]
  std::vector<double> mean_maps;      // [batch, seq_len, seq_len]
};

// A naive double-precision implementation of the attention layer, straight
// from the math (bidirectional self-attention):
//   Q = X w_q + b_q, K = X w_k + b_k, V = X w_v + b_v
//   P_h = softmax(Q_h K_g^T * scale) over the keys, g = h / (num_heads / num_kv_heads)
//   out = concat_h(P_h V_g) w_o + b_o
// `config` must be resolved and `weights` valid for it; hidden_states is
// [batch, seq_len, d_model], row-major. Meant for small shapes in tests.
ReferenceResult ReferenceAttention(const core::HeadConfig& config,
                                   const core::AttentionWeights& weights,
                                   absl::Span<const float> hidden_states,
                                   core::AttentionShape shape);

// ||actual - expected||_F / ||expected||_F (the absolute error when expected
// is all zeros). Infinity when the sizes differ or `actual` is not finite.
double RelativeFrobeniusError(absl::Span<const float> actual, absl::Span<const double> expected);

// The largest |sum of a row - 1| over the rows of `row_length` elements in `maps`.
double MaxRowSumError(absl::Span<const float> maps, int64_t row_length);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_REFERENCE_ATTENTION_H_
