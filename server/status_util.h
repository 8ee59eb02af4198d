#ifndef ATTNSERVE_SERVER_STATUS_UTIL_H_
#define ATTNSERVE_SERVER_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve::server {

// The one conversion from absl::Status to grpc::Status: codes map 1:1 (they
// share their numbering), the message is kept.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Text for echoing client input in an error message, bounded so a huge input
// cannot make a huge message: at most `max_chars` of `text` (then "..."), and
// at most 6 dimensions of a shape (then "... (N dims)").
std::string Abbreviate(absl::string_view text, size_t max_chars = 64);
std::string ShapeText(absl::Span<const int64_t> shape);


}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_STATUS_UTIL_H_
