#include "server/api/extend_stream_reactor.h"

#include <chrono>
#include <utility>

#include "server/api/status_util.h"

namespace attnserve::server {

ExtendStreamReactor::ExtendStreamReactor(grpc::CallbackServerContext* context, Metrics* metrics,
                                         bool access_log)
    : context_(context),
      observer_(context, RpcMethod::kExtendStream, "", metrics, access_log) {}

void ExtendStreamReactor::Refuse(const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    ending_ = true;
  }
  End(status);
}

void ExtendStreamReactor::Start(RunMessage run_message, std::function<void()> on_done) {
  run_message_ = std::move(run_message);
  on_done_ = std::move(on_done);
  {
    // A drain may have ended the stream already (after the service listed
    // it, before this): gRPC binds the reactor once the handler returns, so
    // it is still here, and nothing is left to read.
    absl::MutexLock lock(&mu_);
    if (ending_) return;
  }
  StartRead(&request_);
}

bool ExtendStreamReactor::MarkDrained() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  if (busy_ || ending_) return false;
  ending_ = true;
  return true;
}

void ExtendStreamReactor::FinishDrained() {
  // The read outstanding ends (OnReadDone(false)) and finds ending_ set.
  End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                   "the server is shutting down: open the stream again (on another replica, "
                   "for new sessions)"));
}

void ExtendStreamReactor::OnReadDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    if (ending_) return;  // drained while the read was outstanding
    if (!ok) {
      ending_ = true;
    } else {
      busy_ = true;
    }
  }
  if (!ok) {  // the client half-closed, or went away
    End(context_->IsCancelled() ? ClientGone("the client went away") : grpc::Status::OK);
    return;
  }
  response_.Clear();
  run_message_(request_, &response_, observer_,
               [this](absl::Status status) { Answer(std::move(status)); });
}

void ExtendStreamReactor::Answer(absl::Status status) {
  if (!status.ok()) {
    {
      absl::MutexLock lock(&mu_);
      ending_ = true;
    }
    response_.Clear();
    End(ToGrpcStatus(status));
    return;
  }
  // With the access log, the request id goes in the headers, which the first
  // answer sends.
  observer_.AddRequestIdToHeaders();
  StartWrite(&response_);
}

void ExtendStreamReactor::OnWriteDone(bool ok) {
  bool drained = false;
  {
    absl::MutexLock lock(&mu_);
    busy_ = false;
    ending_ = !ok || draining_;
    drained = ok && draining_;
  }
  if (!ok) {
    End(ClientGone("the client stopped reading"));
  } else if (drained) {
    FinishDrained();
  } else {
    StartRead(&request_);
  }
}

void ExtendStreamReactor::End(const grpc::Status& status) {
  observer_.Report(status);
  Finish(status);  // gRPC may delete the reactor from here on (OnDone)
}

grpc::Status ExtendStreamReactor::ClientGone(const char* what) const {
  const bool late = context_->deadline() != std::chrono::system_clock::time_point::max() &&
                    std::chrono::system_clock::now() >= context_->deadline();
  return late ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the stream's deadline passed")
              : grpc::Status(grpc::StatusCode::CANCELLED, what);
}

void ExtendStreamReactor::OnDone() {
  if (on_done_) on_done_();
  delete this;
}

}  // namespace attnserve::server
