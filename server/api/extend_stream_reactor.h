#ifndef ATTNSERVE_SERVER_API_EXTEND_STREAM_REACTOR_H_
#define ATTNSERVE_SERVER_API_EXTEND_STREAM_REACTOR_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.pb.h"
#include "server/api/call_observer.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// The reactor of one ExtendStream call, reported at its edges (CallObserver):
// it reads a message, has it run (RunMessage), writes its answer, and only
// then reads the next, so one message is in flight at a time and answers come
// in order. The stream ends OK when the client half-closes; with a message's
// status when that message fails as a whole; CANCELLED (DEADLINE_EXCEEDED past
// the deadline) when the client goes away or stops reading; UNAVAILABLE when
// the server drains it (Drain). gRPC deletes it (OnDone) when the call is over.
//
// Thread-safe: gRPC's reactions, the compute executor's answer and the drain
// come from different threads; mu_ decides which of them ends the stream
// (Finish is called once, never with a write outstanding).
class ExtendStreamReactor final
    : public grpc::ServerBidiReactor<v1::ExtendRequest, v1::ExtendResponse> {
 public:
  // Runs one message: fills `response` and calls `done` exactly once, from
  // any thread, with OK (the response is sent and the stream goes on) or the
  // status that ends the stream. `request` and `response` stay valid until
  // then.
  using RunMessage =
      std::function<void(const v1::ExtendRequest& request, v1::ExtendResponse* response,
                         CallObserver& observer, std::function<void(absl::Status)> done)>;

  // As CallObserver's.
  ExtendStreamReactor(grpc::CallbackServerContext* context, Metrics* metrics, bool access_log);

  CallObserver& observer() { return observer_; }

  // Ends the stream with `status` before Start (authentication, admission).
  // Once, instead of Start.
  void Refuse(const grpc::Status& status);

  // Starts reading: each message goes through `run_message`. `on_done` runs
  // when gRPC is done with the call, just before the reactor is deleted.
  // Once, instead of Refuse, from the handler (the stream may be drained
  // from the moment the service lists it: it then reads nothing).
  void Start(RunMessage run_message, std::function<void()> on_done);

  // The server drains: the stream is to end UNAVAILABLE at its next message
  // boundary. True when it is idle (waiting for a message): the caller must
  // then call FinishDrained, once, holding no lock that on_done takes (the
  // reactor stays alive until then). False when a message is running (the
  // stream ends once it is answered) or the stream is ending anyway.
  bool MarkDrained();
  void FinishDrained();

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // The running message's answer (RunMessage's `done`).
  void Answer(absl::Status status);
  // Reports the call and finishes it; called once, by whoever set ending_.
  void End(const grpc::Status& status);
  // CANCELLED, or DEADLINE_EXCEEDED once the deadline has passed: the
  // client's part when a read or write fails.
  grpc::Status ClientGone(const char* what) const;

  grpc::CallbackServerContext* const context_;
  CallObserver observer_;
  RunMessage run_message_;
  std::function<void()> on_done_;
  // The message being read or run, and its answer being written: one at a
  // time, so neither is touched by two threads at once.
  v1::ExtendRequest request_;
  v1::ExtendResponse response_;

  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;      // a message read and not yet answered
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // MarkDrained was called
  bool ending_ ABSL_GUARDED_BY(mu_) = false;    // someone has taken on End
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_EXTEND_STREAM_REACTOR_H_
