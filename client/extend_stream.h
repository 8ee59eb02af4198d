#ifndef ATTNSERVE_CLIENT_EXTEND_STREAM_H_
#define ATTNSERVE_CLIENT_EXTEND_STREAM_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"

namespace attnserve::client {

struct ClientOptions;  // client/attention_client.h

class AttentionClient;

// One ExtendStream call (AttentionClient::OpenExtendStream): Extend messages
// sent and answered one at a time over one stream, for a decoder that steps
// many times (no new call per step). Each answer is what Extend would answer
// for the same message.
//
// Not thread-safe: one decoder drives it.
class ExtendStream {
 public:
  // Cancels the stream unless it was closed.
  ~ExtendStream();
  ExtendStream(const ExtendStream&) = delete;
  ExtendStream& operator=(const ExtendStream&) = delete;

  // Sends `request` and waits for its answer. When the stream has ended
  // instead, its status as the server gave it (e.g. INVALID_ARGUMENT for a
  // malformed message, RESOURCE_EXHAUSTED when the compute queue was full,
  // UNAVAILABLE when the server drains, DEADLINE_EXCEEDED past the stream's
  // deadline; a message over a size limit explained as
  // ExplainMessageSizeError does), and every later call returns it again:
  // open a new stream to go on.
  absl::StatusOr<v1::ExtendResponse> Extend(const v1::ExtendRequest& request);

  // Half-closes the stream and returns its status: OK when the server ended
  // it OK, or the status it had ended with. Later calls return it again.
  absl::Status Close();

 private:
  friend class AttentionClient;
  // `deadline`: of the whole stream (InfiniteFuture: none); `client_limit`:
  // the client's receive limit, to explain a message over it.
  ExtendStream(v1::AttentionService::Stub& stub, const ClientOptions& options,
               absl::Time deadline, int64_t client_limit);

  // Reads what is left, finishes the call and keeps its status (an OK end
  // before an answer becomes `unanswered`).
  absl::Status End(int64_t request_bytes, bool unanswered);

  const int64_t client_limit_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ExtendRequest, v1::ExtendResponse>> stream_;
  std::optional<absl::Status> ended_;
};

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_EXTEND_STREAM_H_
