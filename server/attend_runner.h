#ifndef ATTNSERVE_SERVER_ATTEND_RUNNER_H_
#define ATTNSERVE_SERVER_ATTEND_RUNNER_H_

#include <functional>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention_inputs.h"
#include "server/attend_plan.h"
#include "server/layer_cache.h"

namespace attnserve::server {

// Runs a planned Attend request on the core and fills `response` (output,
// maps, statistics, precision, kernel path; not timing). Call it on the
// compute executor: it is where the attention math runs. `should_stop` is
// polled between stages (CANCELLED). Other errors as the core's.
absl::StatusOr<core::ForwardInfo> RunAttendPlan(const v1::AttendRequest& request,
                                                const AttendPlan& plan, LayerCache& cache,
                                                std::function<bool()> should_stop,
                                                v1::AttendResponse* response);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_ATTEND_RUNNER_H_
