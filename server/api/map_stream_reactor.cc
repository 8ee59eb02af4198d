#include "server/api/map_stream_reactor.h"

#include <chrono>
#include <utility>

#include "server/api/status_util.h"

namespace attnserve::server {

MapStreamReactor::MapStreamReactor(grpc::CallbackServerContext* context, absl::string_view model,
                                   Metrics* metrics, bool access_log)
    : context_(context), observer_(context, RpcMethod::kAttendStream, model, metrics, access_log) {}

void MapStreamReactor::FinishCall(const grpc::Status& status) {
  observer_.Report(status);
  Finish(status);
}

void MapStreamReactor::Send(std::unique_ptr<MapStream> stream, std::function<void()> on_end) {
  stream_ = std::move(stream);
  on_end_ = std::move(on_end);
  // The request id (with the access log) must go in the headers, which the
  // first message sends.
  observer_.AddRequestIdToHeaders();
  WriteNext();
}

void MapStreamReactor::OnWriteDone(bool ok) {
  if (!ok) {
    const bool late = context_->deadline() != std::chrono::system_clock::time_point::max() &&
                      std::chrono::system_clock::now() >= context_->deadline();
    End(late ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "the deadline passed while the maps were being sent")
             : grpc::Status(grpc::StatusCode::CANCELLED,
                            "the client stopped reading before the maps were all sent"));
    return;
  }
  WriteNext();
}

void MapStreamReactor::WriteNext() {
  if (next_ == stream_->size()) {
    End(grpc::Status::OK);
    return;
  }
  if (absl::Status serialized = stream_->Serialize(next_++, &message_); !serialized.ok()) {
    End(ToGrpcStatus(serialized));
    return;
  }
  StartWrite(&message_);
}

void MapStreamReactor::End(const grpc::Status& status) {
  stream_.reset();  // the maps' buffer goes once gRPC lets go of the last chunk
  // Finish may let gRPC delete this reactor at once: nothing of it after.
  std::function<void()> on_end = std::move(on_end_);
  observer_.Report(status);
  Finish(status);
  if (on_end) on_end();
}

}  // namespace attnserve::server
