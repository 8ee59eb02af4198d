#include "server/api/open_inference_service.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/api/model_info.h"
#include "server/api/open_inference/infer_request.h"
#include "server/api/open_inference/infer_request_scan.h"
#include "server/api/open_inference/infer_response.h"
#include "server/api/open_inference/model_metadata.h"
#include "server/api/request_bytes.h"
#include "server/api/status_util.h"

namespace attnserve::server {
namespace {

// The registry's verdict on `name`, its message prefixed with the field.
absl::Status Named(absl::string_view field, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(field, ": ", status.message()));
}

grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

OpenInferenceService::OpenInferenceService(AttentionServiceImpl* attention,
                                           const ModelRegistry* registry,
                                           const RequestLimits& limits, std::string version)
    : attention_(attention), registry_(registry), limits_(limits), version_(std::move(version)) {}

std::string OpenInferenceService::GuardedPathPrefix() {
  return absl::StrCat("/", inference::GRPCInferenceService::service_full_name(), "/");
}

std::vector<std::string> OpenInferenceService::OpenMethodPaths() {
  return {absl::StrCat(GuardedPathPrefix(), "ServerLive"),
          absl::StrCat(GuardedPathPrefix(), "ServerReady")};
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerLive(
    grpc::CallbackServerContext* context, const inference::ServerLiveRequest* /*request*/,
    inference::ServerLiveResponse* response) {
  response->set_live(true);  // this answer is the proof
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerReady(
    grpc::CallbackServerContext* context, const inference::ServerReadyRequest* /*request*/,
    inference::ServerReadyResponse* response) {
  response->set_ready(ready_.load(std::memory_order_relaxed));
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::Observed(grpc::CallbackServerContext* context,
                                                         RpcMethod method, absl::string_view model,
                                                         const absl::Status& status) {
  ObservedReactor* reactor = attention_->NewObservedReactor(context, method, model);
  reactor->FinishCall(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelReady(
    grpc::CallbackServerContext* context, const inference::ModelReadyRequest* request,
    inference::ModelReadyResponse* response) {
  if (absl::StatusOr<Principal> caller = attention_->Authenticate(*context); !caller.ok()) {
    return Observed(context, RpcMethod::kModelReady, "", caller.status());
  }
  return Observed(context, RpcMethod::kModelReady, request->name(), [&]() -> absl::Status {
    if (request->name().empty()) return absl::InvalidArgumentError("name: required");
    ATTNSERVE_RETURN_IF_ERROR(open_inference::CheckModelVersion(
        "version", request->name(), request->has_version() ? &request->version() : nullptr));
    absl::StatusOr<ModelStatus> model = registry_->Get(request->name());
    if (!model.ok()) return Named("name", model.status());
    response->set_ready(model->state == ModelState::kReady &&
                        ready_.load(std::memory_order_relaxed));
    return absl::OkStatus();
  }());
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest* /*request*/,
    inference::ServerMetadataResponse* response) {
  if (absl::StatusOr<Principal> caller = attention_->Authenticate(*context); !caller.ok()) {
    return Observed(context, RpcMethod::kServerMetadata, "", caller.status());
  }
  response->set_name("attnserve");
  response->set_version(version_);
  return Observed(context, RpcMethod::kServerMetadata, "", absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (absl::StatusOr<Principal> caller = attention_->Authenticate(*context); !caller.ok()) {
    return Observed(context, RpcMethod::kModelMetadata, "", caller.status());
  }
  return Observed(context, RpcMethod::kModelMetadata, request->name(), [&]() -> absl::Status {
    if (request->name().empty()) return absl::InvalidArgumentError("name: required");
    ATTNSERVE_RETURN_IF_ERROR(open_inference::CheckModelVersion(
        "version", request->name(), request->has_version() ? &request->version() : nullptr));
    absl::StatusOr<std::shared_ptr<const Model>> model = registry_->Find(request->name());
    if (!model.ok()) return Named("name", model.status());
    v1::ModelInfo info;
    FillModelInfo(**model, limits_, &info);
    open_inference::ModelMetadataFromInfo(info, response);
    return absl::OkStatus();
  }());
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelInfer(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request_bytes,
                                                           grpc::ByteBuffer* response_bytes) {
  // The request until it is translated, and the reply's layout until it is
  // written.
  struct InferCall {
    inference::ModelInferRequest request;
    open_inference::InferReplyForm form;
  };
  auto call = std::make_shared<InferCall>();
  return attention_->HandleUnaryAttend(
      context, RpcMethod::kModelInfer,
      // Parsing, as Attend's: the wire form's entries counted before protobuf
      // allocates an object for each, then the message.
      [context, request_bytes, call](v1::AttendRequest* attend) -> absl::Status {
        inference::ModelInferRequest& request = call->request;
        if (request_bytes != nullptr && request_bytes->Valid() && !context->IsCancelled()) {
          ATTNSERVE_RETURN_IF_ERROR(open_inference::ScanInferRequest(*request_bytes));
        }
        ATTNSERVE_RETURN_IF_ERROR(
            ParseRequestBytes(*context, request_bytes, "inference.ModelInferRequest", &request));
        attend->set_model(request.model_name());  // labels the call
        return absl::OkStatus();
      },
      [call, response_bytes](WireResponse& wire) -> absl::Status {
        open_inference::InferWireResponse reply;
        ATTNSERVE_RETURN_IF_ERROR(
            open_inference::InferResponseFromAttend(call->form, wire, &reply));
        return reply.SerializeTo(response_bytes);
      },
      // After admission, in Attend's order: the model, then the request's
      // fields (PlanAttend's checks follow).
      [this, call](v1::AttendRequest* attend) -> absl::Status {
        inference::ModelInferRequest request;
        request.Swap(&call->request);  // what is left of it goes with this scope
        if (request.model_name().empty()) {
          return absl::InvalidArgumentError("model_name: required");
        }
        // An unknown model, named as the protocol names it (PlanAttend would
        // say "model"); loading and failed models get PlanAttend's verdict.
        ATTNSERVE_RETURN_IF_ERROR(Named("model_name", registry_->Get(request.model_name()).status()));
        ATTNSERVE_RETURN_IF_ERROR(open_inference::CheckModelVersion(
            "model_version", request.model_name(),
            request.has_model_version() ? &request.model_version() : nullptr));
        return open_inference::AttendRequestFromInfer(&request, attend, &call->form);
      });
}

}  // namespace attnserve::server
