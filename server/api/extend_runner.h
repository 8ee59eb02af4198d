#ifndef ATTNSERVE_SERVER_API_EXTEND_RUNNER_H_
#define ATTNSERVE_SERVER_API_EXTEND_RUNNER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention_inputs.h"
#include "server/api/attend_runner.h"
#include "server/api/tensor_codec.h"
#include "server/common/server_options.h"
#include "server/sessions/session_manager.h"

namespace attnserve::server {

// Steps one Extend request may carry.
inline constexpr int kMaxExtendSteps = 1024;

// One step of an Extend request once planned: refused (status, no lease), or
// admitted (its lease holds the session's layer until the step ends).
struct ExtendStepPlan {
  absl::Status status;
  std::optional<StepLease> lease;
  TensorSpec hidden_states;  // [n, d_model], when admitted
  int64_t tokens = 0;        // n
  int64_t map_elements = 0;  // num_heads x n x length after the step, when maps are asked
  bool head_statistics = false;  // asked for, and the step computes (not a replay)
  std::vector<float> head_mask;
};

// An Extend request that passed validation, its steps begun on the sessions.
struct ExtendPlan {
  std::vector<ExtendStepPlan> steps;  // one per request step, in order
  core::Precision precision = core::Precision::kFp32;
  v1::DataType output_dtype = v1::DATA_TYPE_FP32;
  int64_t tokens = 0;        // new tokens of the admitted steps that compute
  int64_t memory_bytes = 0;  // what they hold while they run (the scheduler's budget)
};

// Validates `request` and begins its steps on `sessions` for `owner`. Returns
// INVALID_ARGUMENT (naming the field) for a request that is malformed as a
// whole: no steps or more than kMaxExtendSteps, an unknown precision or
// output dtype, maps or a response over the server's limits (head
// statistics count in the response, and the FP32 maps they are computed from
// count against --max_attention_map_bytes when the maps are not asked for). A step that
// fails on its own gets its status in the plan and no lease:
// INVALID_ARGUMENT naming "steps[i].<field>", or SessionManager::BeginStep's
// NOT_FOUND, ABORTED, OUT_OF_RANGE, RESOURCE_EXHAUSTED. The leases end in
// RunExtend, or when the plan is destroyed (as failed).
absl::StatusOr<ExtendPlan> PlanExtend(const v1::ExtendRequest& request, SessionManager& sessions,
                                      absl::string_view owner, const RequestLimits& limits,
                                      int64_t max_response_bytes);

// What one AttentionLayer::Extend of a call computed (for metrics).
struct ExtendComputed {
  std::string model;
  std::string kernel_path;
  int64_t tokens = 0;  // new tokens of its steps that succeeded
  // KV cache bytes its attention read: for each step that succeeded, the keys
  // and values of every token the layer holds after the step, once.
  int64_t kv_read_bytes = 0;
  absl::Duration duration;
};

// Runs the admitted steps (on the compute executor: one AttentionLayer::Extend
// per model and head mask over its steps), ends every lease, appends what
// each Extend computed to `computed` (when given), and fills `response`: one
// result per request step (output, maps, head statistics, the layer's
// length, or the step's status), the kernel path and precision. A replayed step gets its stored
// output without computing. Returns the call's own error (CANCELLED by
// `compute.should_stop`, INTERNAL): the steps of the Extend that failed keep
// their layers as before the call; the caller then answers the whole call
// with that error (steps of models that ran before it stay appended, and a
// retry of the call replays them).
absl::Status RunExtend(const v1::ExtendRequest& request, ExtendPlan& plan,
                       SessionManager& sessions, const ComputeContext& compute,
                       v1::ExtendResponse* response,
                       std::vector<ExtendComputed>* computed = nullptr);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_EXTEND_RUNNER_H_
