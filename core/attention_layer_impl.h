#ifndef ATTNSERVE_CORE_ATTENTION_LAYER_IMPL_H_
#define ATTNSERVE_CORE_ATTENTION_LAYER_IMPL_H_

// Private to core/: the layer's weights and the routes that run on them.
// The forward route (AttentionLayer::Forward) is core/attention_layer.cc; the
// decode route (AttentionLayer::Extend) core/decode/extend.cc. Both call the
// same projections (ProjectQkv, ProjectContext), RoPE and staging
// (core/head_staging.h) and validation (core/validation.h).

#include <cstdint>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/bf16.h"
#include "core/decode/extend.h"
#include "core/head_config.h"
#include "core/kernels/sdpa_call.h"
#include "core/kernels/workspace_state.h"
#include "core/route.h"
#include "core/workspace.h"

namespace attnserve::core {

namespace internal {
// One call of AttentionLayer::Extend: the items that run (core/decode/extend.cc).
struct ExtendStep;
}  // namespace internal

// The layer's weights. Thread-safe: constant after construction, but for the
// BF16 copies of the weights and the output projection's Gram matrices, each
// made once on first use.
class AttentionLayer::Impl {
 public:
  Impl(const HeadConfig& config, AttentionWeights weights);

  const HeadConfig& config() const { return config_; }

  absl::Status Validate(const LayerInputs& inputs, const ForwardOptions& options,
                        const ForwardOutputs& outputs) const;
  absl::StatusOr<ForwardInfo> ForwardOn(const LayerInputs& inputs, const ForwardOptions& options,
                                        ForwardOutputs outputs,
                                        internal::WorkspaceState& workspace) const;

  // The decode route, AttentionLayer::Extend (core/decode/extend.cc).
  absl::StatusOr<ForwardInfo> Extend(absl::Span<ExtendItem> items, const ExtendOptions& options,
                                     Workspace* workspace) const;

 private:
  // Self-attention's fused input projection, shared by both routes:
  //   QKV [rows, N] = X [rows, d_model] W_qkv + b_qkv,  N = (Hq + 2 Hkv) hd,
  // X FP32 or (bf16) BF16, QKV written FP32 or (qkv_bf16) BF16 with rows
  // qkv_stride >= N elements apart. The layer must be fused (context_dim ==
  // d_model).
  absl::Status ProjectQkv(internal::WorkspaceState& workspace, int64_t rows, bool bf16,
                          const void* x, void* qkv, int64_t qkv_stride, bool qkv_bf16) const;
  // The output projection, shared by both routes:
  //   out [rows, d_model] = context [rows, Hq hd] W_o + b_o,
  // context FP32 or (bf16) BF16, out FP32.
  absl::Status ProjectContext(internal::WorkspaceState& workspace, int64_t rows, bool bf16,
                              const void* context, float* out) const;

  // The decode route's stages (core/decode/extend.cc), on a step whose items
  // passed validation: see AttentionLayer::Extend.
  absl::Status ExtendOn(internal::ExtendStep& step, const ExtendOptions& options,
                        internal::WorkspaceState& workspace) const;
  // The new tokens' projections into kProjections, RoPE's tables into
  // kRotary, and Q, K, V staged token-major (RoPE applied) into kQStage,
  // kKStage, kVStage.
  absl::Status ProjectNewTokens(const internal::ExtendStep& step,
                                internal::WorkspaceState& workspace) const;

  // Where the projected rows of Q, K or V are in kProjections: row r of head
  // h starts at element offset + r * stride + h * head_dim.
  struct Projected {
    int64_t offset = 0;
    int64_t stride = 0;
  };
  // RoPE's tables in kRotary, [rows, rotary_dim / 2] each: the queries' and
  // the keys' (the queries' again in self-attention).
  struct Rotary {
    const float* q_cos = nullptr;
    const float* q_sin = nullptr;
    const float* k_cos = nullptr;
    const float* k_sin = nullptr;
  };
  // One forward's view of its inputs, route and workspace.
  struct Pass {
    const LayerInputs& inputs;
    const SequenceLayout& keys;
    bool cross;
    const Route& route;
    const internal::SdpaCall& call;
    internal::WorkspaceState& workspace;
    Projected qkv[3];  // Q, K, V
    Rotary rotary;
  };

  // Stage 1: the projections into kProjections (and RoPE's tables).
  absl::Status Project(Pass& pass) const;
  // Stage 2: attention, a chunk of sequences at a time (the blocked path: the
  // whole batch at once), into the token-major rows of kContextTokens.
  absl::Status Attend(const Pass& pass, const ForwardOptions& options,
                      absl::Span<float> head_contribution) const;
  // Stage 3: the output projection; padding rows are 0.
  absl::Status ProjectOutput(const Pass& pass, absl::Span<float> output) const;
  // Stages the chunk's Q, K, V (kQStage...) from the projections, applying RoPE.
  template <typename T>
  void Stage(const Pass& pass, int64_t first, int64_t n) const;
  // Concatenates the chunk's heads into token-major rows of kContextTokens.
  template <typename T>
  void ConcatHeads(const Pass& pass, int64_t first, int64_t n) const;
  // ||head_h W^O_h||_F over each of the chunk's sequences' rows.
  void Contributions(const Pass& pass, int64_t first, int64_t n, absl::Span<float> out) const;
  void MakeBf16Weights() const;

  // Where the input projections' weights are, FP32 or BF16: W_q is columns
  // [0, Hq hd) of `q` (row stride q_stride), [W_k | W_v] columns [0, 2 Hkv hd)
  // of `kv` (row stride kv_stride). Fused: both inside W_qkv.
  struct InputWeights {
    const void* q = nullptr;
    int64_t q_stride = 0;
    const void* kv = nullptr;
    int64_t kv_stride = 0;
  };
  InputWeights GetInputWeights(bool bf16) const;

  // Constant after construction.
  const HeadConfig config_;  // resolved
  // context_dim == d_model: W_q, W_k and W_v fused into w_qkv_ (w_q_ and w_kv_
  // empty). Otherwise w_q_ and w_kv_ (w_qkv_ empty): their inputs differ in
  // width.
  const bool fused_;
  const std::vector<float> w_qkv_;                 // [d_model, N] = [w_q | w_k | w_v]
  const std::vector<float> w_q_;                   // [d_model, Hq * hd]
  const std::vector<float> w_kv_;                  // [context_dim, 2 * Hkv * hd] = [w_k | w_v]
  const std::vector<float> b_qkv_;                 // [N] = [b_q | b_k | b_v]
  const std::vector<float> w_o_;                   // [Hq * hd, d_model]
  const std::vector<float> b_o_;                   // [d_model]
  const std::vector<double> inverse_frequencies_;  // [rotary_dim / 2]

  // Made once, on first use (those of the FP32 weights that are not empty).
  mutable absl::once_flag bf16_once_;
  mutable std::vector<Bf16> w_qkv_bf16_, w_q_bf16_, w_kv_bf16_, w_o_bf16_;
  // internal::OutputGram (when head_dim <= d_model).
  mutable absl::once_flag gram_once_;
  mutable std::vector<double> w_o_gram_;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_LAYER_IMPL_H_
