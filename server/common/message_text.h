#ifndef ATTNSERVE_SERVER_COMMON_MESSAGE_TEXT_H_
#define ATTNSERVE_SERVER_COMMON_MESSAGE_TEXT_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve::server {

// Text for echoing client input in an error message, bounded so a huge input
// cannot make a huge message: at most `max_chars` of `text` (then "..."), and
// at most 6 dimensions of a shape (then "... (N dims)"). No gRPC: the model
// registry's messages use it as much as the API's.
std::string Abbreviate(absl::string_view text, size_t max_chars = 64);
std::string ShapeText(absl::Span<const int64_t> shape);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_COMMON_MESSAGE_TEXT_H_
