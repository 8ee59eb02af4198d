#ifndef ATTNSERVE_SERVER_OBSERVABILITY_ACCESS_LOG_H_
#define ATTNSERVE_SERVER_OBSERVABILITY_ACCESS_LOG_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "server/observability/metrics.h"

namespace attnserve::server {

// The metadata key a request id travels under, in both directions.
inline constexpr absl::string_view kRequestIdKey = "x-request-id";

// One finished call, as the access log records it. Only what is listed here is
// logged: never metadata other than the request id (so no credentials), never
// tensor contents.
struct AccessLogEntry {
  absl::Time time = absl::UnixEpoch();  // when the call finished
  std::string request_id = {};
  RpcMethod method = RpcMethod::kAttend;
  std::string model = {};   // as the client named it (any string: it is escaped and cut)
  std::string peer = {};    // grpc's peer string, e.g. "ipv4:127.0.0.1:5678"
  std::string shapes = {};  // a JSON object of tensor shapes (see AttendShapes), or empty
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string message = {};  // the status message when not OK
  absl::Duration duration = absl::ZeroDuration();
  std::optional<absl::Duration> queue = std::nullopt;    // when the request reached the executor
  std::optional<absl::Duration> compute = std::nullopt;  // when its compute finished
};

// The entry as one JSON object on one line (no newline), e.g.
// {"time":"...","log":"access","request_id":"...","method":"Attend","model":"default",
//  "peer":"...","shapes":{"hidden_states":[2,16,768]},"code":"OK",
//  "duration_seconds":0.0123,"queue_seconds":0.0001,"compute_seconds":0.012}
std::string FormatAccessLogLine(const AccessLogEntry& entry);

// Writes FormatAccessLogLine(entry) and a newline to stderr in one write(2).
// Thread-safe.
void WriteAccessLog(const AccessLogEntry& entry);

// The client's request id when it sent a usable one (1 to 128 characters of
// [A-Za-z0-9._:-]), else a fresh random one (32 hex digits). Thread-safe.
std::string RequestIdOrNew(std::optional<absl::string_view> from_client);

// The shapes of an Attend request's tensors, as a JSON object: hidden_states,
// context, projected q/k/v and the mask, where present. At most 8 dimensions
// of each are written (a malformed request may carry more).
std::string AttendShapes(const v1::AttendRequest& request);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_OBSERVABILITY_ACCESS_LOG_H_
