#ifndef ATTNSERVE_SERVER_ATTEND_PLAN_H_
#define ATTNSERVE_SERVER_ATTEND_PLAN_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention_layer.h"
#include "server/model_registry.h"
#include "server/server_options.h"
#include "server/tensor_codec.h"

namespace attnserve::server {

// An Attend request that passed validation: every size it implies is known,
// within int64 and within the limits.
struct AttendPlan {
  std::shared_ptr<const Model> model;
  TensorSpec hidden_states;
  core::AttentionShape shape;
  core::AttentionMapMode attention_maps = core::AttentionMapMode::kNone;
  int64_t output_elements = 0;
  int64_t attention_map_elements = 0;
};

// Validates `request` against the registry and the limits before anything is
// allocated from its sizes:
//   INVALID_ARGUMENT   a malformed field (the message names it)
//   NOT_FOUND          the model is not loaded
//   RESOURCE_EXHAUSTED a size over `limits` or a response over
//                      max_response_bytes (the message says what to ask for)
absl::StatusOr<AttendPlan> PlanAttend(const v1::AttendRequest& request,
                                      const ModelRegistry& registry, const RequestLimits& limits,
                                      int64_t max_response_bytes);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_ATTEND_PLAN_H_
