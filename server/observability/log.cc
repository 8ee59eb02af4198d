#include "server/observability/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <string>

#include <google/protobuf/stubs/logging.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve::server {

void LogLine(absl::string_view message) {
  std::string line = absl::StrCat(
      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()),
      " attnserve: ", message, "\n");
  // One write(2) keeps lines from concurrent threads whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

namespace {

void RateLimitedProtobufLog(google::protobuf::LogLevel /*level*/, const char* /*filename*/,
                            int /*line*/, const std::string& message) {
  static std::atomic<int64_t> last_second{0};
  static std::atomic<int64_t> suppressed{0};
  const int64_t now = absl::ToUnixSeconds(absl::Now());
  int64_t last = last_second.load();
  if (now == last || !last_second.compare_exchange_strong(last, now)) {
    ++suppressed;
    return;
  }
  const int64_t dropped = suppressed.exchange(0);
  LogLine(absl::StrCat("protobuf: ", message,
                       dropped > 0 ? absl::StrCat(" (", dropped, " similar lines dropped)") : ""));
}

}  // namespace

void LimitProtobufLogs() { google::protobuf::SetLogHandler(&RateLimitedProtobufLog); }

}  // namespace attnserve::server
