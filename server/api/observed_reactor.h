#ifndef ATTNSERVE_SERVER_API_OBSERVED_REACTOR_H_
#define ATTNSERVE_SERVER_API_OBSERVED_REACTOR_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// The reactor of one unary call that reports the call at its edges: arrival
// and finish to Metrics, and, with the access log on, one access-log line. The
// handler creates it when the call arrives and finishes it exactly once with
// FinishCall; gRPC deletes it (OnDone) when the call is over.
//
// Not thread-safe: the call is handled by one thread at a time (the gRPC
// thread, then maybe the compute executor, which Submit orders after it).
class ObservedReactor final : public grpc::ServerUnaryReactor {
 public:
  // `metrics` must outlive the call. `model` is the model the client named:
  // it becomes a label only through Metrics::ModelLabel. With `access_log`,
  // the request id is the client's x-request-id (if usable, else a new one)
  // and goes back to the client in the initial metadata.
  ObservedReactor(grpc::CallbackServerContext* context, RpcMethod method, absl::string_view model,
                  Metrics* metrics, bool access_log);

  // The call's model label ("" unless the client named a loaded model).
  const std::string& model_label() const { return model_label_; }
  bool access_log() const { return access_log_; }

  // For the access log: a JSON object of the request's tensor shapes.
  void set_shapes(std::string shapes) { shapes_ = std::move(shapes); }
  // The request left the compute queue after `queue_wait` (reported to metrics).
  void Dequeued(absl::Duration queue_wait);
  // For the access log: how long the compute took.
  void set_compute(absl::Duration compute) { compute_ = compute; }

  // Reports the call and finishes it with `status`.
  void FinishCall(const grpc::Status& status);

  void OnDone() override { delete this; }

 private:
  grpc::CallbackServerContext* const context_;
  const RpcMethod method_;
  Metrics* const metrics_;
  const bool access_log_;
  const absl::Time arrival_;
  const std::string model_label_;
  std::string model_;  // as the client named it, for the access log
  std::string request_id_;
  std::string shapes_;
  std::optional<absl::Duration> queue_wait_;
  std::optional<absl::Duration> compute_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_OBSERVED_REACTOR_H_
