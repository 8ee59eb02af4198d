#include "server/attend_plan.h"

#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace attnserve::server {
namespace {

constexpr absl::string_view kHiddenStatesDims[] = {"batch", "seq", "d_model"};

absl::StatusOr<core::AttentionMapMode> ToCoreMapMode(v1::AttentionMapMode mode) {
  switch (mode) {
    case v1::ATTENTION_MAP_MODE_NONE:
      return core::AttentionMapMode::kNone;
    case v1::ATTENTION_MAP_MODE_PER_HEAD:
      return core::AttentionMapMode::kPerHead;
    case v1::ATTENTION_MAP_MODE_MEAN:
      return core::AttentionMapMode::kMeanOverHeads;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("attention_maps.mode: unknown value ", static_cast<int>(mode)));
  }
}

absl::Status CheckLimit(absl::string_view what, int64_t value, int64_t limit,
                        absl::string_view flag) {
  if (value <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(what, ": ", value, " is over this server's limit of ", limit, " (--", flag, ")"));
}

}  // namespace

absl::StatusOr<AttendPlan> PlanAttend(const v1::AttendRequest& request,
                                      const ModelRegistry& registry, const RequestLimits& limits,
                                      int64_t max_response_bytes) {
  AttendPlan plan;
  if (request.model().empty()) {
    return absl::InvalidArgumentError("model: required (ListModels shows the loaded models)");
  }
  absl::StatusOr<std::shared_ptr<const Model>> model = registry.Find(request.model());
  if (!model.ok()) {
    return absl::Status(model.status().code(), absl::StrCat("model: ", model.status().message()));
  }
  plan.model = *std::move(model);
  if (!request.has_hidden_states()) {
    return absl::InvalidArgumentError("hidden_states: required, [batch, seq, d_model]");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(plan.attention_maps, ToCoreMapMode(request.attention_maps().mode()));
  ATTNSERVE_ASSIGN_OR_RETURN(plan.hidden_states,
                             ValidateTensor(request.hidden_states(), "hidden_states", kHiddenStatesDims));

  const core::HeadConfig& config = plan.model->layer->config();
  const std::vector<int64_t>& shape = plan.hidden_states.shape;
  if (shape[2] != config.d_model) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_states.shape[2] (d_model): model '",
                                                   plan.model->name, "' expects ", config.d_model,
                                                   ", got ", shape[2]));
  }
  plan.shape = {.batch = shape[0], .seq_len = shape[1]};
  plan.output_elements = plan.hidden_states.elements;

  ATTNSERVE_RETURN_IF_ERROR(
      CheckLimit("hidden_states.shape[0] (batch)", plan.shape.batch, limits.max_batch, "max_batch"));
  ATTNSERVE_RETURN_IF_ERROR(CheckLimit("hidden_states.shape[1] (seq)", plan.shape.seq_len,
                                       limits.max_seq_len, "max_seq_len"));

  // Sizes are bounded by the limits now, but the limits are flags: stay checked.
  std::optional<int64_t> map_elements =
      core::AttentionMapElements(config, plan.shape, plan.attention_maps);
  std::optional<int64_t> map_bytes =
      map_elements ? core::CheckedMul(*map_elements, sizeof(float)) : std::nullopt;
  if (!map_bytes || *map_bytes > limits.max_attention_map_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "attention_maps: ", map_bytes ? absl::StrCat(*map_bytes, " bytes") : "more bytes than int64",
        " is over this server's limit of ", limits.max_attention_map_bytes,
        " (--max_attention_map_bytes); ask for mean maps, or send fewer or shorter sequences"));
  }
  plan.attention_map_elements = *map_elements;

  const int64_t response_bytes =
      (plan.output_elements + plan.attention_map_elements) * int64_t{sizeof(float)};
  if (response_bytes > max_response_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "response: ", response_bytes, " bytes of output and maps is over this server's limit of ",
        max_response_bytes, " (--max_send_message_bytes); send fewer sequences or ask for fewer maps"));
  }
  if (plan.hidden_states.uses_float_data &&
      std::max(plan.output_elements, plan.attention_map_elements) > std::numeric_limits<int>::max()) {
    return absl::ResourceExhaustedError(
        "response: too many values for float_data; send hidden_states as raw_data");
  }
  return plan;
}

}  // namespace attnserve::server
