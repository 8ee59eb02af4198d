#include "server/attention_service.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status_macros.h"
#include "server/attend_plan.h"
#include "server/status_util.h"
#include "server/tensor_codec.h"

namespace attnserve::server {
namespace {

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

void SetDuration(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t nanos = absl::ToInt64Nanoseconds(d);
  out->set_seconds(nanos / 1000000000);
  out->set_nanos(static_cast<int32_t>(nanos % 1000000000));
}

void FillModelInfo(const Model& model, const RequestLimits& limits, v1::ModelInfo* info) {
  const core::HeadConfig& config = model.layer->config();
  info->set_name(model.name);
  info->set_description(model.description);
  v1::HeadConfig* head = info->mutable_head_config();
  head->set_d_model(static_cast<int32_t>(config.d_model));
  head->set_num_heads(static_cast<int32_t>(config.num_heads));
  head->set_num_kv_heads(static_cast<int32_t>(config.num_kv_heads));
  head->set_head_dim(static_cast<int32_t>(config.head_dim));
  head->set_scale(config.scale);
  v1::ModelLimits* model_limits = info->mutable_limits();
  model_limits->set_max_batch(limits.max_batch);
  model_limits->set_max_seq_len(limits.max_seq_len);
  model_limits->set_max_attention_map_bytes(limits.max_attention_map_bytes);
  info->add_input_dtypes(v1::DATA_TYPE_FP32);
  info->add_input_dtypes(v1::DATA_TYPE_BF16);
}

// Runs a planned request on the compute executor's thread and fills
// `response`. DEADLINE_EXCEEDED / CANCELLED when the call ended before or
// between the layer's stages.
absl::Status RunAttend(grpc::CallbackServerContext* context, const v1::AttendRequest& request,
                       const AttendPlan& plan, absl::Time arrival, v1::AttendResponse* response) {
  const absl::Time deadline = DeadlineOf(*context);
  const absl::Time start = absl::Now();
  if (start >= deadline) {
    return absl::DeadlineExceededError("the deadline passed while the request was queued");
  }
  if (context->IsCancelled()) return absl::CancelledError("the client cancelled the call");

  FloatValues input(request.hidden_states(), plan.hidden_states);
  const bool use_float_data = plan.hidden_states.uses_float_data;
  core::ForwardOutputs outputs;
  outputs.output =
      PrepareFloatTensor(plan.hidden_states.shape, use_float_data, response->mutable_output());
  if (plan.attention_maps != core::AttentionMapMode::kNone) {
    std::vector<int64_t> map_shape = {plan.shape.batch};
    if (plan.attention_maps == core::AttentionMapMode::kPerHead) {
      map_shape.push_back(plan.model->layer->config().num_heads);
    }
    map_shape.push_back(plan.shape.seq_len);
    map_shape.push_back(plan.shape.seq_len);
    outputs.attention_maps =
        PrepareFloatTensor(map_shape, use_float_data, response->mutable_attention_maps());
  }

  core::ForwardOptions options;
  options.attention_maps = plan.attention_maps;
  options.should_stop = [context, deadline] {
    return context->IsCancelled() || absl::Now() >= deadline;
  };
  absl::StatusOr<core::ForwardInfo> info =
      plan.model->layer->Forward(input.values(), plan.shape, options, outputs);
  if (!info.ok()) {
    response->Clear();
    if (absl::IsCancelled(info.status()) && absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the deadline passed during compute");
    }
    return info.status();
  }
  const absl::Time end = absl::Now();

  response->set_model(plan.model->name);
  response->set_kernel_path(info->kernel_path);
  v1::Timing* timing = response->mutable_timing();
  SetDuration(start - arrival, timing->mutable_queue());
  SetDuration(end - start, timing->mutable_compute());
  timing->set_batch_size(1);
  return absl::OkStatus();
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const ServerOptions& options,
                                           const ModelRegistry* registry,
                                           ComputeExecutor* executor)
    : options_(options), registry_(registry), executor_(executor) {}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const v1::AttendRequest* request,
                                                       v1::AttendResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Time arrival = absl::Now();
  switch (state_.load()) {
    case State::kStarting:
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the server is starting: models are loading; retry"));
      return reactor;
    case State::kDraining:
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"));
      return reactor;
    case State::kServing:
      break;
  }
  absl::StatusOr<AttendPlan> plan =
      PlanAttend(*request, *registry_, options_.limits, options_.max_send_message_bytes);
  if (!plan.ok()) {
    reactor->Finish(ToGrpcStatus(plan.status()));
    return reactor;
  }
  absl::Status submitted =
      executor_->Submit([context, request, response, reactor, arrival, plan = *std::move(plan)] {
        reactor->Finish(ToGrpcStatus(RunAttend(context, *request, plan, arrival, response)));
      });
  if (!submitted.ok()) reactor->Finish(ToGrpcStatus(submitted));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest* /*request*/,
                                                           v1::ListModelsResponse* response) {
  for (const auto& model : registry_->List()) {
    FillModelInfo(*model, options_.limits, response->add_models());
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (request->name().empty()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "name: required"));
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<const Model>> model = registry_->Find(request->name());
  if (!model.ok()) {
    reactor->Finish(ToGrpcStatus(
        absl::Status(model.status().code(), absl::StrCat("name: ", model.status().message()))));
    return reactor;
  }
  FillModelInfo(**model, options_.limits, response);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace attnserve::server
