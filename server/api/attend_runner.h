#ifndef ATTNSERVE_SERVER_API_ATTEND_RUNNER_H_
#define ATTNSERVE_SERVER_API_ATTEND_RUNNER_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention_inputs.h"
#include "core/workspace.h"
#include "server/api/attend_plan.h"
#include "server/api/wire_response.h"
#include "server/models/layer_cache.h"

namespace attnserve::server {

// What the compute executor gives a run: the workspace it computes in (the
// executor's one, shared by every model; see core::Workspace), the block
// kernels the server was started with, and `should_stop`, polled between
// stages (CANCELLED).
struct ComputeContext {
  core::Workspace* workspace = nullptr;
  core::BlockKernels block_kernels = core::BlockKernels::kAuto;
  std::function<bool()> should_stop;
};

// Runs a planned Attend request on the core and fills `response` (output,
// maps, statistics, precision, kernel path; not timing). Call it on the
// compute executor: it is where the attention math runs. Errors as the
// core's.
absl::StatusOr<core::ForwardInfo> RunAttendPlan(const v1::AttendRequest& request,
                                                const AttendPlan& plan, LayerCache& cache,
                                                const ComputeContext& compute,
                                                WireResponse* response);

// The batch key of a planned request (see Scheduler): requests with the same
// nonzero key can run as one Forward whose result for each is its own. Nonzero
// only for self-attention on hidden states of a loaded model, without maps,
// head statistics, explicit mask, head mask or position offsets; the key
// tells the model, the precision and `causal` apart (causal masks each
// sequence on its own, so causal requests batch with causal ones). The output
// dtype and wire form may differ within a batch. 0: runs alone.
uint64_t BatchKey(const AttendPlan& plan);

// Bytes RunAttendBatch holds for a member beside its request and response:
// FP32 copies of its valid hidden-state rows and of their output (the batch's
// packed input and output). 0 for a plan that never batches (BatchKey 0).
int64_t BatchCopyBytes(const AttendPlan& plan);

// One request of a batch for RunAttendBatch.
struct BatchMember {
  const v1::AttendRequest* request = nullptr;
  const AttendPlan* plan = nullptr;  // BatchKey(*plan) equal across the batch
  WireResponse* response = nullptr;
  absl::Status status;  // set by RunAttendBatch
};

// Runs requests that share a nonzero BatchKey as one Forward over the valid
// tokens of all their sequences, packed back to back (no padding): the
// projections are one matmul over all tokens, attention runs per sequence.
// Each member's response is filled as RunAttendPlan would (padding rows 0),
// or its status says why not: an error of the Forward (e.g. CANCELLED by
// `should_stop`) goes to every member (PlanAttend refused non-finite inputs
// before they were queued). Call it on the compute executor.
void RunAttendBatch(absl::Span<BatchMember> members, LayerCache& cache,
                    const ComputeContext& compute);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_ATTEND_RUNNER_H_
