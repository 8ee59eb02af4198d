#ifndef ATTNSERVE_SERVER_API_CALL_OBSERVER_H_
#define ATTNSERVE_SERVER_API_CALL_OBSERVER_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// Reports one call at its edges: its arrival (on construction) and its end
// (Report) to Metrics and, with the access log on, one access-log line. Each
// reactor of the service holds one.
//
// Not thread-safe: a call is handled by one thread at a time (the gRPC
// thread, then maybe the compute executor, which the scheduler orders after it).
class CallObserver {
 public:
  // `metrics` must outlive the call. `model` is the model the client named:
  // it becomes a label only through Metrics::ModelLabel. With `access_log`,
  // the request id is the client's x-request-id (if usable, else a new one)
  // and goes back to the client in the metadata (see Report).
  CallObserver(grpc::CallbackServerContext* context, RpcMethod method, absl::string_view model,
               Metrics* metrics, bool access_log);
  CallObserver(const CallObserver&) = delete;
  CallObserver& operator=(const CallObserver&) = delete;

  // The call's model label ("" unless the client named a loaded model).
  const std::string& model_label() const { return model_label_; }
  bool access_log() const { return access_log_; }

  // For the access log: a JSON object of the request's tensor shapes.
  void set_shapes(std::string shapes) { shapes_ = std::move(shapes); }
  // The request left the compute queue after `queue_wait` (reported to metrics).
  void Dequeued(absl::Duration queue_wait);
  // For the access log: how long the compute took.
  void set_compute(absl::Duration compute) { compute_ = compute; }

  // With the access log: the request id goes into the initial metadata now
  // (a streaming call's, before its first message); Report then puts it
  // nowhere else on success.
  void AddRequestIdToHeaders();

  // Reports the call as ending with `status`, once, just before the reactor
  // finishes it. With the access log, the request id goes into the initial
  // metadata of a success (unless AddRequestIdToHeaders did), which must not
  // have been sent yet, or the trailers of an error.
  void Report(const grpc::Status& status);

 private:
  grpc::CallbackServerContext* const context_;
  const RpcMethod method_;
  Metrics* const metrics_;
  const bool access_log_;
  const absl::Time arrival_;
  const std::string model_label_;
  std::string model_;  // as the client named it, for the access log
  std::string request_id_;
  bool request_id_in_headers_ = false;
  std::string shapes_;
  std::optional<absl::Duration> queue_wait_;
  std::optional<absl::Duration> compute_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_CALL_OBSERVER_H_
