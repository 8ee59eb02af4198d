#ifndef ATTNSERVE_SERVER_PROCESS_GUARD_H_
#define ATTNSERVE_SERVER_PROCESS_GUARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace attnserve::server {

// What keeps the attnserve process able to serve, or ends it when it no
// longer can (SECURITY.md, "Hostile clients").

// Raises the soft open-file limit (RLIMIT_NOFILE) to the hard limit, so that
// many client connections do not exhaust descriptors. Returns the limit now
// in force; FAILED_PRECONDITION naming --min_open_files when it is below
// `min_open_files`.
absl::StatusOr<int64_t> RaiseOpenFileLimit(int64_t min_open_files);

// Resident memory of this process in bytes (/proc/self/statm), or -1 when it
// cannot be read.
int64_t ResidentBytes();

// Opens a TCP connection to host:port -- a listener in this network
// namespace -- and waits up to `timeout` until the listener has accepted it
// (its server side has left the listen backlog: /proc/self/net/tcp shows it
// with an inode). Sends nothing, so neither plaintext nor TLS servers see a
// malformed client. OK when accepted; UNAVAILABLE saying what failed
// otherwise (no descriptor for a socket, connect refused or timed out, left
// in the backlog).
// Every address `host` resolves to is tried until one accepts. `stopped`,
// when given, is polled every 50 ms and ends the wait early.
absl::Status ProbeListener(absl::string_view host, int port, absl::Duration timeout,
                           const std::function<bool()>& stopped = {});

// The host to probe for a listen address: its host, with a wildcard
// replaced by loopback: "0.0.0.0" and empty by 127.0.0.1, "[::]" by
// localhost (both families: ProbeListener tries each address).
std::string ProbeHost(absl::string_view listen_address);

struct WatchdogOptions {
  std::string host;  // ProbeHost(listen address)
  int port = 0;      // the bound gRPC port
  absl::Duration interval = absl::Seconds(5);
  absl::Duration probe_timeout = absl::Seconds(5);
  // Checks failed in a row (for one reason) that trip the watchdog.
  int failures = 3;
  // Resident memory above which a check fails; 0: not checked.
  int64_t max_rss_bytes = 0;
  // Called once, on the watchdog's thread, with the reason, when it trips.
  std::function<void(const std::string& reason)> on_trip;
};

// Every `interval` probes the listener (ProbeListener) and reads the resident
// memory; after `failures` failed probes in a row, or as many readings over
// max_rss_bytes in a row, calls on_trip once and stops checking. The caller
// then turns NOT_SERVING and exits non-zero, so that a supervisor restarts
// the process: a gRPC server whose listener stopped accepting (gRPC 1.51
// stops for good after an accept() error such as EMFILE) would otherwise live
// on, deaf, with /metrics still answering.
class Watchdog {
 public:
  explicit Watchdog(WatchdogOptions options);
  ~Watchdog();  // stops the thread
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void Run();

  const WatchdogOptions options_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_PROCESS_GUARD_H_
