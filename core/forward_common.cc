#include "core/forward_common.h"

#include <cstdint>
#include <functional>
#include <utility>
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

absl::StatusOr<RoutedCall> RouteCall(const HeadConfig& config, const RouteRequest& request,
                                     const ExplicitMask& mask, absl::Span<const float> head_mask,
                                     const ForwardOptions& options, const ForwardOutputs& outputs,
                                     WorkspaceState& workspace) {
  absl::StatusOr<Route> made = MakeRoute(config, request, options);
  if (!made.ok()) return made.status();
  RoutedCall routed;
  routed.route = *std::move(made);
  const Route& route = routed.route;
  if (absl::Status reserved = workspace.Reserve(route); !reserved.ok()) return reserved;
  SdpaCall& call = routed.call;
  call.batch = request.queries.batch();
  call.q_len = request.queries.max_length();
  call.kv_len = request.keys.max_length();
  call.q_lengths = Lengths(request.queries);
  call.kv_lengths = Lengths(request.keys);
  call.causal = request.causal;
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
  return routed;
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

bool ShouldStop(const std::function<bool()>& should_stop, WorkspaceState& workspace) {
  if (!should_stop) return false;
  workspace.stream.wait();
  return should_stop();
}

bool ShouldStop(const ForwardOptions& options, WorkspaceState& workspace) {
  return ShouldStop(options.should_stop, workspace);
}

}  // namespace attnserve::core::internal
