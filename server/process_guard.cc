#include "server/process_guard.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace attnserve::server {
namespace {

// Closes a descriptor when it goes out of scope.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

int RemainingMilliseconds(absl::Time deadline) {
  return static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
}

// Waits until `fd` has one of `events` or the deadline passes; false on timeout.
bool WaitFor(int fd, short events, absl::Time deadline, short* revents) {
  pollfd p{.fd = fd, .events = events, .revents = 0};
  while (true) {
    const int ready = poll(&p, 1, RemainingMilliseconds(deadline));
    if (ready > 0) {
      *revents = p.revents;
      return true;
    }
    if (ready == 0) return false;
    if (errno != EINTR) return false;
  }
}

// Whether this network namespace has an accepted socket (one with an inode)
// whose local port is `server_port` and remote port `client_port`: the
// server side of a connection from client_port, taken from the listen
// backlog by accept(). Reads /proc/self/net/tcp and tcp6.
bool ServerSideAccepted(int server_port, int client_port) {
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      if (!(fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
            timeout >> inode)) {
        continue;
      }
      auto port_of = [](const std::string& address) {
        const size_t colon = address.rfind(':');
        return colon == std::string::npos ? -1
                                          : static_cast<int>(std::strtol(
                                                address.c_str() + colon + 1, nullptr, 16));
      };
      if (port_of(local) == server_port && port_of(remote) == client_port && inode != "0") {
        return true;
      }
    }
  }
  return false;
}

// The largest open-file limit the kernel allows a process.
rlim_t KernelMaxOpenFiles() {
  std::ifstream nr_open("/proc/sys/fs/nr_open");
  int64_t value = 0;
  if (nr_open >> value && value > 0) return static_cast<rlim_t>(value);
  return 1 << 20;  // the kernel's default
}

}  // namespace

absl::StatusOr<int64_t> RaiseOpenFileLimit(int64_t min_open_files) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot read the open-file limit (RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  const rlim_t hard =
      limit.rlim_max == RLIM_INFINITY ? KernelMaxOpenFiles() : limit.rlim_max;
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur < hard) {
    rlimit raised = limit;
    raised.rlim_cur = hard;
    if (setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  const int64_t in_force = static_cast<int64_t>(limit.rlim_cur);
  if (in_force < min_open_files) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--min_open_files: the open-file limit (RLIMIT_NOFILE) is ", in_force,
        " even raised to its hard limit, below ", min_open_files,
        ": raise the hard limit (ulimit -Hn, LimitNOFILE= in a systemd unit, ulimits in "
        "compose) or lower --min_open_files"));
  }
  return in_force;
}

int64_t ResidentBytes() {
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr) return -1;
  long long size_pages = 0, resident_pages = 0;
  const int read = std::fscanf(statm, "%lld %lld", &size_pages, &resident_pages);
  std::fclose(statm);
  if (read != 2) return -1;
  return static_cast<int64_t>(resident_pages) * sysconf(_SC_PAGESIZE);
}

std::string ProbeHost(absl::string_view listen_address) {
  const size_t colon = listen_address.rfind(':');
  absl::string_view host =
      colon == absl::string_view::npos ? listen_address : listen_address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  // Every loopback address (a host without IPv6 serves "[::]" on IPv4).
  if (host == "::") return "localhost";
  return std::string(host);
}

