#ifndef ATTNSERVE_SERVER_HTTP_HTTP_FRONT_H_
#define ATTNSERVE_SERVER_HTTP_HTTP_FRONT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/security/auth.h"

struct mg_context;
struct mg_connection;

namespace attnserve::server {

// What a route's handler sees of a request.
struct HttpRequest {
  std::string method;
  // The request target's path as sent (not decoded, no query string), e.g.
  // "/explorer/" (a pattern matches it with or without a trailing slash).
  std::string path;
  // The {} segments of the route's pattern, percent-decoded, in order.
  std::vector<std::string> path_params;
  // The Authorization header, when sent (the front has checked it already on
  // routes that need a token).
  std::optional<std::string> authorization;
  // The body (routes with takes_body), at most HttpFrontOptions::max_body_bytes.
  std::string body;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  // More header fields (e.g. Location); names and values must not hold CR or LF.
  std::vector<std::pair<std::string, std::string>> headers = {};
};

struct HttpRoute {
  std::string method;  // "GET" or "POST"
  // Path segments; "{}" matches one non-empty segment (percent-decoded into
  // path_params). E.g. "/v2/models/{}/versions/{}/infer".
  std::string pattern;
  // With tokens configured, the request needs "Authorization: Bearer <token>"
  // (401 otherwise), checked before its body is read.
  bool needs_token = false;
  bool takes_body = false;
  // A route for browsers (the explorer's page and API): before anything else
  // the request's Host must be an allowed host (HttpFrontOptions::
  // allowed_hosts) and its Origin, when sent, http(s)://<that Host>; 403
  // otherwise (DNS rebinding, cross-site requests). Its answers, errors
  // included, carry the browser security headers (kBrowserSecurityHeaders).
  bool browser_facing = false;
  // Runs on the front's thread of the connection (civetweb's: a 100 KiB
  // stack, so no large locals); may block (e.g. on a gRPC call). Must be
  // thread-safe.
  std::function<HttpResponse(const HttpRequest&)> handler;
};

struct HttpFrontOptions {
  // host:port; port 0 picks a free port (see port()).
  std::string address;
  // Connections served at once (one thread each: civetweb's num_threads);
  // further accepted connections wait in a queue of kConnectionQueue, and
  // the kernel's backlog holds kListenBacklog more.
  int threads = 16;
  // Largest request body; larger: 413 before it is read (Content-Length) or
  // as soon as it passes the limit (chunked).
  int64_t max_body_bytes = int64_t{64} << 20;
  // civetweb's request_timeout_ms: a request's headers must be complete this
  // long after its first byte, and every read and write of the connection
  // (body, answer) must progress within it. The body as a whole must arrive
  // within it plus a second per MiB it declares (chunked: per MiB of
  // max_body_bytes); past that the front shuts the connection down (checked
  // about once a second), so a client that dribbles its body cannot keep a
  // thread.
  int request_timeout_ms = 30000;
  // An idle keep-alive connection is closed after this long.
  int keep_alive_timeout_ms = 5000;
  // Bearer tokens; none: no route needs one.
  std::optional<TokenSet> tokens;
  // The Host names browser-facing routes accept besides localhost, 127.0.0.1
  // and [::1] (each with or without a port), compared without case, e.g.
  // "attn.lab.example" or "[fd00::1]".
  std::vector<std::string> allowed_hosts;

  // Request line and headers together (civetweb's max_request_size).
  static constexpr int kMaxHeaderBytes = 16 * 1024;
  static constexpr int kConnectionQueue = 64;
  static constexpr int kListenBacklog = 128;
};

// The header fields of every answer of a browser-facing route: the page may
// load only its own origin's files and may not be framed, types are not
// sniffed, no Referer leaves it.
inline constexpr std::pair<const char*, const char*> kBrowserSecurityHeaders[] = {
    {"Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"},
    {"X-Content-Type-Options", "nosniff"},
    {"Referrer-Policy", "no-referrer"},
};

// Whether a Host header value names an allowed host: localhost, 127.0.0.1,
// [::1] or one of `allowed` (without case), with or without a numeric port.
// Thread-safe.
bool HostAllowed(absl::string_view host, const std::vector<std::string>& allowed);

// Whether an Origin header value is http://<host> or https://<host> for the
// request's Host header value `host` (without case). Thread-safe.
bool OriginMatchesHost(absl::string_view origin, absl::string_view host);

// The JSON error body every error of the front and its routes carries:
// {"error": message}, written by the JSON library (escaped; invalid UTF-8
// replaced).
std::string JsonErrorBody(absl::string_view message);

// An HTTP/1.1 listener (civetweb) with limits, bearer-token checks and a
// route table: the front of attnserve's HTTP port. It serves only its routes
// (no files): 404 for an unknown path, 405 for a known path with another
// method, 411 for a body without a length, 413 over max_body_bytes, 415 for
// a body that is not application/json, 401 for a missing or wrong token,
// 503 once draining; 403 on a browser-facing route for a foreign Host or
// Origin. Every error body is JsonErrorBody; no header or body
// echoes request text outside a JSON string.
//
// Thread-safe. Life: Create (listening) -> Drain (503 to new requests, waits
// for those in flight) -> destruction (stops listening, joins threads).
class HttpFront {
 public:
  // INVALID_ARGUMENT for bad options or routes, UNAVAILABLE when the address
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpFront>> Create(HttpFrontOptions options,
                                                           std::vector<HttpRoute> routes);
  ~HttpFront();
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  // The bound port (the one picked for port 0).
  int port() const { return port_; }

  // New requests get 503; waits until the requests in flight have answered,
  // or until `deadline`. False when some were still in flight then.
  bool Drain(absl::Time deadline);

 private:
  explicit HttpFront(HttpFrontOptions options, std::vector<HttpRoute> routes);
  static int BeginRequest(mg_connection* connection);
  void Serve(mg_connection* connection);
  // `browser`: adds kBrowserSecurityHeaders.
  void Reply(mg_connection* connection, const HttpResponse& response, bool close,
             bool browser = false);
  // Whether the path's first segment is that of a browser-facing route (an
  // unknown path under /explorer gets the browser treatment too).
  bool BrowserPath(const std::vector<absl::string_view>& segments) const;
  // Reads the body within the limits; false when it answered an error.
  bool ReadBody(mg_connection* connection, std::string& body);
  // The body watch: connections reading a body past their deadline are shut
  // down (their socket found by its addresses), which ends mg_read.
  struct BodyRead {
    absl::Time deadline;
    std::string peer_address;
    int peer_port = 0;
    int local_port = 0;
    bool cut = false;
  };
  void WatchBodies();
  // ReadBody's loop: false when it answered an error.
  bool ReadBodyChunks(mg_connection* connection, std::vector<char>& buffer, bool chunked,
                      int64_t limit, std::string& body);

  // Constant after Create.
  const HttpFrontOptions options_;
  const std::vector<HttpRoute> routes_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  std::string host_;  // to reach the listener when stopping

  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_body_id_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int64_t, BodyRead> body_reads_ ABSL_GUARDED_BY(mu_);
  std::thread body_watch_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_HTTP_HTTP_FRONT_H_
