#ifndef ATTNSERVE_CORE_ATTENTION_CORE_H_
#define ATTNSERVE_CORE_ATTENTION_CORE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/head_config.h"
#include "core/workspace.h"

namespace attnserve::core {

namespace internal {
struct SdpaCall;
struct WorkspaceState;
}  // namespace internal

// The inputs of AttentionCore::Run: heads already projected (and rotated, if
// the model uses RoPE), dense row-major. Positions past the lengths are padding:
// they may hold anything (NaN too) and never reach a result.
struct CoreInputs {
  absl::Span<const float> q;  // [batch, num_heads, q_len, head_dim]
  absl::Span<const float> k;  // [batch, num_kv_heads, kv_len, head_dim]
  absl::Span<const float> v;  // [batch, num_kv_heads, kv_len, head_dim]
  int64_t batch = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  // [batch] valid lengths (padding after them); empty: q_len / kv_len.
  absl::Span<const int64_t> q_lengths;
  absl::Span<const int64_t> kv_lengths;
  bool causal = false;
  ExplicitMask mask;
  absl::Span<const float> head_mask;  // [num_heads]; empty: all 1
};

// Scaled dot-product attention alone, per head:
//   out_h = softmax(Q_h K_g^T * scale + mask) V_g, g = h / (num_heads / num_kv_heads)
// for clients that project themselves. Uses config's num_heads, num_kv_heads,
// head_dim and scale (d_model, context_dim and rotary are not used). Outputs:
// output [batch, num_heads, q_len, head_dim]; maps and head_entropy /
// head_max_weight as for the layer (no head_contribution).
// Holds its configuration only; runs in a Workspace like AttentionLayer.
// Thread-safe like AttentionLayer.
class AttentionCore {
 public:
  // INVALID_ARGUMENT when the config is malformed. d_model may be 0 (with
  // head_dim set): it is then taken as num_heads * head_dim.
  static absl::StatusOr<std::unique_ptr<AttentionCore>> Create(const HeadConfig& config);
  ~AttentionCore();
  AttentionCore(const AttentionCore&) = delete;
  AttentionCore& operator=(const AttentionCore&) = delete;

  const HeadConfig& config() const { return config_; }
  // Errors as AttentionLayer::Forward (the spans of CoreInputs named "q", "k",
  // "v", "q_lengths", "kv_lengths"; "head_contribution" when it is not empty).
  // `workspace`: as for AttentionLayer::Forward.
  absl::StatusOr<ForwardInfo> Run(const CoreInputs& inputs, const ForwardOptions& options,
                                  ForwardOutputs outputs, Workspace* workspace = nullptr) const;

 private:
  explicit AttentionCore(const HeadConfig& config) : config_(config) {}

  template <typename T>
  void Stage(const CoreInputs& inputs, const internal::SdpaCall& call, int64_t first, int64_t n,
             internal::WorkspaceState& workspace) const;
  absl::StatusOr<ForwardInfo> RunOn(const CoreInputs& inputs, const SequenceLayout& queries,
                                    const SequenceLayout& keys, const ForwardOptions& options,
                                    ForwardOutputs outputs,
                                    internal::WorkspaceState& workspace) const;

  const HeadConfig config_;  // resolved
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_CORE_H_
