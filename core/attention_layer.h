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
#include "core/attention_core.h"  // for code that includes the layer for both
#include "core/decode/extend.h"
#include "core/head_config.h"
#include "core/route.h"
#include "core/validation.h"
#include "core/workspace.h"

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
  // its first key, in self-attention), each in [0, kMaxPositionOffset = 2^30]
  // (core/validation.h). Empty: 0. Ignored
  // without RoPE. In cross-attention the context's keys are rotated at their
  // own positions 0, 1, ... (the encoder's), whatever the offsets.
  absl::Span<const int64_t> position_offsets;
};

// One multi-head attention layer on oneDNN (the seeds' definition, see
// HeadConfig): self- or cross-attention, bidirectional or causal, padded or
// packed ragged batches, explicit masks, head mask, RoPE, GQA/MQA, maps,
// per-head statistics, FP32 or BF16 (Forward); and decode steps of
// self-attention over paged KV caches (Extend). It holds its weights only: a
// call runs in a Workspace (primitives and scratch memory), the caller's or
// one made for the call, on the Route that MakeRoute (or MakeExtendRoute,
// core/route.h) gives.
//
// Thread-safe: concurrent forwards need different workspaces (the server runs
// them on its compute executor, which owns one and the cores).
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
  // `workspace`: where the forward runs (nullptr: one made for the call,
  // freed after it).
  absl::StatusOr<ForwardInfo> Forward(const LayerInputs& inputs, const ForwardOptions& options,
                                      ForwardOutputs outputs, Workspace* workspace = nullptr) const;

  // The decode route: one step of a micro-batch of sequences whose keys and
  // values are cached (see ExtendItem, ExtendOptions). For the items that
  // pass validation, with R their new tokens in all:
  //   QKV [R, N] = X W_qkv + b_qkv           one projection matmul over every item's new tokens
  //   RoPE on Q and K at first_position + i  (core/head_staging.h, as Forward)
  //   K, V appended to each item's cache     (LayerKvCache::Append; BF16 caches round them)
  //   each new row attends to everything cached, causal within the new tokens
  //   (new token i sees positions <= L0 + i), with head_mask  (core::PagedAttention)
  //   out [R, d_model] = context W_o + b_o   one output matmul over all new tokens
  // On the route MakeExtendRoute(config(), R, options.precision) gives
  // (core/route.h): ForwardInfo says its precision and kernel path
  // ("fp32/paged", "bf16/paged").
  //
  // Errors of one item are its status (see ExtendItem::status) and the call
  // goes on with the others; an item the pool refuses leaves its cache as it
  // was. The call itself returns INVALID_ARGUMENT for a layer that is not
  // self-attention (context_dim != d_model; field "context_dim"), malformed
  // options ("options.head_mask", "options.precision") or sizes that
  // overflow ("items"); CANCELLED when options.should_stop says so;
  // RESOURCE_EXHAUSTED when scratch memory cannot be allocated; INTERNAL when
  // oneDNN fails. After any such error every cache has its length from
  // before the call (tokens appended by the call are truncated away), and
  // every item that passed validation has the call's error as its status.
  // Items with no valid one: OK, nothing runs.
  //
  // Thread-safe as Forward (a workspace per concurrent call), as long as no
  // two concurrent calls touch the same cache. `workspace`: as Forward's.
  absl::StatusOr<ForwardInfo> Extend(absl::Span<ExtendItem> items, const ExtendOptions& options,
                                     Workspace* workspace = nullptr) const;

 private:
  class Impl;
  explicit AttentionLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_LAYER_H_
