#include "server/http/http_front.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace attnserve::server {
namespace {

constexpr size_t kReadChunkBytes = 64 * 1024;

const char* ReasonPhrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 308: return "Permanent Redirect";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Error";
  }
}

HttpResponse Error(int status, absl::string_view message) {
  return HttpResponse{.status = status, .body = JsonErrorBody(message)};
}

// Splits "/a/b/" into {"a", "b"} (one trailing slash ignored); raw, not
// decoded.
std::vector<absl::string_view> Segments(absl::string_view path) {
  if (absl::StartsWith(path, "/")) path.remove_prefix(1);
  if (absl::EndsWith(path, "/")) path.remove_suffix(1);
  if (path.empty()) return {};
  return absl::StrSplit(path, '/');
}

// Percent-decodes one path segment; nullopt when malformed or when it
// decodes to a '/' or a NUL (a segment stays one segment).
std::optional<std::string> DecodeSegment(absl::string_view raw) {
  std::string out;
  out.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '%') {
      out += raw[i];
      continue;
    }
    int value = 0;
    if (i + 2 >= raw.size()) return std::nullopt;
    for (int k = 1; k <= 2; ++k) {
      const char c = raw[i + k];
      int digit;
      if (c >= '0' && c <= '9') digit = c - '0';
      else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
      else return std::nullopt;
      value = value * 16 + digit;
    }
    if (value == '/' || value == 0) return std::nullopt;
    out += static_cast<char>(value);
    i += 2;
  }
  return out;
}

// Whether `path` matches `pattern`, and its {} segments when it does.
bool Match(absl::string_view pattern, const std::vector<absl::string_view>& path,
           std::vector<absl::string_view>& params) {
  const std::vector<absl::string_view> want = Segments(pattern);
  if (want.size() != path.size()) return false;
  params.clear();
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == "{}") {
      if (path[i].empty()) return false;
      params.push_back(path[i]);
    } else if (want[i] != path[i]) {
      return false;
    }
  }
  return true;
}

// The port of an IPv4 or IPv6 socket address, and its address as text.
bool AddressOf(const sockaddr_storage& address, std::string& text, int& port) {
  char buffer[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(address);
    if (inet_ntop(AF_INET, &a.sin_addr, buffer, sizeof(buffer)) == nullptr) return false;
    port = ntohs(a.sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(address);
    if (inet_ntop(AF_INET6, &a.sin6_addr, buffer, sizeof(buffer)) == nullptr) return false;
    port = ntohs(a.sin6_port);
  } else {
    return false;
  }
  text = buffer;
  return true;
}

// Shuts down this process' TCP connection from peer_address:peer_port to
// local_port (civetweb does not expose its sockets): the read blocked on it
// returns. The descriptor stays open, so it cannot be reused under civetweb.
void ShutDownConnection(const std::string& peer_address, int peer_port, int local_port) {
  DIR* fds = opendir("/proc/self/fd");
  if (fds == nullptr) return;
  while (const dirent* entry = readdir(fds)) {
    int fd;
    if (!absl::SimpleAtoi(entry->d_name, &fd)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_size = sizeof(peer), local_size = sizeof(local);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0) continue;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0) continue;
    std::string peer_text, local_text;
    int peer_p = 0, local_p = 0;
    if (!AddressOf(peer, peer_text, peer_p) || !AddressOf(local, local_text, local_p)) continue;
    if (peer_p == peer_port && local_p == local_port && peer_text == peer_address) {
      shutdown(fd, SHUT_RDWR);
      break;
    }
  }
  closedir(fds);
}

// Opens and closes one connection to host:port (no error if it fails).
void ConnectOnce(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  const int fd = socket(found->ai_family, SOCK_STREAM, 0);
  if (fd >= 0) {
    connect(fd, found->ai_addr, found->ai_addrlen);
    close(fd);
  }
  freeaddrinfo(found);
}

// Where this host reaches a listener bound to `address` (host:port).
std::string LoopbackFor(absl::string_view address) {
  absl::string_view host = address.substr(0, address.rfind(':'));
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return std::string(host);
}

// Whether `port` is empty or decimal digits (at most 5).
bool PortText(absl::string_view port) {
  if (port.size() > 5) return false;
  for (char c : port) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

bool HostAllowed(absl::string_view host, const std::vector<std::string>& allowed) {
  // name[:port], where an IPv6 name is bracketed: [::1]:8000.
  absl::string_view name = host;
  absl::string_view port;
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return false;
    name = host.substr(0, close + 1);
    absl::string_view rest = host.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':' || rest.size() < 2) return false;
      port = rest.substr(1);
    }
  } else if (const size_t colon = host.find(':'); colon != absl::string_view::npos) {
    name = host.substr(0, colon);
    port = host.substr(colon + 1);
    if (port.empty()) return false;
  }
  if (name.empty() || !PortText(port)) return false;
  for (absl::string_view known : {"localhost", "127.0.0.1", "[::1]"}) {
    if (absl::EqualsIgnoreCase(name, known)) return true;
  }
  for (const std::string& known : allowed) {
    if (absl::EqualsIgnoreCase(name, known)) return true;
  }
  return false;
}

