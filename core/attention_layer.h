#ifndef ATTNSERVE_CORE_ATTENTION_LAYER_H_
#define ATTNSERVE_CORE_ATTENTION_LAYER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::core {

// The inputs of AttentionLayer::Forward.
struct LayerInputs {
  // The queries' hidden states, [layout.rows(), d_model] row-major.
  absl::Span<const float> hidden_states;
  SequenceLayout layout;
  // Cross-attention: keys and values come from `context`
  // [context_layout.rows(), context_dim] (encoder states), with the same batch
  // as `layout`. Empty: self-attention (keys and values from hidden_states),
  // which needs a layer whose context_dim is d_model.
  absl::Span<const float> context;
  std::optional<SequenceLayout> context_layout;
  // Query i of a sequence sees only keys j <= i (top-left aligned, also in
  // cross-attention).
  bool causal = false;
  ExplicitMask mask;
  // [num_heads]: head h's attention weights are multiplied by head_mask[h]
  // (0 removes the head, as in head pruning); each finite and >= 0. Empty: all 1.
  absl::Span<const float> head_mask;
  // [batch]: the RoPE position of each sequence's first query token (and of
  // its first key, in self-attention), each in [0, 2^40]. Empty: 0. Ignored
  // without RoPE. In cross-attention the context's keys are rotated at their
  // own positions 0, 1, ... (the encoder's), whatever the offsets.
  absl::Span<const int64_t> position_offsets;
};

// Elements of the attention maps `maps` asks for, for queries in `queries`
// and keys in `keys` (the queries' layout again in self-attention), or
// nullopt on int64 overflow.
std::optional<int64_t> AttentionMapElements(const HeadConfig& config, const SequenceLayout& queries,
                                            const SequenceLayout& keys, const MapSelection& maps);

// Bytes of scratch memory a call with these sizes and options allocates
// beyond the caller's buffers (projections, staged heads, materialized scores
// or the blocked path's blocks, masks, BF16 copies), or nullopt on int64
// overflow. `projected_inputs`: AttentionCore::Run (heads given, no
// projections); otherwise AttentionLayer::Forward, cross-attention when
// `keys` is the context's layout (`cross_attention`). What a server compares
// with its memory budget before admitting a request; it follows the path
// `options` choose (AttentionPath). Thread-safe.
std::optional<int64_t> ForwardScratchBytes(const HeadConfig& config, const SequenceLayout& queries,
                                           const SequenceLayout& keys, bool cross_attention,
                                           bool projected_inputs, const ForwardOptions& options);

// One multi-head attention layer on oneDNN (the seeds' definition, see
// HeadConfig): self- or cross-attention, bidirectional or causal, padded or
// packed ragged batches, explicit masks, head mask, RoPE, GQA/MQA, maps,
// per-head statistics, FP32 or BF16. Primitives are built once per shape and
// cached; scratch buffers are reused across calls.
//
// Thread-safe: calls to Forward are serialized internally (the server runs
// them on one compute executor, which owns the cores through OpenMP).
class AttentionLayer {
 public:
  // INVALID_ARGUMENT when the config or the weights are malformed, INTERNAL
  // when oneDNN fails.
  static absl::StatusOr<std::unique_ptr<AttentionLayer>> Create(const HeadConfig& config,
                                                                AttentionWeights weights);
  ~AttentionLayer();
  AttentionLayer(const AttentionLayer&) = delete;
  AttentionLayer& operator=(const AttentionLayer&) = delete;

  const HeadConfig& config() const;

  // Runs the layer (see LayerInputs, ForwardOptions and ForwardOutputs for
  // layouts). A query row whose keys are all masked gets attention weights of
  // 0 (its map row is 0 and the head adds nothing for it), never NaN.
  // INVALID_ARGUMENT naming the input when a span's size or a layout does not
  // match, or when self-attention is asked of a layer whose context_dim is
  // not d_model (the server validates first; this is the core's own guard),
  // CANCELLED when options.should_stop says so, RESOURCE_EXHAUSTED when
  // scratch memory cannot be allocated, INTERNAL when oneDNN fails.
  absl::StatusOr<ForwardInfo> Forward(const LayerInputs& inputs, const ForwardOptions& options,
                                      ForwardOutputs outputs);

 private:
  class Impl;
  explicit AttentionLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

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
// Thread-safe like AttentionLayer.
class AttentionCore {
 public:
  // INVALID_ARGUMENT when the config is malformed. d_model may be 0 (with
  // head_dim set): it is then taken as num_heads * head_dim.
  static absl::StatusOr<std::unique_ptr<AttentionCore>> Create(const HeadConfig& config);
  ~AttentionCore();
  AttentionCore(const AttentionCore&) = delete;
  AttentionCore& operator=(const AttentionCore&) = delete;

  const HeadConfig& config() const;
  // Errors as AttentionLayer::Forward (the spans of CoreInputs named "q", "k",
  // "v", "q_lengths", "kv_lengths"; "head_contribution" when it is not empty).
  absl::StatusOr<ForwardInfo> Run(const CoreInputs& inputs, const ForwardOptions& options,
                                  ForwardOutputs outputs);

 private:
  class Impl;
  explicit AttentionCore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_LAYER_H_
