#ifndef ATTNSERVE_SERVER_API_PROTO_TIME_H_
#define ATTNSERVE_SERVER_API_PROTO_TIME_H_

// Time between Abseil, protobuf's well-known types and a gRPC call.

#include <grpcpp/server_context.h>

#include <chrono>
#include <cstdint>

#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"

namespace attnserve::server {

inline void SetDuration(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t nanos = absl::ToInt64Nanoseconds(d);
  out->set_seconds(nanos / 1000000000);
  out->set_nanos(static_cast<int32_t>(nanos % 1000000000));
}

inline absl::Duration FromProto(const google::protobuf::Duration& d) {
  return absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos());
}

// The call's deadline; InfiniteFuture when it has none.
inline absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_PROTO_TIME_H_
