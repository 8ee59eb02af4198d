#include "server/api/open_inference_service.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/api/model_info.h"
#include "server/api/open_inference/infer_request.h"
#include "server/api/open_inference/infer_response.h"
#include "server/api/open_inference/model_metadata.h"
#include "server/api/status_util.h"

namespace attnserve::server {
namespace {

// NOT_FOUND unless `version` is unset, "" or "1": attnserve's models have one
// version.
absl::Status CheckVersion(absl::string_view name, const std::optional<std::string>& version) {
  if (!version.has_value() || version->empty() || *version == "1") return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("version: model '", name, "' has no version '",
                                          *version,
                                          "'; attnserve's models have one version, \"1\""));
}

std::optional<std::string> VersionOf(bool has_version, const std::string& version) {
  return has_version ? std::optional<std::string>(version) : std::nullopt;
}

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

std::vector<std::string> OpenInferenceService::AuthenticatedMethodPaths() {
  std::vector<std::string> paths;
  for (const char* method : {"ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"}) {
    paths.push_back(absl::StrCat("/", inference::GRPCInferenceService::service_full_name(), "/",
                                 method));
  }
  return paths;
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
  response->set_ready(attention_->serving());
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelReady(
    grpc::CallbackServerContext* context, const inference::ModelReadyRequest* request,
    inference::ModelReadyResponse* response) {
  if (absl::StatusOr<Principal> caller = attention_->Authenticate(*context); !caller.ok()) {
    return Finish(context, caller.status());
  }
  if (request->name().empty()) return Finish(context, absl::InvalidArgumentError("name: required"));
  if (absl::Status version = CheckVersion(
          request->name(), VersionOf(request->has_version(), request->version()));
      !version.ok()) {
    return Finish(context, version);
  }
  absl::StatusOr<ModelStatus> model = registry_->Get(request->name());
  if (!model.ok()) return Finish(context, Named("name", model.status()));
  response->set_ready(model->state == ModelState::kReady && attention_->serving());
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest* /*request*/,
    inference::ServerMetadataResponse* response) {
  if (absl::StatusOr<Principal> caller = attention_->Authenticate(*context); !caller.ok()) {
    return Finish(context, caller.status());
  }
  response->set_name("attnserve");
  response->set_version(version_);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (absl::StatusOr<Principal> caller = attention_->Authenticate(*context); !caller.ok()) {
    return Finish(context, caller.status());
  }
  if (request->name().empty()) return Finish(context, absl::InvalidArgumentError("name: required"));
  if (absl::Status version = CheckVersion(
          request->name(), VersionOf(request->has_version(), request->version()));
      !version.ok()) {
    return Finish(context, version);
  }
  absl::StatusOr<std::shared_ptr<const Model>> model = registry_->Find(request->name());
  if (!model.ok()) return Finish(context, Named("name", model.status()));
  v1::ModelInfo info;
  FillModelInfo(**model, limits_, &info);
  open_inference::ModelMetadataFromInfo(info, response);
  return Finish(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* OpenInferenceService::ModelInfer(
    grpc::CallbackServerContext* context, const inference::ModelInferRequest* request,
    inference::ModelInferResponse* response) {
  // The reply's layout, from the parse step to the write step.
  auto form = std::make_shared<open_inference::InferReplyForm>();
  return attention_->HandleUnaryAttend(
      context, RpcMethod::kModelInfer,
      [this, request, form](v1::AttendRequest* attend) -> absl::Status {
        if (absl::Status translated =
                open_inference::AttendRequestFromInfer(*request, attend, form.get());
            !translated.ok()) {
          return translated;
        }
        // An unknown model, named as the protocol names it (PlanAttend would
        // say "model"); loading and failed models get PlanAttend's verdict.
        if (absl::Status found = registry_->Get(request->model_name()).status(); !found.ok()) {
          return Named("model_name", found);
        }
        return absl::OkStatus();
      },
      [form, response](WireResponse& wire) {
        return open_inference::InferResponseFromAttend(*form, wire, response);
      });
}

}  // namespace attnserve::server
