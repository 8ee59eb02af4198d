#ifndef ATTNSERVE_SERVER_API_MAP_STREAM_REACTOR_H_
#define ATTNSERVE_SERVER_API_MAP_STREAM_REACTOR_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/strings/string_view.h"
#include "server/api/call_observer.h"
#include "server/api/map_stream.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// The reactor of one AttendStream call, reported at its edges (CallObserver):
// it sends a MapStream's messages one at a time, each when gRPC has taken the
// one before (so at most one chunk waits in gRPC beside the maps' buffer),
// then finishes. gRPC deletes it (OnDone) when the call is over.
//
// Not thread-safe: the call is handled by one thread at a time (the gRPC
// thread, the compute executor, then gRPC's threads, each after the other).
class MapStreamReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // As CallObserver's.
  MapStreamReactor(grpc::CallbackServerContext* context, absl::string_view model, Metrics* metrics,
                   bool access_log);

  CallObserver& observer() { return observer_; }

  // Reports the call and finishes it with `status`, sending no message (an
  // error before anything was sent). Once, and not after Send.
  void FinishCall(const grpc::Status& status);

  // Sends `stream`, then finishes the call: OK; INTERNAL if a message cannot
  // be serialized; CANCELLED (DEADLINE_EXCEEDED past the deadline) when the
  // client stops reading. Calls `on_end` when finished. Once, not after
  // FinishCall.
  void Send(std::unique_ptr<MapStream> stream, std::function<void()> on_end);

  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // Writes message next_ of stream_, or finishes after the last.
  void WriteNext();
  void End(const grpc::Status& status);

  grpc::CallbackServerContext* const context_;
  CallObserver observer_;
  std::unique_ptr<MapStream> stream_;
  std::function<void()> on_end_;
  int64_t next_ = 0;
  grpc::ByteBuffer message_;  // the one being written
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_MAP_STREAM_REACTOR_H_
