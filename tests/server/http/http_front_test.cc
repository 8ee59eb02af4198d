// The HTTP front on a real loopback port, spoken to with raw sockets: routes
// and their decoded parameters, 404/405, body limits (413 before the body is
// read, chunked too), 411/415, bearer tokens checked before the body, the
// drain, and a silent connection closed by the request timeout.
#include "server/http/http_front.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace attnserve::server {
namespace {

using ::testing::HasSubstr;

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  // A bound on a test that goes wrong, not a timing assertion.
  timeval timeout{.tv_sec = 60, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;  // the server may close early (413): what it sent is read next
    sent += static_cast<size_t>(n);
  }
}

// Reads until the server closes the connection.
std::string ReadToClose(int fd) {
  std::string out;
  char buffer[4096];
  while (true) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

struct Reply {
  int status = 0;
  std::string head;
  std::string body;
};

Reply Parse(const std::string& text) {
  Reply reply;
  const size_t end = text.find("\r\n\r\n");
  if (text.size() < 12 || end == std::string::npos) return reply;
  EXPECT_TRUE(absl::SimpleAtoi(text.substr(9, 3), &reply.status)) << text;
  reply.head = text.substr(0, end);
  reply.body = text.substr(end + 4);
  return reply;
}

// One request on its own connection ("Connection: close" is added).
Reply Exchange(int port, const std::string& method, const std::string& path,
               const std::vector<std::string>& headers = {}, const std::string& body = "") {
  const int fd = Connect(port);
  std::string request = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\n");
  for (const std::string& h : headers) absl::StrAppend(&request, h, "\r\n");
  absl::StrAppend(&request, "Connection: close\r\n\r\n", body);
  SendAll(fd, request);
  Reply reply = Parse(ReadToClose(fd));
  close(fd);
  return reply;
}

std::string ErrorOf(const Reply& reply) {
  const nlohmann::json json = nlohmann::json::parse(reply.body, nullptr, false);
  if (!json.is_object() || json.size() != 1 || !json.contains("error")) return "<not an error body>";
  return json["error"].get<std::string>();
}

HttpRoute Echo(const std::string& method, const std::string& pattern, bool needs_token = false,
               bool takes_body = false) {
  return HttpRoute{
      .method = method,
      .pattern = pattern,
      .needs_token = needs_token,
      .takes_body = takes_body,
      .handler = [](const HttpRequest& request) {
        nlohmann::json out = {{"params", request.path_params}, {"body", request.body}};
        return HttpResponse{.body = out.dump()};
      }};
}

// The front on a free loopback port; `edit` changes the default options.
std::unique_ptr<HttpFront> Start(std::vector<HttpRoute> routes,
                                 const std::function<void(HttpFrontOptions&)>& edit = nullptr) {
  HttpFrontOptions options;
  if (edit) edit(options);
  options.address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<HttpFront>> front =
      HttpFront::Create(std::move(options), std::move(routes));
  EXPECT_TRUE(front.ok()) << front.status();
  return front.ok() ? *std::move(front) : nullptr;
}

TEST(HttpFront, RoutesMatchAndDecodeTheirParameters) {
  auto front = Start({Echo("GET", "/v2"), Echo("GET", "/v2/models/{}/versions/{}")});
  ASSERT_NE(front, nullptr);
  Reply reply = Exchange(front->port(), "GET", "/v2/models/a%20b%C3%A9/versions/7?x=1");
  ASSERT_EQ(reply.status, 200) << reply.head;
  EXPECT_EQ(nlohmann::json::parse(reply.body)["params"],
            nlohmann::json::parse(R"(["a bé", "7"])"));
  EXPECT_THAT(reply.head, HasSubstr("Content-Type: application/json"));
  EXPECT_EQ(Exchange(front->port(), "GET", "/v2/").status, 200);
  // An encoded '/' does not split a segment into two.
  reply = Exchange(front->port(), "GET", "/v2/models/a%2Fb/versions/7");
  EXPECT_EQ(reply.status, 400);
  EXPECT_THAT(ErrorOf(reply), HasSubstr("percent-encoding"));
}

TEST(HttpFront, UnknownPathsAre404AndOtherMethods405WithJsonErrors) {
  auto front = Start({Echo("GET", "/v2")});
  ASSERT_NE(front, nullptr);
  Reply reply = Exchange(front->port(), "GET", "/v3/<script>");
  EXPECT_EQ(reply.status, 404);
  EXPECT_THAT(ErrorOf(reply), HasSubstr("no such path"));
  EXPECT_THAT(reply.body, ::testing::Not(HasSubstr("<script>")));
  reply = Exchange(front->port(), "POST", "/v2", {"Content-Length: 0"});
  EXPECT_EQ(reply.status, 405);
  EXPECT_THAT(ErrorOf(reply), HasSubstr("method not allowed"));
}

TEST(HttpFront, BodiesOverTheLimitAre413BeforeTheyAreRead) {
  auto front = Start({Echo("POST", "/in", false, true)}, [](HttpFrontOptions& o) { o.max_body_bytes = 1024; });
  ASSERT_NE(front, nullptr);
  // Headers only: the answer comes without the body ever being sent.
  const int fd = Connect(front->port());
  SendAll(fd,
          "POST /in HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          "Content-Length: 100000000\r\n\r\n");
  Reply reply = Parse(ReadToClose(fd));
  close(fd);
  EXPECT_EQ(reply.status, 413);
  EXPECT_THAT(ErrorOf(reply), HasSubstr("over the limit of 1024"));
  // At the limit: served.
  reply = Exchange(front->port(), "POST", "/in",
                   {"Content-Type: application/json", "Content-Length: 1024"},
                   std::string(1024, 'x'));
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(nlohmann::json::parse(reply.body)["body"].get<std::string>().size(), 1024u);
}

TEST(HttpFront, ChunkedBodiesAreReadUpToTheLimit) {
  auto front = Start({Echo("POST", "/in", false, true)}, [](HttpFrontOptions& o) { o.max_body_bytes = 1024; });
  ASSERT_NE(front, nullptr);
  auto chunked = [](int chunks) {
    std::string body;
    for (int i = 0; i < chunks; ++i) absl::StrAppend(&body, "100\r\n", std::string(256, 'y'), "\r\n");
    return absl::StrCat(body, "0\r\n\r\n");
  };
  Reply reply = Exchange(front->port(), "POST", "/in",
                         {"Content-Type: application/json", "Transfer-Encoding: chunked"},
                         chunked(3));
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(nlohmann::json::parse(reply.body)["body"].get<std::string>(), std::string(768, 'y'));
  reply = Exchange(front->port(), "POST", "/in",
                   {"Content-Type: application/json", "Transfer-Encoding: chunked"}, chunked(5));
  EXPECT_EQ(reply.status, 413);
}

TEST(HttpFront, BodiesNeedALengthAndJson) {
  auto front = Start({Echo("POST", "/in", false, true)});
  ASSERT_NE(front, nullptr);
  EXPECT_EQ(Exchange(front->port(), "POST", "/in", {"Content-Type: application/json"}).status,
            411);
  Reply reply = Exchange(front->port(), "POST", "/in",
                         {"Content-Type: text/plain", "Content-Length: 2"}, "{}");
  EXPECT_EQ(reply.status, 415);
  EXPECT_THAT(ErrorOf(reply), HasSubstr("application/json"));
}

TEST(HttpFront, TokensAreCheckedBeforeTheBodyIsRead) {
  absl::StatusOr<TokenSet> tokens = TokenSet::Parse("secret-token-1\n");
  ASSERT_TRUE(tokens.ok());
  std::atomic<int> calls{0};
  HttpRoute route = Echo("POST", "/in", /*needs_token=*/true, /*takes_body=*/true);
  route.handler = [&calls](const HttpRequest& request) {
    ++calls;
    return HttpResponse{.body = nlohmann::json{{"auth", *request.authorization}}.dump()};
  };
  auto front = Start({route, Echo("GET", "/open")}, [&](HttpFrontOptions& o) { o.tokens = *tokens; });
  ASSERT_NE(front, nullptr);
  const std::vector<std::string> json = {"Content-Type: application/json",
                                         "Content-Length: 2"};
  Reply reply = Exchange(front->port(), "POST", "/in", json, "{}");
  EXPECT_EQ(reply.status, 401);
  EXPECT_THAT(reply.head, HasSubstr("WWW-Authenticate: Bearer"));
  std::vector<std::string> wrong = json;
  wrong.push_back("Authorization: Bearer not-the-token");
  reply = Exchange(front->port(), "POST", "/in", wrong, "{}");
  EXPECT_EQ(reply.status, 401);
  EXPECT_THAT(reply.body, ::testing::Not(HasSubstr("not-the-token")));
  EXPECT_EQ(calls.load(), 0);
  std::vector<std::string> right = json;
  right.push_back("Authorization: Bearer secret-token-1");
  reply = Exchange(front->port(), "POST", "/in", right, "{}");
  EXPECT_EQ(reply.status, 200);
  EXPECT_EQ(nlohmann::json::parse(reply.body)["auth"], "Bearer secret-token-1");
  EXPECT_EQ(calls.load(), 1);
  // Routes without needs_token stay open.
  EXPECT_EQ(Exchange(front->port(), "GET", "/open").status, 200);
}

TEST(HttpFront, DrainRefusesNewRequestsAndWaitsForThoseInFlight) {
  absl::Notification entered, release;
  HttpRoute slow{.method = "GET", .pattern = "/slow", .handler = [&](const HttpRequest&) {
                   entered.Notify();
                   release.WaitForNotification();
                   return HttpResponse{.body = "{}"};
                 }};
  auto front = Start({slow, Echo("GET", "/fast")});
  ASSERT_NE(front, nullptr);
  Reply in_flight;
  std::thread caller([&] { in_flight = Exchange(front->port(), "GET", "/slow"); });
  entered.WaitForNotification();
  EXPECT_FALSE(front->Drain(absl::Now()));  // one still in flight
  Reply refused = Exchange(front->port(), "GET", "/fast");
  EXPECT_EQ(refused.status, 503);
  EXPECT_THAT(ErrorOf(refused), HasSubstr("shutting down"));
  release.Notify();
  EXPECT_TRUE(front->Drain(absl::Now() + absl::Minutes(1)));
  caller.join();
  EXPECT_EQ(in_flight.status, 200);
}

TEST(HttpFront, ASilentConnectionIsClosedByTheRequestTimeout) {
  auto front = Start({Echo("GET", "/v2")}, [](HttpFrontOptions& o) { o.request_timeout_ms = 300; });
  ASSERT_NE(front, nullptr);
  const int fd = Connect(front->port());
  // Half a request line, then nothing: the server must close the connection
  // (recv sees EOF or a reset), not wait for the rest for ever. The socket's
  // 60 s receive timeout only bounds a failing test.
  SendAll(fd, "GET /v2 HTTP/1.1\r\nHost: x\r\n");
  // The front may answer an error status (JSON) before it closes; then the end.
  std::string answer;
  ssize_t n;
  char buffer[1024];
  errno = 0;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) answer.append(buffer, static_cast<size_t>(n));
  const int error = errno;
  close(fd);
  EXPECT_TRUE(n == 0 || (n < 0 && error == ECONNRESET))
      << "recv returned " << n << ", errno " << error << " (EAGAIN: not closed within 60 s)";
  if (!answer.empty()) {
    const Reply reply = Parse(answer);
    EXPECT_GE(reply.status, 400) << answer;
    EXPECT_THAT(ErrorOf(reply), HasSubstr("refused")) << answer;
  }
  // And the front still serves.
  EXPECT_EQ(Exchange(front->port(), "GET", "/v2").status, 200);
}

TEST(HttpFront, ABodyDribbledPastItsDeadlineIsCutOff) {
  std::atomic<int> calls{0};
  HttpRoute route = Echo("POST", "/in", false, true);
  route.handler = [&calls](const HttpRequest&) {
    ++calls;
    return HttpResponse{.body = "{}"};
  };
  // Deadline: 300 ms plus a second per MiB (here none); each byte comes well
  // within the per-read timeout, so only the body's deadline can end it.
  auto front = Start({route}, [](HttpFrontOptions& o) { o.request_timeout_ms = 300; });
  ASSERT_NE(front, nullptr);
  const int fd = Connect(front->port());
  SendAll(fd,
          "POST /in HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          "Content-Length: 100000\r\n\r\n");
  // One byte per 50 ms (the receive timeout paces it) until the server ends
  // the connection; 100000 bytes would take more than an hour.
  timeval pace{.tv_sec = 0, .tv_usec = 50 * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &pace, sizeof(pace));
  int sent = 0;
  bool ended = false;
  for (; sent < 100000 && !ended; ++sent) {
    if (send(fd, "x", 1, MSG_NOSIGNAL) != 1) {
      ended = true;
      break;
    }
    char byte;
    const ssize_t n = recv(fd, &byte, 1, 0);
    ended = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }
  close(fd);
  EXPECT_TRUE(ended);
  EXPECT_LT(sent, 100000);
  EXPECT_EQ(calls.load(), 0);
  EXPECT_EQ(Exchange(front->port(), "GET", "/nothing").status, 404);  // serving on
}

TEST(HttpFront, HeadersOverTheLimitAreRefusedWithAJsonError) {
  auto front = Start({Echo("GET", "/v2")});
  ASSERT_NE(front, nullptr);
  const std::string big(HttpFrontOptions::kMaxHeaderBytes + 1024, 'h');
  Reply reply = Exchange(front->port(), "GET", "/v2", {"X-Big: " + big});
  EXPECT_GE(reply.status, 400);
  EXPECT_LT(reply.status, 500);
  EXPECT_THAT(ErrorOf(reply), HasSubstr("refused"));
  EXPECT_EQ(Exchange(front->port(), "GET", "/v2").status, 200);
}

TEST(HttpFront, RefusesBadOptionsAndAnAddressInUse) {
  HttpFrontOptions empty;
  EXPECT_EQ(HttpFront::Create(empty, {}).status().code(), absl::StatusCode::kInvalidArgument);
  auto front = Start({Echo("GET", "/v2")});
  ASSERT_NE(front, nullptr);
  HttpFrontOptions taken;
  taken.address = absl::StrCat("127.0.0.1:", front->port());
  absl::StatusOr<std::unique_ptr<HttpFront>> second = HttpFront::Create(taken, {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve::server

namespace attnserve::server {
namespace {

TEST(HostAllowed, TakesTheLoopbackNamesAndTheAllowedOnesWithOrWithoutAPort) {
  const std::vector<std::string> allowed = {"attn.example", "[fd00::1]"};
  for (const char* host : {"localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.1:1", "[::1]",
                           "[::1]:8000", "attn.example", "Attn.Example:443", "[fd00::1]:80"}) {
    EXPECT_TRUE(HostAllowed(host, allowed)) << host;
  }
  for (const char* host : {"", ":80", "evil.example", "localhost.evil.example", "127.0.0.1.nip.io",
                           "attn.example.evil", "localhost:", "localhost:80x", "localhost:123456",
                           "localhost:80@evil.example", "[::1", "[::1]x", "[::1]:", "[::2]:80",
                           "::1", "evil.example#@localhost"}) {
    EXPECT_FALSE(HostAllowed(host, allowed)) << host;
  }
}

TEST(OriginMatchesHost, IsHttpOrHttpsOfTheHostExactly) {
  EXPECT_TRUE(OriginMatchesHost("http://127.0.0.1:8000", "127.0.0.1:8000"));
  EXPECT_TRUE(OriginMatchesHost("https://Attn.Example", "attn.example"));
  for (const char* origin : {"null", "http://evil.example", "http://127.0.0.1:8001", "http://127.0.0.1",
                             "ftp://127.0.0.1:8000", "http://127.0.0.1:8000/", "127.0.0.1:8000",
                             "http://127.0.0.1:8000.evil.example"}) {
    EXPECT_FALSE(OriginMatchesHost(origin, "127.0.0.1:8000")) << origin;
  }
}

// One raw request (its own connection, closed by the server).
Reply RawExchange(int port, const std::string& request) {
  const int fd = Connect(port);
  SendAll(fd, request);
  Reply reply = Parse(ReadToClose(fd));
  close(fd);
  return reply;
}

TEST(HttpFront, BrowserFacingRoutesCheckHostAndOriginAndCarryTheSecurityHeaders) {
  HttpRoute page{.method = "GET",
                 .pattern = "/page/{}",
                 .browser_facing = true,
                 .handler = [](const HttpRequest& request) {
                   return HttpResponse{.content_type = "text/html; charset=utf-8",
                                       .body = request.path,
                                       .headers = {{"Location", "/page/"}}};
                 }};
  std::unique_ptr<HttpFront> front = Start({Echo("GET", "/v2/{}"), page}, [](HttpFrontOptions& o) {
    o.allowed_hosts = {"attn.example"};
  });
  const int port = front->port();
  auto get = [port](const std::string& path, const std::string& host, const std::string& more = "") {
    return RawExchange(port, absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", host, "\r\n", more,
                                          "Connection: close\r\n\r\n"));
  };
  constexpr absl::string_view kCsp =
      "Content-Security-Policy: default-src 'self'; frame-ancestors 'none'\r\n";

  Reply ok = get("/page/a", "127.0.0.1");
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(ok.body, "/page/a");
  EXPECT_THAT(ok.head + "\r\n", HasSubstr(std::string(kCsp)));
  EXPECT_THAT(ok.head, HasSubstr("Referrer-Policy: no-referrer\r\n"));
  EXPECT_THAT(ok.head, HasSubstr("X-Content-Type-Options: nosniff\r\n"));
  EXPECT_THAT(ok.head + "\r\n", HasSubstr("Location: /page/\r\n"));
  EXPECT_EQ(get("/page/a", absl::StrCat("ATTN.example:", port)).status, 200);
  EXPECT_EQ(get("/page/a", "127.0.0.1", "Origin: http://127.0.0.1\r\n").status, 200);

  Reply foreign = get("/page/a", "evil.example");
  EXPECT_EQ(foreign.status, 403);
  EXPECT_EQ(ErrorOf(foreign), "Host 'evil.example' is not allowed here (--http_allowed_hosts)");
  EXPECT_THAT(foreign.head + "\r\n", HasSubstr(std::string(kCsp)));
  Reply cross = get("/page/a", "127.0.0.1", "Origin: http://evil.example\r\n");
  EXPECT_EQ(cross.status, 403);
  EXPECT_THAT(ErrorOf(cross), HasSubstr("Origin 'http://evil.example'"));
  // No Host at all (HTTP/1.0).
  EXPECT_EQ(RawExchange(port, "GET /page/a HTTP/1.0\r\n\r\n").status, 403);
  // An unknown path under a browser-facing route's first segment: checked, headers too.
  EXPECT_EQ(get("/page/a/b", "evil.example").status, 403);
  Reply unknown = get("/page/a/b", "127.0.0.1");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_THAT(unknown.head + "\r\n", HasSubstr(std::string(kCsp)));
  // Other routes take any Host and carry no page headers.
  Reply api = get("/v2/x", "evil.example", "Origin: http://evil.example\r\n");
  EXPECT_EQ(api.status, 200);
  EXPECT_THAT(api.head, ::testing::Not(HasSubstr("Content-Security-Policy")));
}

}  // namespace
}  // namespace attnserve::server