namespace {

// ProbeListener for one resolved address; `stopped` ends the wait early
// (UNAVAILABLE "stopped").
absl::Status ProbeAddress(const addrinfo& address, const std::string& where, int port,
                          absl::Time deadline, absl::Duration timeout,
                          const std::function<bool()>& stopped) {
  ScopedFd fd(socket(address.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) {
    return absl::UnavailableError(absl::StrCat("cannot open a socket: ", std::strerror(errno)));
  }
  if (connect(fd.get(), address.ai_addr, address.ai_addrlen) != 0 && errno != EINPROGRESS) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", where, ": ", std::strerror(errno)));
  }
  // Waits in short slices, so that `stopped` is seen within kSlice.
  constexpr absl::Duration kSlice = absl::Milliseconds(50);
  short revents = 0;
  while (!WaitFor(fd.get(), POLLOUT, std::min(deadline, absl::Now() + kSlice), &revents)) {
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("connecting to ", where, " timed out"));
    }
    if (stopped && stopped()) return absl::UnavailableError("stopped");
  }
  int error = 0;
  socklen_t error_size = sizeof(error);
  getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &error_size);
  if (error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", where, ": ", std::strerror(error)));
  }
  // The kernel completes a connection in the listen backlog whether or not
  // the server ever accepts it; the server side of an accepted connection is
  // a socket with an inode, one still in the backlog has none.
  sockaddr_storage local{};
  socklen_t local_size = sizeof(local);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &local_size) != 0) {
    return absl::UnavailableError(absl::StrCat("getsockname: ", std::strerror(errno)));
  }
  const int probe_port = ntohs(local.ss_family == AF_INET6
                                   ? reinterpret_cast<const sockaddr_in6*>(&local)->sin6_port
                                   : reinterpret_cast<const sockaddr_in*>(&local)->sin_port);
  while (true) {
    if (ServerSideAccepted(port, probe_port)) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          where, " accepted no connection within ", absl::FormatDuration(timeout),
          " (connected, but the connection stayed in the listen backlog)"));
    }
    if (stopped && stopped()) return absl::UnavailableError("stopped");
    absl::SleepFor(kSlice);  // the tables can be long under a connection flood
  }
}

}  // namespace

absl::Status ProbeListener(absl::string_view host, int port, absl::Duration timeout,
                           const std::function<bool()>& stopped) {
  const absl::Time deadline = absl::Now() + timeout;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string host_string(host);
  const std::string port_string = absl::StrCat(port);
  if (const int error = getaddrinfo(host_string.c_str(), port_string.c_str(), &hints, &found);
      error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host_string, ": ", gai_strerror(error)));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found, &freeaddrinfo);
  const std::string where = absl::StrCat(host_string, ":", port);
  // Every address the name has ("localhost" may be ::1 first while the
  // server listens on 127.0.0.1 only): the listener accepts on one of them.
  absl::Status last;
  for (const addrinfo* address = found; address != nullptr; address = address->ai_next) {
    last = ProbeAddress(*address, where, port, deadline, timeout, stopped);
    if (last.ok()) return last;
  }
  return last;
}

Watchdog::Watchdog(WatchdogOptions options)
    : options_(std::move(options)), thread_([this] { Run(); }) {}

Watchdog::~Watchdog() {
  stop_.Notify();
  thread_.join();
}

void Watchdog::Run() {
  int listener_failures = 0, memory_failures = 0;
  while (!stop_.WaitForNotificationWithTimeout(options_.interval)) {
    const absl::Status probe = ProbeListener(options_.host, options_.port, options_.probe_timeout,
                                             [this] { return stop_.HasBeenNotified(); });
    if (stop_.HasBeenNotified()) return;
    listener_failures = probe.ok() ? 0 : listener_failures + 1;
    const int64_t rss = ResidentBytes();
    const bool over = options_.max_rss_bytes > 0 && rss > options_.max_rss_bytes;
    memory_failures = over ? memory_failures + 1 : 0;
    std::string reason;
    if (listener_failures >= options_.failures) {
      reason = absl::StrCat("the gRPC port no longer accepts connections (", listener_failures,
                            " probes in a row failed; last: ", probe.message(), ")");
    } else if (memory_failures >= options_.failures) {
      reason = absl::StrCat("resident memory ", rss, " bytes is over --max_rss_bytes ",
                            options_.max_rss_bytes, " (", memory_failures, " checks in a row)");
    }
    if (!reason.empty()) {
      if (options_.on_trip) options_.on_trip(reason);
      return;
    }
  }
}

}  // namespace attnserve::server
