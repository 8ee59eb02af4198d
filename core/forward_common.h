#ifndef ATTNSERVE_CORE_FORWARD_COMMON_H_
#define ATTNSERVE_CORE_FORWARD_COMMON_H_

// Private to core/: what AttentionLayer::Forward and AttentionCore::Run (and,
// for the workspace and cancellation, AttentionLayer::Extend) share around
// their routes.

#include <functional>
#include <memory>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/head_config.h"
#include "core/kernels/sdpa_call.h"
#include "core/kernels/workspace_state.h"
#include "core/onednn_util.h"
#include "core/route.h"
#include "core/workspace.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {

// A validated call's route, with its buffers reserved in the workspace, and
// the kernels' call made from it.
struct RoutedCall {
  Route route;
  SdpaCall call;
};
// INVALID_ARGUMENT when the route's sizes overflow, RESOURCE_EXHAUSTED when
// its buffers cannot be allocated.
absl::StatusOr<RoutedCall> RouteCall(const HeadConfig& config, const RouteRequest& request,
                                     const ExplicitMask& mask, absl::Span<const float> head_mask,
                                     const ForwardOptions& options, const ForwardOutputs& outputs,
                                     WorkspaceState& workspace);

// What a forward on `route` reports.
ForwardInfo MakeInfo(const Route& route);

absl::Status Cancelled();

// Whether should_stop (empty: never) asks to stop, after the work queued on
// the workspace's stream has finished. The ForwardOptions form polls
// options.should_stop.
bool ShouldStop(const std::function<bool()>& should_stop, WorkspaceState& workspace);
bool ShouldStop(const ForwardOptions& options, WorkspaceState& workspace);

// Runs run(workspace state) on `given`, or on a workspace made for the call
// when `given` is null, with oneDNN's errors as INTERNAL and a failed
// allocation as RESOURCE_EXHAUSTED (`what` names the work in messages).
template <typename Run>
auto RunInWorkspace(Workspace* given, absl::string_view what, Run run)
    -> decltype(run(std::declval<WorkspaceState&>())) {
  std::unique_ptr<Workspace> made;
  if (given == nullptr) {
    absl::StatusOr<std::unique_ptr<Workspace>> workspace = Workspace::Create();
    if (!workspace.ok()) return workspace.status();
    made = *std::move(workspace);
    given = made.get();
  }
  try {
    return run(given->state());
  } catch (const dnnl::error& e) {
    return StatusFromDnnlError(e, what);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory ", what));
  }
}

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_FORWARD_COMMON_H_
