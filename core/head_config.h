#ifndef ATTNSERVE_CORE_HEAD_CONFIG_H_
#define ATTNSERVE_CORE_HEAD_CONFIG_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/attention_inputs.h"

namespace attnserve::core {

// The shape of one attention layer (the seeds' definition), with X the
// queries' states [.., d_model] and C the keys' and values' states
// [.., context_dim] (C = X in self-attention):
//   Q_h = X W_h^Q + b, K_g = C W_g^K + b, V_g = C W_g^V + b,
//   head_h = softmax(Q_h K_g^T * scale) V_g, g = h / (num_heads / num_kv_heads),
//   out = Concat(head_1..head_H) W^O + b^O.
struct HeadConfig {
  int64_t d_model = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // 0: same as num_heads
  int64_t head_dim = 0;      // 0: d_model / num_heads
  float scale = 0.0f;        // 0: 1 / sqrt(head_dim)
  RotaryConfig rotary;       // rotary_dim 0: no RoPE
  // Width of the context states keys and values are projected from in
  // cross-attention (torch.nn.MultiheadAttention's kdim = vdim); 0: d_model.
  // Self-attention needs context_dim == d_model.
  int64_t context_dim = 0;

  int64_t q_width() const { return num_heads * head_dim; }
  int64_t kv_width() const { return num_kv_heads * head_dim; }
  // Query heads that share one key/value head.
  int64_t group_size() const { return num_heads / num_kv_heads; }
};

// Upper bounds on a layer's dimensions: far above any real model, low enough
// that no product of them (or their weights' sizes) overflows int64.
inline constexpr int64_t kMaxDModel = 1 << 16;
inline constexpr int64_t kMaxHeads = 1 << 10;
inline constexpr int64_t kMaxHeadDim = 1 << 12;

// Fills the defaults (see the fields) and checks the result: every dimension
// positive and within the bounds above (context_dim too, after it defaults to
// d_model), num_heads divides d_model when
// head_dim is 0, num_kv_heads divides num_heads, scale finite and positive,
// rotary.rotary_dim even and in [0, head_dim], rotary.theta finite and > 1.
// INVALID_ARGUMENT naming the field ("head_config.<field>") otherwise.
absl::StatusOr<HeadConfig> ResolveHeadConfig(const HeadConfig& config);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_HEAD_CONFIG_H_
