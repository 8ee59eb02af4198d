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
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::core {

enum class AttentionMapMode {
  kNone,
  kPerHead,        // [batch, num_heads, seq_len, seq_len]
  kMeanOverHeads,  // [batch, seq_len, seq_len]
};

// The sizes of one forward call: `batch` sequences of `seq_len` tokens each.
struct AttentionShape {
  int64_t batch = 0;
  int64_t seq_len = 0;
};

struct ForwardOptions {
  AttentionMapMode attention_maps = AttentionMapMode::kNone;
  // Polled before each stage; when it returns true the call stops with
  // CANCELLED. Empty: never stops early.
  std::function<bool()> should_stop;
};

// Buffers the caller owns and the layer fills.
struct ForwardOutputs {
  absl::Span<float> output;          // [batch, seq_len, d_model]
  absl::Span<float> attention_maps;  // see AttentionMapMode; empty for kNone
};

struct ForwardInfo {
  // How the layer ran, "<precision>/<attention path>", e.g. "fp32/materialized".
  std::string kernel_path;
};

// Elements of the attention maps `mode` asks for, or nullopt on int64 overflow.
std::optional<int64_t> AttentionMapElements(const HeadConfig& config, AttentionShape shape,
                                            AttentionMapMode mode);

// One multi-head attention layer (self-attention, bidirectional) on oneDNN,
// FP32. Its primitives are built once per shape and cached; its scratch
// buffers are reused across calls.
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

  // Runs the layer:
  //   hidden_states: [batch, seq_len, d_model], row-major
  //   outputs.output: [batch, seq_len, d_model]
  //   outputs.attention_maps: per AttentionMapMode (rows sum to 1)
  // INVALID_ARGUMENT when a span's size does not match `shape` (or `shape` is
  // empty or too large), CANCELLED when options.should_stop says so,
  // RESOURCE_EXHAUSTED when scratch memory cannot be allocated, INTERNAL when
  // oneDNN fails.
  absl::StatusOr<ForwardInfo> Forward(absl::Span<const float> hidden_states, AttentionShape shape,
                                      const ForwardOptions& options, ForwardOutputs outputs);

 private:
  class Impl;
  explicit AttentionLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_LAYER_H_
