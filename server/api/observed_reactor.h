#ifndef ATTNSERVE_SERVER_API_OBSERVED_REACTOR_H_
#define ATTNSERVE_SERVER_API_OBSERVED_REACTOR_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include "absl/strings/string_view.h"
#include "server/api/call_observer.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// The reactor of one unary call, reported at its edges (CallObserver). The
// handler creates it when the call arrives and finishes it exactly once with
// FinishCall; gRPC deletes it (OnDone) when the call is over.
//
// Not thread-safe: the call is handled by one thread at a time.
class ObservedReactor final : public grpc::ServerUnaryReactor {
 public:
  // As CallObserver's.
  ObservedReactor(grpc::CallbackServerContext* context, RpcMethod method, absl::string_view model,
                  Metrics* metrics, bool access_log)
      : observer_(context, method, model, metrics, access_log) {}

  CallObserver& observer() { return observer_; }

  // Reports the call and finishes it with `status`.
  void FinishCall(const grpc::Status& status) {
    observer_.Report(status);
    Finish(status);
  }

  void OnDone() override { delete this; }

 private:
  CallObserver observer_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_OBSERVED_REACTOR_H_
