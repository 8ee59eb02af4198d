#include "server/api/extend_runner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/bf16.h"
#include "core/route.h"
#include "core/status_macros.h"
#include "core/validation.h"
#include "server/api/attend_plan.h"

namespace attnserve::server {
namespace {

constexpr absl::string_view kStatesDims[] = {"tokens", "d_model"};
// Room for everything in a result besides the tensors' values.
constexpr int64_t kResultFramingBytes = 256;

// `status` with the step's field path in front: "steps[i].<field>: ..." for
// a message that starts with a field name, "steps[i]: ..." otherwise.
absl::Status ForStep(int i, const absl::Status& status) {
  const absl::string_view message = status.message();
  const bool names_field =
      absl::StartsWith(message, "layer:") || absl::StartsWith(message, "hidden_states:");
  return absl::Status(status.code(), absl::StrCat("steps[", i, "]", names_field ? "." : ": ",
                                                  message));
}

float AsFloat(float value) { return value; }
float AsFloat(core::Bf16 value) { return core::Bfloat16ToFloat(value); }

// Checks what needs the session's layer: the width of the hidden states, the
// head mask, the values.
absl::Status CheckStepForLayer(const v1::ExtendStep& step, const TensorSpec& spec,
                               const Model& model, absl::string_view field) {
  const core::HeadConfig& config = model.layer->config();
  if (spec.shape[1] != config.d_model) {
    return core::InvalidField(absl::StrCat(field, ".hidden_states"),
                              absl::StrCat("d_model is ", spec.shape[1], ", model '", model.name,
                                           "' has ", config.d_model));
  }
  if (absl::Status mask = core::ValidateHeadMask(
          absl::MakeConstSpan(step.head_mask().data(), step.head_mask_size()), config.num_heads,
          absl::StrCat(field, ".head_mask"));
      !mask.ok()) {
    return mask;
  }
  // Read as sent (BF16 without converting): RunExtend converts once.
  ATTNSERVE_ASSIGN_OR_RETURN(const core::SequenceLayout layout,
                             core::SequenceLayout::Packed({spec.shape[0]}));
  const std::string states_field = absl::StrCat(field, ".hidden_states");
  return OnWireValues(step.hidden_states(), spec, [&](auto values) {
    absl::Status finite = core::ValidateFinite(values, layout, 1, config.d_model, states_field);
    if (finite.ok()) return finite;
    // Where, in the session's terms (looked for on a hit only).
    for (size_t i = 0; i < values.size(); ++i) {
      const float value = AsFloat(values[i]);
      if (std::isfinite(value)) continue;
      const int64_t row = static_cast<int64_t>(i) / config.d_model;
      return core::InvalidField(
          states_field, absl::StrCat("row ", row, " (the session's token ", step.expected_length() + row,
                                     ") holds ", value, "; states must be finite"));
    }
    return finite;
  });
}

// A step that passed CheckStep.
struct CheckedStep {
  TensorSpec hidden_states;
  std::shared_ptr<const Model> model;  // its session's layer
};

// Everything that can refuse step `i` before it is admitted (admission may
// evict other sessions for its memory): its hidden states' shape and values,
// its expected length, its session and layer.
absl::StatusOr<CheckedStep> CheckStep(const v1::ExtendStep& step, int i, SessionManager& sessions,
                                      absl::string_view owner, const RequestLimits& limits) {
  const std::string field = absl::StrCat("steps[", i, "]");
  ATTNSERVE_ASSIGN_OR_RETURN(
      TensorSpec spec,
      ValidateTensor(step.hidden_states(), absl::StrCat(field, ".hidden_states"), kStatesDims));
  const int64_t n = spec.shape[0];
  if (n > limits.max_seq_len) {
    return core::InvalidField(
        absl::StrCat(field, ".hidden_states"),
        absl::StrCat(n, " tokens is over this server's limit of ", limits.max_seq_len,
                     " a step (--max_seq_len); send the prefill in chunks"));
  }
  if (step.expected_length() < 0 || step.expected_length() > core::kMaxPositionOffset) {
    return core::InvalidField(
        absl::StrCat(field, ".expected_length"),
        absl::StrCat(step.expected_length(), " is outside [0, ", core::kMaxPositionOffset, "]"));
  }
  absl::StatusOr<std::shared_ptr<const Model>> model =
      sessions.LayerModel(step.session_id(), owner, step.layer());
  if (!model.ok()) return ForStep(i, model.status());
  ATTNSERVE_RETURN_IF_ERROR(CheckStepForLayer(step, spec, **model, field));
  return CheckedStep{std::move(spec), *std::move(model)};
}

// What a step's inputs and options hash to: a retry carries the same.
uint64_t StepFingerprint(const v1::ExtendRequest& request, const v1::ExtendStep& step) {
  const v1::Tensor& states = step.hidden_states();
  const absl::string_view values =
      !states.raw_data().empty()
          ? absl::string_view(states.raw_data())
          : absl::string_view(reinterpret_cast<const char*>(states.float_data().data()),
                              static_cast<size_t>(states.float_data_size()) * sizeof(float));
  const absl::string_view mask(reinterpret_cast<const char*>(step.head_mask().data()),
                               static_cast<size_t>(step.head_mask_size()) * sizeof(float));
  return absl::Hash<std::tuple<absl::string_view, int, absl::string_view, bool, bool, int, int>>{}(
      std::make_tuple(values, static_cast<int>(states.dtype()), mask, step.attention_maps(),
                      step.head_statistics(), static_cast<int>(request.precision()),
                      static_cast<int>(request.output_dtype())));
}

}  // namespace

absl::StatusOr<ExtendPlan> PlanExtend(const v1::ExtendRequest& request, SessionManager& sessions,
                                      absl::string_view owner, const RequestLimits& limits,
                                      int64_t max_response_bytes) {
  if (request.steps_size() == 0 || request.steps_size() > kMaxExtendSteps) {
    return core::InvalidField("steps", absl::StrCat("between 1 and ", kMaxExtendSteps,
                                                    " steps, got ", request.steps_size()));
  }
  ExtendPlan plan;
  ATTNSERVE_ASSIGN_OR_RETURN(plan.precision, PrecisionFromWire(request.precision()));
  ATTNSERVE_ASSIGN_OR_RETURN(plan.output_dtype, OutputDtypeFromWire(request.output_dtype()));
  const int64_t value_bytes = DataTypeSize(plan.output_dtype);
  plan.steps.resize(static_cast<size_t>(request.steps_size()));
  int64_t map_bytes = 0, response_bytes = 0;
  int64_t scratch_bytes = 0;  // the statistics' scratch maps of the steps that compute
  std::map<const Model*, int64_t> tokens_per_model;
  for (int i = 0; i < request.steps_size(); ++i) {
    const v1::ExtendStep& step = request.steps(i);
    ExtendStepPlan& planned = plan.steps[static_cast<size_t>(i)];
    const std::string field = absl::StrCat("steps[", i, "]");
    absl::StatusOr<CheckedStep> checked = CheckStep(step, i, sessions, owner, limits);
    if (!checked.ok()) {
      planned.status = checked.status();
      continue;
    }
    const int64_t n = checked->hidden_states.shape[0];
    const core::HeadConfig& config = checked->model->layer->config();
    const int64_t maps =
        step.attention_maps() ? config.num_heads * n * (step.expected_length() + n) : 0;
    // Statistics travel as FP32 [num_heads, n] twice; without maps they are
    // computed from FP32 maps in scratch, held to the same map limit.
    const int64_t statistics = step.head_statistics() ? 2 * config.num_heads * n : 0;
    const int64_t scratch_map_bytes =
        step.head_statistics() && !step.attention_maps()
            ? config.num_heads * n * (step.expected_length() + n) * int64_t{sizeof(float)}
            : 0;
    const int64_t bytes = (n * config.d_model + maps) * value_bytes +
                          statistics * int64_t{sizeof(float)} + kResultFramingBytes;
    if (map_bytes + maps * value_bytes + scratch_map_bytes > limits.max_attention_map_bytes ||
        response_bytes + bytes > max_response_bytes) {
      planned.status = core::InvalidField(
          absl::StrCat(field, step.attention_maps() || !step.head_statistics()
                                  ? ".attention_maps"
                                  : ".head_statistics"),
          absl::StrCat("the response's maps or bytes would pass this server's limits "
                       "(--max_attention_map_bytes ",
                       limits.max_attention_map_bytes, ", --max_send_message_bytes ",
                       max_response_bytes, "); send fewer steps or ask for fewer maps"));
      continue;
    }
    absl::StatusOr<StepLease> lease =
        sessions.BeginStep(step.session_id(), owner, step.layer(), step.expected_length(), n,
                           StepFingerprint(request, step));
    if (!lease.ok()) {
      planned.status = ForStep(i, lease.status());
      continue;
    }
    const Model& model_ref = lease->model();
    map_bytes += maps * value_bytes + scratch_map_bytes;
    response_bytes += bytes;
    const int64_t map_elements = lease->replay() ? 0 : maps;
    planned.hidden_states = std::move(checked->hidden_states);
    planned.tokens = n;
    planned.map_elements = map_elements;
    planned.head_statistics = step.head_statistics() && !lease->replay();
    planned.head_mask.assign(step.head_mask().begin(), step.head_mask().end());
    if (!lease->replay()) {
      scratch_bytes += scratch_map_bytes;
      plan.tokens += n;
      tokens_per_model[&model_ref] += n;
    }
    planned.lease = *std::move(lease);
  }
  // Memory while it runs: the inputs as FP32, outputs and maps (BF16 ones
  // computed in FP32 first), and each model's route scratch for its tokens.
  double memory = static_cast<double>(response_bytes) * (value_bytes == 2 ? 3.0 : 1.0) +
                  static_cast<double>(scratch_bytes);
  for (const auto& [model, tokens] : tokens_per_model) {
    absl::StatusOr<core::Route> route =
        core::MakeExtendRoute(model->layer->config(), tokens, plan.precision);
    if (!route.ok()) return route.status();
    memory += static_cast<double>(route->scratch_bytes()) +
              4.0 * static_cast<double>(tokens * model->layer->config().d_model);
  }
  plan.memory_bytes = static_cast<int64_t>(std::min(memory, 9.0e18));
  return plan;
}

namespace {

void SetStatus(const absl::Status& status, v1::ExtendResult* result) {
  result->set_code(static_cast<int32_t>(status.code()));
  result->set_message(std::string(status.message()));
}

// The steps of one AttentionLayer::Extend: one model, one head mask.
struct StepGroup {
  const Model* model = nullptr;
  std::vector<float> head_mask;
  std::vector<int> steps;  // request indices
};

// Groups the admitted steps that compute by model and head mask, in order.
std::vector<StepGroup> GroupSteps(const ExtendPlan& plan) {
  std::vector<StepGroup> groups;
  for (int i = 0; i < static_cast<int>(plan.steps.size()); ++i) {
    const ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
    if (!step.lease.has_value() || step.lease->replay()) continue;
    const Model* model = &step.lease->model();
    auto group = std::find_if(groups.begin(), groups.end(), [&](const StepGroup& g) {
      return g.model == model && g.head_mask == step.head_mask;
    });
    if (group == groups.end()) {
      groups.push_back({model, step.head_mask, {}});
      group = groups.end() - 1;
    }
    group->steps.push_back(i);
  }
  return groups;
}

// One group's Extend; fills its results and ends its leases. The call's own
// error, if it failed as a whole.
absl::Status RunGroup(const v1::ExtendRequest& request, const StepGroup& group, ExtendPlan& plan,
                      SessionManager& sessions, const ComputeContext& compute,
                      core::ForwardInfo& info, v1::ExtendResponse* response,
                      std::vector<ExtendComputed>* computed) {
  const core::HeadConfig& config = group.model->layer->config();
  std::vector<std::unique_ptr<FloatValues>> inputs;
  std::vector<std::unique_ptr<OutputTensor>> outputs, maps, statistics;
  std::vector<core::ExtendItem> items(group.steps.size());
  for (size_t k = 0; k < group.steps.size(); ++k) {
    const int i = group.steps[k];
    ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
    v1::ExtendResult* result = response->mutable_results(i);
    inputs.push_back(std::make_unique<FloatValues>(request.steps(i).hidden_states(),
                                                   step.hidden_states));
    const int64_t n = step.tokens;
    outputs.push_back(std::make_unique<OutputTensor>(
        std::vector<int64_t>{n, config.d_model}, plan.output_dtype, /*use_float_data=*/false,
        result->mutable_output(), nullptr));
    core::ExtendItem& item = items[k];
    item.cache = step.lease->cache();
    item.hidden_states = inputs.back()->values();
    item.first_position = step.lease->first_position();
    item.output = outputs.back()->values();
    if (step.map_elements > 0) {
      const int64_t length = request.steps(i).expected_length() + n;
      maps.push_back(std::make_unique<OutputTensor>(
          std::vector<int64_t>{config.num_heads, n, length}, plan.output_dtype, false,
          result->mutable_attention_maps(), nullptr));
      item.attention_map = maps.back()->values();
    }
    if (step.head_statistics) {
      v1::HeadStatistics* stats = result->mutable_head_statistics();
      const std::vector<int64_t> shape = {config.num_heads, n};
      statistics.push_back(std::make_unique<OutputTensor>(shape, v1::DATA_TYPE_FP32, false,
                                                          stats->mutable_entropy(), nullptr));
      item.head_entropy = statistics.back()->values();
      statistics.push_back(std::make_unique<OutputTensor>(shape, v1::DATA_TYPE_FP32, false,
                                                          stats->mutable_max_weight(), nullptr));
      item.head_max_weight = statistics.back()->values();
    }
  }
  core::ExtendOptions options;
  options.head_mask = group.head_mask;
  options.precision = plan.precision;
  options.should_stop = compute.should_stop;
  const absl::Time start = absl::Now();
  absl::StatusOr<core::ForwardInfo> ran =
      group.model->layer->Extend(absl::MakeSpan(items), options, compute.workspace);
  if (ran.ok()) {
    info = *ran;
    int64_t tokens = 0, kv_read_bytes = 0;
    for (const core::ExtendItem& item : items) {
      if (!item.status.ok()) continue;
      tokens += static_cast<int64_t>(item.output.size()) / config.d_model;
      kv_read_bytes += item.cache->length() * item.cache->layout().token_bytes();
    }
    if (computed != nullptr) {
      computed->push_back({group.model->name, ran->kernel_path, tokens, kv_read_bytes,
                           absl::Now() - start});
    }
  }
  for (auto& tensor : outputs) tensor->Commit();
  for (auto& tensor : maps) tensor->Commit();
  for (auto& tensor : statistics) tensor->Commit();
  for (size_t k = 0; k < group.steps.size(); ++k) {
    const int i = group.steps[k];
    ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
    v1::ExtendResult* result = response->mutable_results(i);
    const absl::Status status = ran.ok() ? items[k].status : ran.status();
    result->set_length(step.lease->cache()->length());
    std::string stored;
    if (status.ok()) {
      stored = result->output().SerializeAsString();
    } else {
      result->clear_output();
      result->clear_attention_maps();
      result->clear_head_statistics();
      SetStatus(ForStep(i, status), result);
    }
    sessions.EndStep(*std::move(step.lease), status, std::move(stored));
    step.lease.reset();
  }
  return ran.status();
}

}  // namespace

absl::Status RunExtend(const v1::ExtendRequest& request, ExtendPlan& plan,
                       SessionManager& sessions, const ComputeContext& compute,
                       v1::ExtendResponse* response, std::vector<ExtendComputed>* computed) {
  response->clear_results();
  for (size_t i = 0; i < plan.steps.size(); ++i) response->add_results();
  absl::Status call_status;
  core::ForwardInfo info;
  for (const StepGroup& group : GroupSteps(plan)) {
    absl::Status ran =
        RunGroup(request, group, plan, sessions, compute, info, response, computed);
    if (!ran.ok() && call_status.ok()) call_status = ran;
  }
  for (int i = 0; i < static_cast<int>(plan.steps.size()); ++i) {
    ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
    v1::ExtendResult* result = response->mutable_results(i);
    if (!step.lease.has_value()) {  // refused, or run above
      if (!step.status.ok()) SetStatus(step.status, result);
      continue;
    }
    // A replay: the first answer's output, nothing computed.
    result->set_replayed(true);
    result->set_length(request.steps(i).expected_length() + step.tokens);
    if (!result->mutable_output()->ParseFromString(step.lease->stored_output())) {
      SetStatus(absl::InternalError(absl::StrCat("steps[", i, "]: the stored output is corrupt")),
                result);
    }
    sessions.EndStep(*std::move(step.lease), absl::OkStatus(), "");
    step.lease.reset();
  }
  response->set_kernel_path(info.kernel_path);
  response->set_precision(info.precision == core::Precision::kBf16 ? v1::PRECISION_BF16
                                                                   : v1::PRECISION_FP32);
  return call_status;
}

}  // namespace attnserve::server
