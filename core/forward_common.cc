#include "core/forward_common.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace attnserve::core::internal {
namespace {

std::vector<int64_t> Lengths(const SequenceLayout& layout) {
  std::vector<int64_t> lengths(static_cast<size_t>(layout.batch()));
  for (int64_t b = 0; b < layout.batch(); ++b) lengths[b] = layout.length(b);
  return lengths;
}

}  // namespace

SdpaCall MakeCall(const Route& route, const SequenceLayout& queries, const SequenceLayout& keys,
                  bool causal, const ExplicitMask& mask, absl::Span<const float> head_mask,
                  const ForwardOptions& options, const ForwardOutputs& outputs) {
  SdpaCall call;
  call.batch = queries.batch();
  call.q_len = queries.max_length();
  call.kv_len = keys.max_length();
  call.q_lengths = Lengths(queries);
  call.kv_lengths = Lengths(keys);
  call.causal = causal;
  call.mask = mask;
  call.head_mask = head_mask;
  call.maps = &options.maps;
  call.statistics = options.head_statistics;
  call.bf16 = route.bf16();
  call.blocked = route.blocked;
  call.block_queries = route.block_queries;
  call.block_keys = route.block_keys;
  call.own_block_kernels = route.own_block_kernels;
  call.threads = route.threads;
  call.attention_maps = outputs.attention_maps;
  call.head_entropy = outputs.head_entropy;
  call.head_max_weight = outputs.head_max_weight;
  return call;
}

ForwardInfo MakeInfo(const Route& route) {
  ForwardInfo info;
  info.precision = route.precision;
  info.kernel_path = route.kernel_path();
  return info;
}

absl::Status Cancelled() {
  return absl::CancelledError("attention forward stopped: should_stop returned true");
}

bool ShouldStop(const ForwardOptions& options, WorkspaceState& workspace) {
  if (!options.should_stop) return false;
  workspace.stream.wait();
  return options.should_stop();
}

}  // namespace attnserve::core::internal
