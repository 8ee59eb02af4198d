#include "server/http/open_inference_rest.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/client_context.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "inference/open_inference.grpc.pb.h"
#include "server/http/open_inference_json.h"

namespace attnserve::server {
namespace {

using Stub = inference::GRPCInferenceService::Stub;

std::string Dump(const nlohmann::json& json) {
  return json.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

HttpResponse ErrorResponse(int status, absl::string_view message) {
  return HttpResponse{.status = status, .body = JsonErrorBody(message)};
}

HttpResponse FromGrpcError(const grpc::Status& status) {
  if (status.error_message().empty()) {  // e.g. UNIMPLEMENTED from gRPC itself
    return ErrorResponse(HttpStatusFor(status.error_code()),
                         absl::StrCat("the call ended with gRPC status ",
                                      static_cast<int>(status.error_code())));
  }
  return ErrorResponse(HttpStatusFor(status.error_code()), status.error_message());
}

// A call's context: the caller's token passed on.
void PassCredentials(const HttpRequest& request, grpc::ClientContext& context) {
  if (request.authorization.has_value()) {
    context.AddMetadata("authorization", *request.authorization);
  }
}

// {model} or {model, version} of the route's path.
template <typename Request>
void SetModel(const HttpRequest& http, Request& request) {
  request.set_name(http.path_params[0]);
  if (http.path_params.size() > 1) request.set_version(http.path_params[1]);
}

HttpResponse Health(bool value, const char* key, const std::string* name) {
  nlohmann::json body;
  if (name != nullptr) body["name"] = *name;
  body[key] = value;
  return HttpResponse{.status = value ? 200 : 400, .body = Dump(body)};
}

HttpResponse ServerLive(Stub& stub, const HttpRequest& http) {
  grpc::ClientContext context;
  PassCredentials(http, context);
  inference::ServerLiveResponse response;
  grpc::Status status = stub.ServerLive(&context, {}, &response);
  if (!status.ok()) return FromGrpcError(status);
  return Health(response.live(), "live", nullptr);
}

HttpResponse ServerReady(Stub& stub, const HttpRequest& http) {
  grpc::ClientContext context;
  PassCredentials(http, context);
  inference::ServerReadyResponse response;
  grpc::Status status = stub.ServerReady(&context, {}, &response);
  if (!status.ok()) return FromGrpcError(status);
  return Health(response.ready(), "ready", nullptr);
}

HttpResponse ServerMetadata(Stub& stub, const HttpRequest& http) {
  grpc::ClientContext context;
  PassCredentials(http, context);
  inference::ServerMetadataResponse response;
  grpc::Status status = stub.ServerMetadata(&context, {}, &response);
  if (!status.ok()) return FromGrpcError(status);
  return HttpResponse{.body = ServerMetadataToJson(response)};
}

HttpResponse ModelMetadata(Stub& stub, const HttpRequest& http) {
  grpc::ClientContext context;
  PassCredentials(http, context);
  inference::ModelMetadataRequest request;
  SetModel(http, request);
  inference::ModelMetadataResponse response;
  grpc::Status status = stub.ModelMetadata(&context, request, &response);
  if (!status.ok()) return FromGrpcError(status);
  return HttpResponse{.body = ModelMetadataToJson(response)};
}

HttpResponse ModelReady(Stub& stub, const HttpRequest& http) {
  grpc::ClientContext context;
  PassCredentials(http, context);
  inference::ModelReadyRequest request;
  SetModel(http, request);
  inference::ModelReadyResponse response;
  grpc::Status status = stub.ModelReady(&context, request, &response);
  if (!status.ok()) return FromGrpcError(status);
  return Health(response.ready(), "ready", &http.path_params[0]);
}

HttpResponse ModelInfer(Stub& stub, const HttpRequest& http) {
  absl::StatusOr<inference::ModelInferRequest> request = InferRequestFromJson(
      http.body, http.path_params[0], http.path_params.size() > 1 ? http.path_params[1] : "");
  if (!request.ok()) return ErrorResponse(400, request.status().message());
  grpc::ClientContext context;
  PassCredentials(http, context);
  inference::ModelInferResponse response;
  grpc::Status status = stub.ModelInfer(&context, *request, &response);
  if (!status.ok()) return FromGrpcError(status);
  absl::StatusOr<std::string> body = InferResponseToJson(response);
  if (!body.ok()) {
    return ErrorResponse(
        HttpStatusFor(static_cast<grpc::StatusCode>(body.status().code())),
        body.status().message());
  }
  return HttpResponse{.body = *std::move(body)};
}

}  // namespace

int HttpStatusFor(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return 200;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE: return 400;
    case grpc::StatusCode::UNAUTHENTICATED: return 401;
    case grpc::StatusCode::PERMISSION_DENIED: return 403;
    case grpc::StatusCode::NOT_FOUND: return 404;
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::ABORTED: return 409;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return 429;
    case grpc::StatusCode::CANCELLED: return 499;
    case grpc::StatusCode::UNIMPLEMENTED: return 501;
    case grpc::StatusCode::UNAVAILABLE: return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return 504;
    default: return 500;
  }
}

std::vector<HttpRoute> OpenInferenceRoutes(std::shared_ptr<grpc::Channel> channel) {
  std::shared_ptr<Stub> stub = inference::GRPCInferenceService::NewStub(std::move(channel));
  auto bind = [stub](HttpResponse (*call)(Stub&, const HttpRequest&)) {
    return [stub, call](const HttpRequest& request) { return call(*stub, request); };
  };
  std::vector<HttpRoute> routes = {
      {.method = "GET", .pattern = "/v2", .handler = bind(&ServerMetadata)},
      {.method = "GET", .pattern = "/v2/health/live", .handler = bind(&ServerLive)},
      {.method = "GET", .pattern = "/v2/health/ready", .handler = bind(&ServerReady)},
  };
  for (const char* model : {"/v2/models/{}", "/v2/models/{}/versions/{}"}) {
    const std::string base = model;
    routes.push_back({.method = "GET", .pattern = base, .handler = bind(&ModelMetadata)});
    routes.push_back(
        {.method = "GET", .pattern = base + "/ready", .handler = bind(&ModelReady)});
    routes.push_back({.method = "POST",
                      .pattern = base + "/infer",
                      .needs_token = true,
                      .takes_body = true,
                      .handler = bind(&ModelInfer)});
  }
  return routes;
}

}  // namespace attnserve::server
