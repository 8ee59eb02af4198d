#ifndef ATTNSERVE_SERVER_API_REQUEST_BYTES_H_
#define ATTNSERVE_SERVER_API_REQUEST_BYTES_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "server/api/proto_time.h"

namespace attnserve::server {

// The request of a call that takes its request as bytes (a raw callback
// method), parsed into `message`, so that bytes that are not the message get
// INVALID_ARGUMENT naming the request -- gRPC's generated handler would answer
// UNIMPLEMENTED with no message. `message_name`: its full name, for the
// message. A call that died during upload (deadline, cancel) arrives with no
// bytes: DEADLINE_EXCEEDED or CANCELLED, not a malformed request. On failure
// `message` is cleared (its bytes may not be UTF-8: nothing of it may label
// the call). Thread-safe.
template <class Message>
absl::Status ParseRequestBytes(const grpc::CallbackServerContext& context,
                               const grpc::ByteBuffer* request_bytes,
                               absl::string_view message_name, Message* message) {
  if (request_bytes == nullptr || !request_bytes->Valid() || context.IsCancelled()) {
    return absl::Now() >= DeadlineOf(context)
               ? absl::DeadlineExceededError("the deadline passed before the request arrived")
               : absl::CancelledError("the call ended before the request arrived");
  }
  grpc::ByteBuffer bytes(*request_bytes);  // shares the slices; parsing consumes it
  if (!grpc::SerializationTraits<Message>::Deserialize(&bytes, message).ok()) {
    message->Clear();
    return absl::InvalidArgumentError(
        absl::StrCat("request: not a valid ", message_name,
                     " (malformed protobuf, or a string that is not UTF-8)"));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_REQUEST_BYTES_H_