bool OriginMatchesHost(absl::string_view origin, absl::string_view host) {
  for (absl::string_view scheme : {"http://", "https://"}) {
    if (origin.size() == scheme.size() + host.size() &&
        absl::StartsWithIgnoreCase(origin, scheme) &&
        absl::EqualsIgnoreCase(origin.substr(scheme.size()), host)) {
      return true;
    }
  }
  return false;
}

std::string JsonErrorBody(absl::string_view message) {
  return nlohmann::json{{"error", std::string(message)}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
}

HttpFront::HttpFront(HttpFrontOptions options, std::vector<HttpRoute> routes)
    : options_(std::move(options)), routes_(std::move(routes)) {}

absl::StatusOr<std::unique_ptr<HttpFront>> HttpFront::Create(HttpFrontOptions options,
                                                             std::vector<HttpRoute> routes) {
  if (options.address.empty()) return absl::InvalidArgumentError("address: empty");
  if (options.threads < 1 || options.max_body_bytes < 1 || options.request_timeout_ms < 1 ||
      options.keep_alive_timeout_ms < 1) {
    return absl::InvalidArgumentError("threads, max_body_bytes and the timeouts must be positive");
  }
  for (const HttpRoute& route : routes) {
    if (!absl::StartsWith(route.pattern, "/") || route.handler == nullptr ||
        (route.method != "GET" && route.method != "POST")) {
      return absl::InvalidArgumentError(absl::StrCat("route '", route.pattern, "': malformed"));
    }
  }
  std::unique_ptr<HttpFront> front(new HttpFront(std::move(options), std::move(routes)));
  const HttpFrontOptions& o = front->options_;
  // civetweb 1.15's option names (its UserManual). No document_root: nothing
  // but the routes is served.
  const std::string threads = std::to_string(o.threads);
  const std::string request_timeout = std::to_string(o.request_timeout_ms);
  const std::string keep_alive_timeout = std::to_string(o.keep_alive_timeout_ms);
  const std::string header_bytes = std::to_string(HttpFrontOptions::kMaxHeaderBytes);
  const std::string queue = std::to_string(HttpFrontOptions::kConnectionQueue);
  const std::string backlog = std::to_string(HttpFrontOptions::kListenBacklog);
  const char* config[] = {"listening_ports", o.address.c_str(),
                          "num_threads", threads.c_str(),
                          "request_timeout_ms", request_timeout.c_str(),
                          "enable_keep_alive", "yes",
                          "keep_alive_timeout_ms", keep_alive_timeout.c_str(),
                          "max_request_size", header_bytes.c_str(),
                          "connection_queue", queue.c_str(),
                          "listen_backlog", backlog.c_str(),
                          "decode_url", "no",
                          "tcp_nodelay", "1",
                          nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.begin_request = &HttpFront::BeginRequest;
  // civetweb's own messages (bad requests, timeouts) are not logged: the
  // client gets its answer, and a flood must not flood the log.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  // civetweb's own refusals (a malformed or too large request head, a
  // timeout) carry the JSON error body too, and close the connection.
  callbacks.http_error = [](mg_connection* connection, int status, const char*) {
    auto* self = static_cast<HttpFront*>(mg_get_user_data(mg_get_context(connection)));
    self->Reply(connection,
                Error(status, absl::StrCat("the request was refused (", status, " ",
                                           ReasonPhrase(status), ")")),
                /*close=*/true);
    return 0;
  };
  front->context_ = mg_start(&callbacks, front.get(), config);
  if (front->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on '", o.address, "' (in use, or not host:port?)"));
  }
  mg_server_port ports[4];
  const int count = mg_get_server_ports(front->context_, 4, ports);
  if (count < 1) return absl::UnavailableError("the HTTP listener has no port");
  front->port_ = ports[0].port;
  front->body_watch_ = std::thread([self = front.get()] { self->WatchBodies(); });
  return front;
}

HttpFront::~HttpFront() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (body_watch_.joinable()) body_watch_.join();
  if (context_ == nullptr) return;
  // civetweb's listener waits for connections in rounds of a second or two
  // and sees the stop only between them: connecting ends the round at once.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped, host = LoopbackFor(options_.address)] {
    while (!stopped.load()) {
      ConnectOnce(host, port_);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  mg_stop(context_);
  stopped.store(true);
  waker.join();
}

void HttpFront::WatchBodies() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Seconds(1));
    const absl::Time now = absl::Now();
    // Under mu_: a registered body's handler is still inside ReadBody, so
    // its connection (and socket) is open.
    for (auto& [id, read] : body_reads_) {
      if (read.cut || now < read.deadline) continue;
      ShutDownConnection(read.peer_address, read.peer_port, read.local_port);
      read.cut = true;
    }
  }
}

