#ifndef ATTNSERVE_SERVER_HTTP_OPEN_INFERENCE_REST_H_
#define ATTNSERVE_SERVER_HTTP_OPEN_INFERENCE_REST_H_

#include <memory>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include "server/http/http_front.h"

namespace attnserve::server {

// The Open Inference Protocol's HTTP/REST routes (KServe v2), each a call of
// inference.GRPCInferenceService through `channel` (the gRPC server's
// in-process channel), so that REST and gRPC share one implementation, its
// validation, status codes and field names:
//   GET  /v2                                         ServerMetadata
//   GET  /v2/health/live, /v2/health/ready           ServerLive, ServerReady
//   GET  /v2/models/{name}[/versions/{v}]            ModelMetadata
//   GET  /v2/models/{name}[/versions/{v}]/ready      ModelReady
//   POST /v2/models/{name}[/versions/{v}]/infer      ModelInfer (JSON tensors:
//                                                    server/http/open_inference_json.h)
// The caller's Authorization header goes on as the call's "authorization"
// metadata; the infer routes also need a token at the front (when tokens are
// configured), so an unauthenticated body is never read. Health answers 200
// when true and 400 when false (the protocol: 4xx), with {"live": ...},
// {"ready": ...} or {"name": ..., "ready": ...}. Errors: HttpStatusFor(the
// gRPC code) with {"error": message}.
//
// The routes share one stub; thread-safe.
std::vector<HttpRoute> OpenInferenceRoutes(std::shared_ptr<grpc::Channel> channel);

// The HTTP status of a gRPC status code: INVALID_ARGUMENT, FAILED_PRECONDITION
// and OUT_OF_RANGE 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND
// 404, ALREADY_EXISTS and ABORTED 409, RESOURCE_EXHAUSTED 429, CANCELLED 499,
// UNIMPLEMENTED 501, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, the others 500.
int HttpStatusFor(grpc::StatusCode code);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_HTTP_OPEN_INFERENCE_REST_H_
