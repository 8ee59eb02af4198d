#ifndef ATTNSERVE_SERVER_OBSERVABILITY_LOG_H_
#define ATTNSERVE_SERVER_OBSERVABILITY_LOG_H_

#include "absl/strings/string_view.h"

namespace attnserve::server {

// Writes one line "<RFC 3339 time> attnserve: <message>" to stderr.
// Thread-safe (one write per line). The edges of the server log; core does not.
void LogLine(absl::string_view message);

// Routes protobuf's own log lines (e.g. one per request with a string that is
// not UTF-8) through LogLine, at most one a second, so malformed requests
// cannot flood stderr. Call once at start-up.
void LimitProtobufLogs();

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_OBSERVABILITY_LOG_H_