bool HttpFront::Drain(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

int HttpFront::BeginRequest(mg_connection* connection) {
  const mg_request_info* info = mg_get_request_info(connection);
  auto* front = static_cast<HttpFront*>(info->user_data);
  {
    absl::MutexLock lock(&front->mu_);
    if (front->draining_) {
      front->Reply(connection, Error(503, "the server is shutting down"), /*close=*/true);
      return 503;
    }
    ++front->in_flight_;
  }
  front->Serve(connection);
  absl::MutexLock lock(&front->mu_);
  --front->in_flight_;
  return 200;
}

void HttpFront::Reply(mg_connection* connection, const HttpResponse& response, bool close,
                      bool browser) {
  if (close) mg_disable_connection_keep_alive(connection);
  std::string head = absl::StrCat(
      "HTTP/1.1 ", response.status, " ", ReasonPhrase(response.status),
      "\r\nContent-Type: ", response.content_type,
      "\r\nContent-Length: ", response.body.size(),
      "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n");
  if (browser) {
    for (const auto& [name, value] : kBrowserSecurityHeaders) {
      if (absl::string_view(name) == "X-Content-Type-Options") continue;  // above
      absl::StrAppend(&head, name, ": ", value, "\r\n");
    }
  }
  for (const auto& [name, value] : response.headers) {
    absl::StrAppend(&head, name, ": ", value, "\r\n");
  }
  if (response.status == 401) absl::StrAppend(&head, "WWW-Authenticate: Bearer\r\n");
  if (close) absl::StrAppend(&head, "Connection: close\r\n");
  absl::StrAppend(&head, "\r\n");
  mg_write(connection, head.data(), head.size());
  if (!response.body.empty()) mg_write(connection, response.body.data(), response.body.size());
}

bool HttpFront::ReadBody(mg_connection* connection, std::string& body) {
  const mg_request_info* info = mg_get_request_info(connection);
  const char* encoding = mg_get_header(connection, "Transfer-Encoding");
  const bool chunked = encoding != nullptr && absl::StrContains(absl::AsciiStrToLower(encoding), "chunked");
  const int64_t limit = options_.max_body_bytes;
  if (!chunked) {
    if (info->content_length < 0) {
      Reply(connection, Error(411, "a request body needs a Content-Length (or chunked encoding)"),
            true);
      return false;
    }
    if (info->content_length > limit) {
      Reply(connection,
            Error(413, absl::StrCat("request body: ", info->content_length,
                                    " bytes is over the limit of ", limit,
                                    " (--http_max_body_bytes)")),
            true);
      return false;
    }
    body.reserve(static_cast<size_t>(info->content_length));
  }
  // Each mg_read waits at most request_timeout_ms for the next bytes but
  // returns only once its chunk is full, so a client dribbling its body
  // would keep the thread: the body watch shuts the connection down at the
  // body's deadline. The chunk is on the heap: civetweb's threads have
  // 100 KiB stacks.
  std::vector<char> buffer(kReadChunkBytes);
  const int64_t declared = chunked ? limit : info->content_length;
  int64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = next_body_id_++;
    body_reads_[id] = BodyRead{
        .deadline = absl::Now() + absl::Milliseconds(options_.request_timeout_ms) +
                    absl::Seconds(declared / (int64_t{1} << 20)),
        .peer_address = info->remote_addr,
        .peer_port = info->remote_port,
        .local_port = info->server_port};
  }
  const bool complete = ReadBodyChunks(connection, buffer, chunked, limit, body);
  bool cut;
  {
    absl::MutexLock lock(&mu_);
    cut = body_reads_[id].cut;
    body_reads_.erase(id);
  }
  // Cut: the connection is shut down, no answer can reach the client.
  return complete && !cut;
}

