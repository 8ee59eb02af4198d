#ifndef ATTNSERVE_SERVER_API_OPEN_INFERENCE_SERVICE_H_
#define ATTNSERVE_SERVER_API_OPEN_INFERENCE_SERVICE_H_

#include <grpcpp/support/byte_buffer.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

#include "inference/open_inference.grpc.pb.h"
#include "server/api/attention_service.h"
#include "server/api/observed_reactor.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// The Open Inference Protocol (KServe V2), gRPC form: the service
// inference.GRPCInferenceService on the callback API, registered on the same
// server as attnserve.v1 (docs/open_inference.md).
//
// ModelInfer runs on Attend's one path (AttentionServiceImpl::
// HandleUnaryAttend): the same authentication, admission and drain,
// validation (PlanAttend: same codes and field names), Scheduler and compute
// executor, metrics (method "ModelInfer") and access log. Its request is
// translated by open_inference::AttendRequestFromInfer and its reply by
// InferResponseFromAttend.
//
// Health: ServerLive (true while the process answers RPCs) and ServerReady
// (set_ready: what grpc.health.v1 says, SERVING once the models are loaded
// and warm, NOT_SERVING again from the start of a shutdown's lame duck) need
// no token, like grpc.health.v1. ModelReady, ServerMetadata, ModelMetadata and
// ModelInfer are authenticated as attnserve.v1's RPCs are (UNAUTHENTICATED),
// and counted in attnserve_requests_total and the access log under their own
// method names, as GetModel is (the probes are not counted).
// A model_version other than "" or "1" is NOT_FOUND (attnserve's models have
// one version), as is a model the server does not know.
//
// Thread-safe. `attention` and `registry` must outlive the service.
class OpenInferenceService final
    : public inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
          inference::GRPCInferenceService::CallbackService> {
 public:
  // `version`: what ServerMetadata reports (the build's version).
  OpenInferenceService(AttentionServiceImpl* attention, const ModelRegistry* registry,
                       const RequestLimits& limits, std::string version);
  OpenInferenceService(const OpenInferenceService&) = delete;
  OpenInferenceService& operator=(const OpenInferenceService&) = delete;

  // Whether ServerReady (and ModelReady) say ready; false until first set.
  // The server sets it with its health status.
  void set_ready(bool ready) { ready_.store(ready, std::memory_order_relaxed); }

  // For MakeTokenAuthProcessor: every RPC of the service needs a token (its
  // path prefix, "/inference.GRPCInferenceService/", so that a method added
  // later is guarded by default) but the probes, ServerLive and ServerReady
  // (their paths).
  static std::string GuardedPathPrefix();
  static std::vector<std::string> OpenMethodPaths();

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  // ready: the model is loaded (READY) and the server ready (set_ready).
  // INVALID_ARGUMENT
  // without a name; NOT_FOUND for an unknown model or version.
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  // name "attnserve", the build's version, no extensions.
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  // open_inference::ModelMetadataFromInfo. NOT_FOUND for an unknown model or
  // version; UNAVAILABLE while the model loads; FAILED_PRECONDITION when its
  // load failed (as ModelRegistry::Find).
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  // Takes its request as bytes (ParseRequestBytes: INVALID_ARGUMENT for
  // bytes that are not a ModelInferRequest, where gRPC's generated handler
  // would answer UNIMPLEMENTED).
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request_bytes,
                                       grpc::ByteBuffer* response_bytes) override;

 private:
  // Finishes a unary call with `status`, reported to metrics and the access
  // log under `method` and `model` (as GetModel's calls are).
  grpc::ServerUnaryReactor* Observed(grpc::CallbackServerContext* context, RpcMethod method,
                                     absl::string_view model, const absl::Status& status);

  // Constant after construction.
  AttentionServiceImpl* const attention_;
  const ModelRegistry* const registry_;
  const RequestLimits limits_;
  const std::string version_;

  std::atomic<bool> ready_{false};
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_OPEN_INFERENCE_SERVICE_H_
