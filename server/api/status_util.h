#ifndef ATTNSERVE_SERVER_API_STATUS_UTIL_H_
#define ATTNSERVE_SERVER_API_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attnserve::server {

// The one conversion from absl::Status to grpc::Status: codes map 1:1 (they
// share their numbering), the message is kept.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_STATUS_UTIL_H_