bool HttpFront::ReadBodyChunks(mg_connection* connection, std::vector<char>& buffer, bool chunked,
                               int64_t limit, std::string& body) {
  const mg_request_info* info = mg_get_request_info(connection);
  while (true) {
    const int n = mg_read(connection, buffer.data(), buffer.size());
    if (n == 0) break;
    if (n < 0) {
      Reply(connection,
            Error(400, "request body: the connection failed or stalled (--http_request_timeout_ms) "
                       "while reading it"),
            true);
      return false;
    }
    if (static_cast<int64_t>(body.size()) + n > limit) {
      Reply(connection,
            Error(413, absl::StrCat("request body: over the limit of ", limit,
                                    " bytes (--http_max_body_bytes)")),
            true);
      return false;
    }
    body.append(buffer.data(), static_cast<size_t>(n));
    if (!chunked && static_cast<int64_t>(body.size()) == info->content_length) break;
  }
  if (!chunked && static_cast<int64_t>(body.size()) != info->content_length) {
    Reply(connection, Error(400, "request body: shorter than its Content-Length"), true);
    return false;
  }
  return true;
}

void HttpFront::Serve(mg_connection* connection) {
  const mg_request_info* info = mg_get_request_info(connection);
  const absl::string_view method = info->request_method != nullptr ? info->request_method : "";
  if (info->local_uri_raw == nullptr) {
    Reply(connection, Error(400, "the request target is not a path of this server"), true);
    return;
  }
  absl::string_view raw_path = info->local_uri_raw;
  // With decode_url off, a query string may still be attached.
  raw_path = raw_path.substr(0, raw_path.find('?'));
  const std::vector<absl::string_view> segments = Segments(raw_path);
  std::vector<absl::string_view> raw_params;
  const HttpRoute* route = nullptr;
  bool path_known = false;
  for (const HttpRoute& candidate : routes_) {
    if (!Match(candidate.pattern, segments, raw_params)) continue;
    path_known = true;
    if (candidate.method == method) {
      route = &candidate;
      break;
    }
  }
  const bool browser = route != nullptr ? route->browser_facing : BrowserPath(segments);
  if (browser) {
    // Before anything else: a page of another site, or one reached through a
    // name that rebinds to this host, learns nothing but the refusal.
    const char* host = mg_get_header(connection, "Host");
    if (host == nullptr || !HostAllowed(host, options_.allowed_hosts)) {
      Reply(connection,
            Error(403, absl::StrCat("Host '", host == nullptr ? "" : host,
                                    "' is not allowed here (--http_allowed_hosts)")),
            true, browser);
      return;
    }
    const char* origin = mg_get_header(connection, "Origin");
    if (origin != nullptr && !OriginMatchesHost(origin, host)) {
      Reply(connection,
            Error(403, absl::StrCat("Origin '", origin, "' is not this server's (http://", host,
                                    "): cross-site requests are refused")),
            true, browser);
      return;
    }
  }
  if (route == nullptr) {
    // A body the route would not read is not drained: the connection closes.
    Reply(connection,
          path_known ? Error(405, "method not allowed on this path")
                     : Error(404, "no such path (the Open Inference Protocol's are under /v2)"),
          true, browser);
    return;
  }
  HttpRequest request;
  request.method = std::string(method);
  request.path = std::string(raw_path);
  // raw_params: the matched route's segments (the loop stopped at it).
  for (absl::string_view raw : raw_params) {
    std::optional<std::string> decoded = DecodeSegment(raw);
    if (!decoded.has_value()) {
      Reply(connection, Error(400, "a path segment is not valid percent-encoding"), true, browser);
      return;
    }
    request.path_params.push_back(*std::move(decoded));
  }
  if (const char* authorization = mg_get_header(connection, "Authorization")) {
    request.authorization = authorization;
  }
  if (route->needs_token && options_.tokens.has_value()) {
    absl::StatusOr<Principal> caller = options_.tokens->Authenticate(
        request.authorization.has_value()
            ? std::optional<absl::string_view>(*request.authorization)
            : std::nullopt);
    if (!caller.ok()) {
      Reply(connection, Error(401, caller.status().message()), true, browser);
      return;
    }
  }
  if (route->takes_body) {
    const char* type = mg_get_header(connection, "Content-Type");
    if (type == nullptr ||
        !absl::StartsWithIgnoreCase(absl::StripLeadingAsciiWhitespace(type), "application/json")) {
      Reply(connection, Error(415, "the request body must be Content-Type: application/json"),
            true, browser);
      return;
    }
    if (!ReadBody(connection, request.body)) return;
  }
  Reply(connection, route->handler(request), /*close=*/false, browser);
}

bool HttpFront::BrowserPath(const std::vector<absl::string_view>& segments) const {
  if (segments.empty()) return false;
  for (const HttpRoute& route : routes_) {
    if (!route.browser_facing) continue;
    const std::vector<absl::string_view> pattern = Segments(route.pattern);
    if (!pattern.empty() && pattern[0] == segments[0]) return true;
  }
  return false;
}

}  // namespace attnserve::server
