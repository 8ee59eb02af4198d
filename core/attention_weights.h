#ifndef ATTNSERVE_CORE_ATTENTION_WEIGHTS_H_
#define ATTNSERVE_CORE_ATTENTION_WEIGHTS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/head_config.h"

namespace attnserve::core {

// The weights of one attention layer, FP32, row-major, in the `y = x W + b`
// convention (W is [in, out], the transpose of torch.nn.Linear.weight).
// Head h's projection W_h^Q is columns [h * head_dim, (h + 1) * head_dim) of
// w_q; likewise key/value head g in w_k and w_v.
struct AttentionWeights {
  std::vector<float> w_q;  // [d_model, num_heads * head_dim]
  std::vector<float> b_q;  // [num_heads * head_dim]
  std::vector<float> w_k;  // [context_dim, num_kv_heads * head_dim]
  std::vector<float> b_k;  // [num_kv_heads * head_dim]
  std::vector<float> w_v;  // [context_dim, num_kv_heads * head_dim]
  std::vector<float> b_v;  // [num_kv_heads * head_dim]
  std::vector<float> w_o;  // [num_heads * head_dim, d_model]
  std::vector<float> b_o;  // [d_model]
};

// INVALID_ARGUMENT naming the tensor when a size does not match `config`
// (which must be resolved) or a value is not finite.
absl::Status ValidateWeights(const HeadConfig& config, const AttentionWeights& weights);

// Deterministic weights from a seed, reproducible bit for bit on any platform
// and in any language (docs/seeded_weights.md gives the recipe):
// tensor t (0..7 in the order of AttentionWeights' fields), element i
// (row-major) is float32((2u - 1) / sqrt(fan_in)) in double arithmetic, with
// fan_in the tensor's input width (d_model for w_q and b_q, context_dim for
// w_k, b_k, w_v and b_v, num_heads * head_dim for w_o and b_o) and
// u = SeededUniform(seed, t, i). `config` must be resolved.
AttentionWeights SeededWeights(const HeadConfig& config, uint64_t seed);

// A uniform number in [0, 1) with 24 random bits: splitmix64's finalizer over
// z = seed + stream * 0xD1B54A32D192ED03 + (index + 1) * 0x9E3779B97F4A7C15
// (mod 2^64), top 24 bits / 2^24. Counter-based, so any element can be made
// alone.
double SeededUniform(uint64_t seed, uint64_t stream, uint64_t index);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_WEIGHTS_H_
