#include "client/extend_stream.h"

#include <utility>

#include "client/attention_client.h"

namespace attnserve::client {

ExtendStream::ExtendStream(v1::AttentionService::Stub& stub, const ClientOptions& options,
                           absl::Time deadline, int64_t client_limit)
    : client_limit_(client_limit) {
  AddCallMetadata(options, context_);
  if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
  stream_ = stub.ExtendStream(&context_);
}

ExtendStream::~ExtendStream() {
  if (ended_.has_value()) return;
  context_.TryCancel();
  End(0, /*unanswered=*/false).IgnoreError();
}

absl::StatusOr<v1::ExtendResponse> ExtendStream::Extend(const v1::ExtendRequest& request) {
  if (ended_.has_value()) return *ended_;
  v1::ExtendResponse response;
  if (!stream_->Write(request) || !stream_->Read(&response)) {
    return End(static_cast<int64_t>(request.ByteSizeLong()), /*unanswered=*/true);
  }
  return response;
}

absl::Status ExtendStream::Close() {
  if (ended_.has_value()) return *ended_;
  stream_->WritesDone();
  return End(0, /*unanswered=*/false);
}

absl::Status ExtendStream::End(int64_t request_bytes, bool unanswered) {
  v1::ExtendResponse unread;
  while (stream_->Read(&unread)) {
  }
  const grpc::Status finished = stream_->Finish();
  absl::Status status(static_cast<absl::StatusCode>(finished.error_code()),
                      finished.error_message());
  if (status.ok() && unanswered) {
    status = absl::InternalError("the server ended the stream without answering the message");
  }
  ended_ = ExplainMessageSizeError(status, request_bytes, client_limit_);
  return *ended_;
}

}  // namespace attnserve::client
