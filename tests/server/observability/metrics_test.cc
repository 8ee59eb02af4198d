// Metrics, the process collector and the access log; and the real server's
// /metrics on an ephemeral port, scraped over HTTP and parsed.
#include "server/observability/metrics.h"

#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_inputs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "server/observability/access_log.h"
#include "server/observability/process_metrics.h"

namespace attnserve::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// --- The text exposition, parsed -------------------------------------------

using Labels = std::map<std::string, std::string>;

struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

// Parses `name{label="value",...} number` lines; comments are skipped.
std::vector<Sample> ParseExposition(absl::string_view text) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line.front() == '#') continue;
    Sample sample;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    sample.name = std::string(line.substr(0, i));
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (line[i] != '}') {
        const size_t eq = line.find('=', i);
        std::string name(line.substr(i, eq - i)), value;
        i = eq + 2;  // past ="
        for (; line[i] != '"'; ++i) {
          if (line[i] == '\\') {
            ++i;
            value.push_back(line[i] == 'n' ? '\n' : line[i]);
          } else {
            value.push_back(line[i]);
          }
        }
        ++i;  // past the closing quote
        if (line[i] == ',') ++i;
        sample.labels[name] = value;
      }
      ++i;
    }
    const absl::string_view number = absl::StripAsciiWhitespace(line.substr(i));
    if (number == "Nan" || number == "NaN") {
      sample.value = std::nan("");
    } else {
      EXPECT_TRUE(absl::SimpleAtod(number, &sample.value)) << line;
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

class Exposition {
 public:
  explicit Exposition(std::string text)
      : text_(std::move(text)), samples_(ParseExposition(text_)) {}

  // The value of the one sample named `name` with exactly `labels`.
  std::optional<double> Value(absl::string_view name, const Labels& labels = {}) const {
    for (const Sample& s : samples_) {
      if (s.name == name && s.labels == labels) return s.value;
    }
    return std::nullopt;
  }
  // A histogram series' count (which must equal its +Inf bucket) and sum.
  std::optional<double> Count(absl::string_view histogram, const Labels& labels) const {
    Labels inf = labels;
    inf["le"] = "+Inf";
    std::optional<double> count = Value(absl::StrCat(histogram, "_count"), labels);
    EXPECT_EQ(count, Value(absl::StrCat(histogram, "_bucket"), inf)) << histogram;
    return count;
  }
  std::optional<double> Sum(absl::string_view histogram, const Labels& labels) const {
    return Value(absl::StrCat(histogram, "_sum"), labels);
  }
  // The `le` bounds of a histogram series, in order.
  std::vector<double> Bounds(absl::string_view histogram, const Labels& labels) const {
    std::vector<double> bounds;
    for (const Sample& s : samples_) {
      Labels without_le = s.labels;
      if (s.name != absl::StrCat(histogram, "_bucket") || without_le.erase("le") != 1 ||
          without_le != labels) {
        continue;
      }
      double bound = INFINITY;
      if (s.labels.at("le") != "+Inf") {
        EXPECT_TRUE(absl::SimpleAtod(s.labels.at("le"), &bound));
      }
      bounds.push_back(bound);
    }
    return bounds;
  }
  const std::string& text() const { return text_; }
  const std::vector<Sample>& samples() const { return samples_; }

 private:
  std::string text_;
  std::vector<Sample> samples_;
};

// GET http://127.0.0.1:port/path with HTTP/1.0: the status line and body.
struct HttpResponse {
  std::string status_line;
  std::string body;
};
// An answer not complete within `timeout` is cut short there.
HttpResponse HttpGet(int port, absl::string_view path,
                     absl::Duration timeout = absl::Seconds(60)) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  const timeval limit = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  EXPECT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string reply;
  char buffer[65536];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) reply.append(buffer, n);
  close(fd);
  HttpResponse response;
  const size_t header_end = reply.find("\r\n\r\n");
  response.status_line = reply.substr(0, reply.find("\r\n"));
  if (header_end != std::string::npos) response.body = reply.substr(header_end + 4);
  return response;
}

// --- Metrics on its own ------------------------------------------------------

constexpr absl::string_view kDuration = "attnserve_request_duration_seconds";

// The kernel paths a response can name on this CPU (core::ForwardInfo), as
// this test expects them: FP32, and BF16 where it runs natively, each on the
// blocked and the materialized path.
std::vector<std::string> KernelPathsOfThisCpu() {
  std::vector<std::string> paths = {"fp32/blocked", "fp32/materialized", "fp32/paged"};
  if (core::Bf16Supported()) {
    paths.push_back("bf16/blocked");
    paths.push_back("bf16/materialized");
    paths.push_back("bf16/paged");
  }
  return paths;
}

core::HeadConfig SmallConfig() {
  core::HeadConfig config;
  config.d_model = 64;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  config.head_dim = 8;
  return config;
}

TEST(Metrics, ServesTheRegistryAndProcessMetricsOverHttpOnAnEphemeralPort) {
  auto metrics = Metrics::Create({.address = "127.0.0.1:0", .queue_capacity = 16});
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  ASSERT_GT((*metrics)->port(), 0);
  const HttpResponse response = HttpGet((*metrics)->port(), "/metrics");
  EXPECT_THAT(response.status_line, HasSubstr("200"));
  const Exposition exposition(response.body);
  EXPECT_EQ(exposition.Value("attnserve_queue_capacity"), 16);
  EXPECT_EQ(exposition.Value("attnserve_queue_depth"), 0);
  EXPECT_EQ(exposition.Value("attnserve_requests_in_flight"), 0);
  EXPECT_TRUE(exposition.Value("process_resident_memory_bytes").has_value());
  EXPECT_EQ(exposition.Value("attnserve_requests_total", {{"method", "Attend"}, {"code", "OK"}}),
            0);
}

TEST(Metrics, StopsWithoutWaitingForTheListenersPollRound) {
  // civetweb's listener polls in 2 s rounds; Metrics wakes it on the way out
  // (about 0.1 s). The GET just before starts a fresh round, so without the
  // wake every stop would take about the whole 2 s. What is a property of
  // time can only be observed in time: a stop under 1.5 s proves the wake,
  // and a busy machine gets five tries to show one.
  absl::Duration fastest = absl::InfiniteDuration();
  for (int attempt = 0; attempt < 5 && fastest >= absl::Milliseconds(1500); ++attempt) {
    auto metrics = Metrics::Create({.address = "127.0.0.1:0"});
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_THAT(HttpGet((*metrics)->port(), "/metrics").status_line, HasSubstr("200"));
    const absl::Time start = absl::Now();
    metrics->reset();
    fastest = std::min(fastest, absl::Now() - start);
  }
  EXPECT_LT(fastest, absl::Milliseconds(1500));
}

// A TCP connection to 127.0.0.1:port (-1 when it fails).
int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// True once the peer has closed fd (read returns 0 or an error); waits up to
// `wait_ms` for it.
bool ClosedByPeer(int fd, int wait_ms) {
  pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
  if (poll(&p, 1, wait_ms) <= 0) return false;
  char byte;
  return read(fd, &byte, 1) <= 0;
}

TEST(Metrics, AnswersWhileConnectionsDribbleTheirHeadersAndCutsThemAtTheRequestTimeout) {
  // Three of the endpoint's four threads held by requests whose headers
  // come a line at a time and never end (a slowloris): the fourth serves a
  // scrape, and each dribbling connection is closed once its headers have
  // taken longer than the request timeout in all, although a line keeps
  // arriving every 250 ms (a per-read timeout alone would never close it).
  auto metrics = Metrics::Create({.address = "127.0.0.1:0", .threads = 4});
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const int port = (*metrics)->port();
  std::vector<int> slow;
  for (int i = 0; i < 3; ++i) {
    const int fd = ConnectTo(port);
    ASSERT_GE(fd, 0);
    const std::string start = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    ASSERT_EQ(write(fd, start.data(), start.size()), static_cast<ssize_t>(start.size()));
    slow.push_back(fd);
  }
  // Answered at once by the free thread (10 s for a busy machine; with no
  // thread free it would wait for a dribbling connection's end).
  EXPECT_THAT(HttpGet(port, "/metrics", absl::Seconds(10)).status_line, HasSubstr("200"));

  const absl::Time start = absl::Now();
  // 3 x the timeout, for a busy machine (civetweb's default is 30 s).
  const absl::Time give_up = start + absl::Milliseconds(3 * MetricsOptions::kRequestTimeoutMs);
  std::vector<bool> closed(slow.size(), false);
  for (int line = 0; absl::Now() < give_up &&
                     std::count(closed.begin(), closed.end(), false) > 0;
       ++line) {
    for (size_t i = 0; i < slow.size(); ++i) {
      if (closed[i]) continue;
      const std::string header = absl::StrCat("X-Slow-", line, ": ", line, "\r\n");
      closed[i] = send(slow[i], header.data(), header.size(), MSG_NOSIGNAL) <= 0 ||
                  ClosedByPeer(slow[i], 250 / static_cast<int>(slow.size()));
    }
  }
  const absl::Duration took = absl::Now() - start;
  for (size_t i = 0; i < slow.size(); ++i) {
    EXPECT_TRUE(closed[i]) << "dribbling connection " << i << " still open after " << took;
    close(slow[i]);
  }
}

TEST(Metrics, BuildInfoNamesTheVersionOneDnnAndTheIsa) {
  auto metrics = Metrics::Create({});
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const Exposition exposition((*metrics)->TextExposition());
  int found = 0;
  for (const Sample& s : exposition.samples()) {
    if (s.name != "attnserve_build_info") continue;
    ++found;
    EXPECT_EQ(s.value, 1);
    EXPECT_EQ(s.labels.at("version"), ATTNSERVE_TEST_VERSION);
    EXPECT_THAT(s.labels.at("onednn_version"), ::testing::MatchesRegex("2\\.[0-9]+\\.[0-9]+"));
    EXPECT_THAT(s.labels.at("cpu_isa"),
                ::testing::AnyOf("sse41", "avx", "avx2", "avx2_vnni", "avx512_core",
                                 "avx512_core_vnni", "avx512_core_bf16", "avx512_core_amx"));
  }
  EXPECT_EQ(found, 1);
}

TEST(Metrics, WithoutAnAddressOpensNoPortButStillCounts) {
  auto metrics = Metrics::Create({.address = ""});
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ((*metrics)->port(), 0);
  (*metrics)->OnRequestStarted();
  (*metrics)->OnRequestDone(RpcMethod::kListModels, "", absl::StatusCode::kOk,
                            absl::Milliseconds(3));
  const Exposition exposition((*metrics)->TextExposition());
  EXPECT_EQ(
      exposition.Value("attnserve_requests_total", {{"method", "ListModels"}, {"code", "OK"}}), 1);
  const Labels labels = {{"method", "ListModels"}, {"model", ""}, {"code", "OK"}};
  EXPECT_EQ(exposition.Count(kDuration, labels), 1);
  EXPECT_DOUBLE_EQ(*exposition.Sum(kDuration, labels), 0.003);
}

TEST(Metrics, AnAddressInUseIsUnavailable) {
  auto first = Metrics::Create({.address = "127.0.0.1:0"});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Metrics::Create({.address = absl::StrCat("127.0.0.1:", (*first)->port())});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("--metrics_address"));
}

TEST(Metrics, DurationBucketsResolveFiftyMicrosecondsToThirtySecondsInStepsOfTwo) {
  auto metrics = Metrics::Create({});
  ASSERT_TRUE(metrics.ok());
  const Exposition exposition((*metrics)->TextExposition());
  const std::vector<double> bounds =
      exposition.Bounds(kDuration, {{"method", "ListModels"}, {"model", ""}, {"code", "OK"}});
  ASSERT_GE(bounds.size(), 3u);
  EXPECT_DOUBLE_EQ(bounds.front(), 50e-6);
  EXPECT_TRUE(std::isinf(bounds.back()));
  EXPECT_GE(bounds[bounds.size() - 2], 30);
  for (size_t i = 1; i + 1 < bounds.size(); ++i) EXPECT_DOUBLE_EQ(bounds[i], 2 * bounds[i - 1]);
}

TEST(Metrics, AddedModelsHaveEverySeriesAtZeroAndAnInfoSeries) {
  auto metrics = Metrics::Create({});
  ASSERT_TRUE(metrics.ok());
  (*metrics)->AddModel("small", SmallConfig());
  const Exposition exposition((*metrics)->TextExposition());
  EXPECT_EQ(exposition.Value("attnserve_model_info", {{"model", "small"},
                                                      {"d_model", "64"},
                                                      {"num_heads", "8"},
                                                      {"num_kv_heads", "2"},
                                                      {"head_dim", "8"}}),
            1);
  EXPECT_EQ(exposition.Count(kDuration, {{"method", "Attend"}, {"model", "small"}, {"code", "OK"}}),
            0);
  EXPECT_EQ(exposition.Count("attnserve_queue_wait_seconds", {{"model", "small"}}), 0);
  for (const std::string& path : KernelPathsOfThisCpu()) {
    EXPECT_EQ(exposition.Count("attnserve_compute_seconds",
                               {{"model", "small"}, {"kernel_path", path}}),
              0)
        << path;
  }
  EXPECT_EQ(exposition.Count("attnserve_batch_size", {{"model", "small"}}), 0);
  EXPECT_EQ(exposition.Count("attnserve_batch_tokens", {{"model", "small"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_tokens_total", {{"model", "small"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_attention_map_bytes_total", {{"model", "small"}}), 0);
  EXPECT_EQ(exposition.Count("attnserve_decode_batch_tokens", {{"model", "small"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_kv_cache_read_bytes_total", {{"model", "small"}}), 0);
}

TEST(Metrics, OnlyAddedModelsBecomeLabels) {
  auto metrics = Metrics::Create({});
  ASSERT_TRUE(metrics.ok());
  (*metrics)->AddModel("small", SmallConfig());
  EXPECT_EQ((*metrics)->ModelLabel("small"), "small");
  EXPECT_EQ((*metrics)->ModelLabel("smal"), "");
  EXPECT_EQ((*metrics)->ModelLabel(""), "");
  EXPECT_EQ((*metrics)->ModelLabel(std::string(5000, 'x')), "");
}

// A folder's layers share the folder's label: one set of series (and one
// info series) for all of them, which stays until its last layer goes.
TEST(Metrics, TheLayersOfAFolderShareTheFoldersLabel) {
  auto metrics = Metrics::Create({});
  ASSERT_TRUE(metrics.ok());
  Metrics& m = **metrics;
  for (int i = 0; i < 3; ++i) m.AddModel(absl::StrCat("net.", i), SmallConfig(), "net");
  EXPECT_EQ(m.ModelLabel("net.2"), "net");
  EXPECT_EQ(m.ModelLabel("net"), "net");
  EXPECT_EQ(m.ModelLabel("net.3"), "");
  const std::string text = m.TextExposition();
  EXPECT_FALSE(absl::StrContains(text, "model=\"net.")) << text;
  const Labels info = {{"model", "net"},     {"d_model", "64"}, {"num_heads", "8"},
                       {"num_kv_heads", "2"}, {"head_dim", "8"}};
  Exposition exposition(text);
  EXPECT_EQ(exposition.Value("attnserve_model_info", info), 1);
  EXPECT_EQ(exposition.Count("attnserve_decode_batch_tokens", {{"model", "net"}}), 0);
  m.RemoveModel("net.0");
  m.RemoveModel("net.1");
  EXPECT_EQ(m.ModelLabel("net"), "net");
  EXPECT_EQ(Exposition(m.TextExposition()).Value("attnserve_model_info", info), 1);
  m.RemoveModel("net.2");
  EXPECT_EQ(m.ModelLabel("net"), "");
  EXPECT_EQ(m.ModelLabel("net.2"), "");
  EXPECT_FALSE(Exposition(m.TextExposition()).Value("attnserve_model_info", info).has_value());
}

TEST(Metrics, QueueDepthFollowsQueuedAndDequeuedRequests) {
  auto metrics = Metrics::Create({});
  ASSERT_TRUE(metrics.ok());
  Metrics& m = **metrics;
  m.OnQueued();
  m.OnQueued();
  m.OnQueued();
  m.OnQueueRefused();
  EXPECT_EQ(Exposition(m.TextExposition()).Value("attnserve_queue_depth"), 2);
  m.OnDequeued("", absl::Milliseconds(1));
  m.OnDequeued("", absl::Milliseconds(2));
  const Exposition exposition(m.TextExposition());
  EXPECT_EQ(exposition.Value("attnserve_queue_depth"), 0);
  EXPECT_EQ(exposition.Count("attnserve_queue_wait_seconds", {{"model", ""}}), 2);
  EXPECT_DOUBLE_EQ(*exposition.Sum("attnserve_queue_wait_seconds", {{"model", ""}}), 0.003);
}

// --- The process collector ---------------------------------------------------

std::map<std::string, double> Collect(const ProcessCollector& collector) {
  std::map<std::string, double> values;
  for (const prometheus::MetricFamily& family : collector.Collect()) {
    EXPECT_EQ(family.metric.size(), 1u) << family.name;
    values[family.name] = family.type == prometheus::MetricType::Counter
                              ? family.metric[0].counter.value
                              : family.metric[0].gauge.value;
  }
  return values;
}

void WriteFile(const std::filesystem::path& path, absl::string_view text) {
  std::ofstream(path) << text;
}

TEST(ProcessCollector, ReadsAFakeProcTreeWhoseCommandNameHasSpacesAndParentheses) {
  const std::filesystem::path root =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("proc", getpid());
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root / "self" / "fd");
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  // Fields 14 utime = 250 ticks, 15 stime = 50, 22 starttime = 1000.
  WriteFile(root / "self" / "stat",
            "42 (a (b) c) S 1 42 42 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 7 0 1000 "
            "3133440 407 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n");
  WriteFile(root / "stat", "cpu  1 2 3\nbtime 1700000000\nprocesses 5\n");
  WriteFile(root / "self" / "status",
            "Name:\ta (b) c\nVmSize:\t    3892 kB\nVmRSS:\t    2012 kB\nThreads:\t7\n");
  WriteFile(root / "self" / "limits",
            "Limit                     Soft Limit           Hard Limit           Units\n"
            "Max open files            1024                 4096                 files\n");
  for (const char* fd : {"0", "1", "2"}) WriteFile(root / "self" / "fd" / fd, "");

  const std::map<std::string, double> values = Collect(ProcessCollector(root.string()));
  EXPECT_DOUBLE_EQ(values.at("process_cpu_seconds_total"), 300 / ticks);
  EXPECT_DOUBLE_EQ(values.at("process_start_time_seconds"), 1700000000 + 1000 / ticks);
  EXPECT_EQ(values.at("process_resident_memory_bytes"), 2012 * 1024);
  EXPECT_EQ(values.at("process_virtual_memory_bytes"), 3892 * 1024);
  EXPECT_EQ(values.at("process_threads"), 7);
  EXPECT_EQ(values.at("process_open_fds"), 3);
  EXPECT_EQ(values.at("process_max_fds"), 1024);
  std::filesystem::remove_all(root);
}

TEST(ProcessCollector, LeavesOutWhatItCannotRead) {
  EXPECT_TRUE(Collect(ProcessCollector("/nonexistent-proc")).empty());
}

TEST(ProcessCollector, ThisProcessLooksLikeThisProcess) {
  const std::map<std::string, double> values = Collect(ProcessCollector());
  EXPECT_EQ(values.size(), 7u);
  EXPECT_GT(values.at("process_resident_memory_bytes"), 1 << 20);
  EXPECT_GE(values.at("process_virtual_memory_bytes"), values.at("process_resident_memory_bytes"));
  EXPECT_GE(values.at("process_threads"), 1);
  EXPECT_GE(values.at("process_open_fds"), 3);  // stdin, stdout, stderr
  EXPECT_GE(values.at("process_max_fds"), values.at("process_open_fds"));
  EXPECT_GE(values.at("process_cpu_seconds_total"), 0);
  const double now = absl::ToUnixSeconds(absl::Now());
  EXPECT_LE(values.at("process_start_time_seconds"), now + 1);
  EXPECT_GT(values.at("process_start_time_seconds"), now - 3600);
}

// --- The access log ----------------------------------------------------------

TEST(AccessLog, ALineIsOneJsonObjectWithTheCallsFacts) {
  const std::string line = FormatAccessLogLine({
      .time = absl::FromUnixSeconds(1700000000),
      .request_id = "req-1",
      .method = RpcMethod::kAttend,
      .model = "default",
      .peer = "ipv4:127.0.0.1:5000",
      .shapes = R"({"hidden_states":[2,16,768]})",
      .code = absl::StatusCode::kOk,
      .duration = absl::Milliseconds(12),
      .queue = absl::Microseconds(100),
      .compute = absl::Milliseconds(11),
  });
  EXPECT_EQ(line,
            R"({"time":"2023-11-14T22:13:20.000000Z","log":"access","request_id":"req-1",)"
            R"("method":"Attend","model":"default","peer":"ipv4:127.0.0.1:5000",)"
            R"("shapes":{"hidden_states":[2,16,768]},"code":"OK","duration_seconds":0.012000,)"
            R"("queue_seconds":0.000100,"compute_seconds":0.011000})");
}

TEST(AccessLog, ClientStringsAreEscapedAndCut) {
  const std::string line = FormatAccessLogLine({
      .request_id = "r",
      .method = RpcMethod::kGetModel,
      .model = "a\"b\\c\nd\x01" + std::string(500, 'm'),
      .code = absl::StatusCode::kNotFound,
      .message = "name: no model named 'x'",
  });
  EXPECT_THAT(line, HasSubstr(R"("model":"a\"b\\c\nd\u0001mmm)"));
  EXPECT_THAT(line, HasSubstr(R"(mmm...")"));
  EXPECT_THAT(line, Not(HasSubstr(std::string(200, 'm'))));
  EXPECT_THAT(line, HasSubstr(R"("code":"NOT_FOUND","message":"name: no model named 'x'")"));
  EXPECT_THAT(line, Not(HasSubstr("queue_seconds")));
  EXPECT_THAT(line, Not(HasSubstr("\n")));
}

TEST(AccessLog, KeepsAUsableClientRequestIdAndReplacesOthers) {
  EXPECT_EQ(RequestIdOrNew("3f2a-req_1.x:y"), "3f2a-req_1.x:y");
  const std::string made = RequestIdOrNew(std::nullopt);
  EXPECT_THAT(made, ::testing::MatchesRegex("[0-9a-f]{32}"));
  EXPECT_NE(RequestIdOrNew(std::nullopt), made);
  for (const std::string& bad : {std::string(""), std::string("a b"), std::string("a\"b"),
                                 std::string("x\ny"), std::string(129, 'a')}) {
    EXPECT_THAT(RequestIdOrNew(bad), ::testing::MatchesRegex("[0-9a-f]{32}")) << bad;
  }
}

TEST(AccessLog, AttendShapesListsThePresentTensorsUpToEightDimensions) {
  v1::AttendRequest request;
  for (int64_t d : {2, 16, 768}) request.mutable_hidden_states()->add_shape(d);
  for (int64_t d : {2, 9, 768}) request.mutable_context()->add_shape(d);
  EXPECT_EQ(AttendShapes(request), R"({"hidden_states":[2,16,768],"context":[2,9,768]})");
  request.Clear();
  for (int i = 0; i < 5000; ++i) request.mutable_hidden_states()->add_shape(1);
  EXPECT_EQ(AttendShapes(request), R"({"hidden_states":[1,1,1,1,1,1,1,1]})");
  EXPECT_EQ(AttendShapes(v1::AttendRequest()), "{}");
}

// --- The real server ---------------------------------------------------------

std::vector<float> Values(int64_t n) {
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
  return values;
}

v1::AttendRequest Request(int64_t batch, int64_t seq, int64_t d_model = 768) {
  v1::AttendRequest request;
  request.set_model("default");
  v1::Tensor* t = request.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {batch, seq, d_model}) t->add_shape(d);
  const std::vector<float> values = Values(batch * seq * d_model);
  t->set_raw_data(values.data(), values.size() * sizeof(float));
  return request;
}

class MetricsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "127.0.0.1:0";
    options.access_log = true;
    options.limits.max_batch = 4;
    options.limits.max_seq_len = 64;
    options.drain_timeout_seconds = 5;
    options.lame_duck_seconds = 0;
    auto server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_GT(server_->metrics_port(), 0);
    ASSERT_TRUE(server_->LoadModelsAndServe().ok());
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
  }

  Exposition Scrape() {
    const HttpResponse response = HttpGet(server_->metrics_port(), "/metrics");
    EXPECT_THAT(response.status_line, HasSubstr("200"));
    return Exposition(response.body);
  }

  grpc::StatusCode Attend(const v1::AttendRequest& request, v1::AttendResponse* response = nullptr,
                          const std::map<std::string, std::string>& metadata = {},
                          std::string* request_id_back = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    for (const auto& [key, value] : metadata) context.AddMetadata(key, value);
    v1::AttendResponse ignored;
    const grpc::Status status = stub_->Attend(&context, request, response ? response : &ignored);
    if (request_id_back != nullptr) {
      // Headers of a success, trailers of an error.
      for (const auto* back : {&context.GetServerInitialMetadata(), &context.GetServerTrailingMetadata()}) {
        const auto it = back->find("x-request-id");
        if (it != back->end()) *request_id_back = std::string(it->second.data(), it->second.size());
      }
    }
    return status.error_code();
  }

  grpc::StatusCode GetModel(const std::string& name) {
    grpc::ClientContext context;
    v1::GetModelRequest request;
    request.set_name(name);
    v1::ModelInfo info;
    return stub_->GetModel(&context, request, &info).error_code();
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(MetricsServerTest, SeriesOfTheBuiltinModelExistBeforeAnyRequest) {
  const Exposition exposition = Scrape();
  const Labels attend_ok = {{"method", "Attend"}, {"model", "default"}, {"code", "OK"}};
  EXPECT_EQ(exposition.Count(kDuration, attend_ok), 0);
  EXPECT_EQ(
      exposition.Count(kDuration, {{"method", "GetModel"}, {"model", "default"}, {"code", "OK"}}),
      0);
  EXPECT_EQ(exposition.Count("attnserve_queue_wait_seconds", {{"model", "default"}}), 0);
  // Every kernel path this CPU runs, the default blocked path first among them.
  for (const std::string& path : KernelPathsOfThisCpu()) {
    for (const char* model : {"default", ""}) {
      EXPECT_EQ(exposition.Count("attnserve_compute_seconds",
                                 {{"model", model}, {"kernel_path", path}}),
                0)
          << model << " " << path;
    }
  }
  // And no other: a series no request can move would be noise.
  int compute_series = 0;
  for (const Sample& s : exposition.samples()) {
    if (s.name == "attnserve_compute_seconds_count") ++compute_series;
  }
  EXPECT_EQ(compute_series, 2 * static_cast<int>(KernelPathsOfThisCpu().size()));
  EXPECT_EQ(exposition.Count("attnserve_batch_size", {{"model", "default"}}), 0);
  EXPECT_EQ(exposition.Count("attnserve_batch_tokens", {{"model", "default"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_tokens_total", {{"model", "default"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_attention_map_bytes_total", {{"model", "default"}}), 0);
  for (const char* code : {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED",
                           "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL"}) {
    EXPECT_EQ(exposition.Value("attnserve_requests_total", {{"method", "Attend"}, {"code", code}}),
              0)
        << code;
    // Error series of the duration histogram too, so error-rate queries work
    // before the first error.
    EXPECT_EQ(exposition.Count(kDuration, {{"method", "Attend"}, {"model", "default"}, {"code", code}}),
              0)
        << code;
  }
  // The Open Inference Protocol's metadata calls, as GetModel's (ServerMetadata
  // names no model).
  for (const auto& [method, model] : {std::pair<const char*, const char*>{"ModelReady", "default"},
                                      {"ModelMetadata", "default"},
                                      {"ServerMetadata", ""}}) {
    for (const char* code : {"OK", "UNAUTHENTICATED"}) {
      EXPECT_EQ(exposition.Value("attnserve_requests_total", {{"method", method}, {"code", code}}),
                0)
          << method << " " << code;
    }
    EXPECT_EQ(exposition.Count(kDuration, {{"method", method}, {"model", model}, {"code", "OK"}}), 0)
        << method;
  }
  EXPECT_EQ(exposition.Value("attnserve_model_info", {{"model", "default"},
                                                      {"d_model", "768"},
                                                      {"num_heads", "12"},
                                                      {"num_kv_heads", "12"},
                                                      {"head_dim", "64"}}),
            1);
  EXPECT_EQ(exposition.Value("attnserve_queue_capacity"), ServerOptions().max_queued_requests);
  // The decode steps' series: each form's step latency, the micro-batches'
  // tokens and the KV bytes they read, the shared blocks.
  for (const char* method : {"Extend", "ExtendStream"}) {
    EXPECT_EQ(exposition.Count("attnserve_decode_step_seconds", {{"method", method}}), 0)
        << method;
    for (const char* code : {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                             "DEADLINE_EXCEEDED", "CANCELLED"}) {
      EXPECT_EQ(exposition.Value("attnserve_requests_total", {{"method", method}, {"code", code}}),
                0)
          << method << " " << code;
    }
  }
  EXPECT_EQ(exposition.Count("attnserve_decode_batch_tokens", {{"model", "default"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_kv_cache_read_bytes_total", {{"model", "default"}}), 0);
  EXPECT_EQ(exposition.Value("attnserve_kv_cache_shared_blocks"), 0);
  EXPECT_EQ(exposition.Value("attnserve_kv_cache_ahead_blocks"), 0);
  for (const char* process : {"process_cpu_seconds_total", "process_resident_memory_bytes",
                              "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
                              "process_start_time_seconds", "process_threads"}) {
    EXPECT_TRUE(exposition.Value(process).has_value()) << process;
  }
}

TEST_F(MetricsServerTest, EveryKernelPathARequestRunsOnHadItsComputeSeriesFromStartUp) {
  // The series made at start-up, and the paths real requests report (core
  // names them): FP32 and BF16, without maps (blocked) and with
  // (materialized), and decode steps (paged).
  std::vector<std::string> at_start_up;
  const Exposition start_up = Scrape();
  for (const Sample& s : start_up.samples()) {
    if (s.name == "attnserve_compute_seconds_count" && s.labels.at("model") == "default") {
      at_start_up.push_back(s.labels.at("kernel_path"));
    }
  }
  // Where BF16 does not run natively, BF16 requests run (and report) FP32.
  std::map<std::string, int> reported;
  for (v1::Precision precision : {v1::PRECISION_FP32, v1::PRECISION_BF16}) {
    for (v1::AttentionMapMode maps : {v1::ATTENTION_MAP_MODE_NONE, v1::ATTENTION_MAP_MODE_MEAN}) {
      v1::AttendRequest request = Request(1, 4);
      request.set_precision(precision);
      request.mutable_attention_maps()->set_mode(maps);
      v1::AttendResponse response;
      ASSERT_EQ(Attend(request, &response), grpc::StatusCode::OK);
      const int runs = ++reported[response.kernel_path()];
      EXPECT_EQ(Scrape().Count("attnserve_compute_seconds",
                               {{"model", "default"}, {"kernel_path", response.kernel_path()}}),
                runs)
          << response.kernel_path();
    }
  }
  // The decode route: an Extend step on a session over the model.
  grpc::ClientContext open_context;
  v1::OpenSessionRequest open;
  open.add_models("default");
  v1::Session session;
  ASSERT_TRUE(stub_->OpenSession(&open_context, open, &session).ok());
  int64_t length = 0;
  for (v1::Precision precision : {v1::PRECISION_FP32, v1::PRECISION_BF16}) {
    v1::ExtendRequest extend;
    extend.set_precision(precision);
    v1::ExtendStep* step = extend.add_steps();
    step->set_session_id(session.session_id());
    step->set_expected_length(length++);
    const std::vector<float> token(768, 0.25f);
    step->mutable_hidden_states()->set_dtype(v1::DATA_TYPE_FP32);
    step->mutable_hidden_states()->add_shape(1);
    step->mutable_hidden_states()->add_shape(768);
    step->mutable_hidden_states()->set_raw_data(token.data(), token.size() * sizeof(float));
    grpc::ClientContext context;
    v1::ExtendResponse response;
    ASSERT_TRUE(stub_->Extend(&context, extend, &response).ok());
    ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
    const int runs = ++reported[response.kernel_path()];
    EXPECT_EQ(Scrape().Count("attnserve_compute_seconds",
                             {{"model", "default"}, {"kernel_path", response.kernel_path()}}),
              runs)
        << response.kernel_path();
  }
  std::vector<std::string> reported_paths;
  for (const auto& [path, runs] : reported) reported_paths.push_back(path);
  std::sort(at_start_up.begin(), at_start_up.end());
  EXPECT_EQ(reported_paths, at_start_up);
}

TEST_F(MetricsServerTest, CountersAndHistogramsMoveByExactlyTheCallsMade) {
  // 3 OK: [1, 4] (4 tokens); [2, 3] with per-head maps (6 tokens, 2 x 12 x 3 x
  // 3 floats of maps); [2, 3] with lengths 2 and 3 (5 tokens).
  EXPECT_EQ(Attend(Request(1, 4)), grpc::StatusCode::OK);
  v1::AttendRequest with_maps = Request(2, 3);
  with_maps.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
  EXPECT_EQ(Attend(with_maps), grpc::StatusCode::OK);
  v1::AttendRequest ragged = Request(2, 3);
  ragged.add_sequence_lengths(2);
  ragged.add_sequence_lengths(3);
  EXPECT_EQ(Attend(ragged), grpc::StatusCode::OK);
  // 3 INVALID_ARGUMENT (for model "default"; a batch over --max_batch is one:
  // a fixed limit, not load), 1 NOT_FOUND.
  EXPECT_EQ(Attend(Request(1, 4, 32)), grpc::StatusCode::INVALID_ARGUMENT);
  v1::AttendRequest no_input = Request(1, 4);
  no_input.clear_hidden_states();
  EXPECT_EQ(Attend(no_input), grpc::StatusCode::INVALID_ARGUMENT);
  v1::AttendRequest unknown = Request(1, 4);
  unknown.set_model("client-chosen-name-7f3a");
  EXPECT_EQ(Attend(unknown), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Attend(Request(5, 2)), grpc::StatusCode::INVALID_ARGUMENT);  // max_batch 4
  // GetModel: 1 OK, 1 NOT_FOUND; ListModels: 1 OK.
  EXPECT_EQ(GetModel("default"), grpc::StatusCode::OK);
  EXPECT_EQ(GetModel("client-chosen-name-7f3a"), grpc::StatusCode::NOT_FOUND);
  {
    grpc::ClientContext context;
    v1::ListModelsResponse models;
    EXPECT_TRUE(stub_->ListModels(&context, v1::ListModelsRequest(), &models).ok());
  }

  const Exposition e = Scrape();
  auto requests = [&](const char* method, const char* code) {
    return e.Value("attnserve_requests_total", {{"method", method}, {"code", code}});
  };
  EXPECT_EQ(requests("Attend", "OK"), 3);
  EXPECT_EQ(requests("Attend", "INVALID_ARGUMENT"), 3);
  EXPECT_EQ(requests("Attend", "NOT_FOUND"), 1);
  EXPECT_EQ(requests("Attend", "RESOURCE_EXHAUSTED"), 0);
  EXPECT_EQ(requests("Attend", "UNAVAILABLE"), 0);
  EXPECT_EQ(requests("GetModel", "OK"), 1);
  EXPECT_EQ(requests("GetModel", "NOT_FOUND"), 1);
  EXPECT_EQ(requests("ListModels", "OK"), 1);

  auto duration = [&](const char* method, const char* model, const char* code) {
    return e.Count(kDuration, {{"method", method}, {"model", model}, {"code", code}});
  };
  EXPECT_EQ(duration("Attend", "default", "OK"), 3);
  EXPECT_EQ(duration("Attend", "default", "INVALID_ARGUMENT"), 3);
  EXPECT_EQ(duration("Attend", "default", "RESOURCE_EXHAUSTED"), 0);
  EXPECT_EQ(duration("Attend", "", "NOT_FOUND"), 1);  // an unknown name is no label
  EXPECT_EQ(duration("GetModel", "default", "OK"), 1);
  EXPECT_EQ(duration("GetModel", "", "NOT_FOUND"), 1);
  EXPECT_EQ(duration("ListModels", "", "OK"), 1);
  EXPECT_GT(*e.Sum(kDuration, {{"method", "Attend"}, {"model", "default"}, {"code", "OK"}}), 0);
  EXPECT_THAT(e.text(), Not(HasSubstr("client-chosen-name")));

  // Only the 3 requests that reached compute queue and compute.
  const Labels model = {{"model", "default"}};
  EXPECT_EQ(e.Count("attnserve_queue_wait_seconds", model), 3);
  // The request with maps runs materialized, the two without blocked.
  EXPECT_EQ(e.Count("attnserve_compute_seconds",
                    {{"model", "default"}, {"kernel_path", "fp32/materialized"}}),
            1);
  EXPECT_EQ(e.Count("attnserve_compute_seconds",
                    {{"model", "default"}, {"kernel_path", "fp32/blocked"}}),
            2);
  EXPECT_EQ(e.Count("attnserve_batch_size", model), 3);
  EXPECT_EQ(e.Sum("attnserve_batch_size", model), 1 + 2 + 2);
  EXPECT_EQ(e.Count("attnserve_batch_tokens", model), 3);
  EXPECT_EQ(e.Sum("attnserve_batch_tokens", model), 4 + 6 + 5);
  EXPECT_EQ(e.Value("attnserve_tokens_total", model), 4 + 6 + 5);
  EXPECT_EQ(e.Value("attnserve_attention_map_bytes_total", model), 2 * 12 * 3 * 3 * 4);
  EXPECT_EQ(e.Value("attnserve_queue_depth"), 0);
  EXPECT_EQ(e.Value("attnserve_requests_in_flight"), 0);
  // Ad-hoc series untouched.
  EXPECT_EQ(e.Value("attnserve_tokens_total", {{"model", ""}}), 0);
}

TEST_F(MetricsServerTest, AccessLogLinesCarryTheRequestIdButNoCredentials) {
  ::testing::internal::CaptureStderr();
  std::string id_back;
  EXPECT_EQ(
      Attend(Request(1, 4), nullptr,
             {{"x-request-id", "trace-42.a"}, {"authorization", "Bearer sekrit-token"}}, &id_back),
      grpc::StatusCode::OK);
  std::string made_id;
  EXPECT_EQ(Attend(Request(1, 4, 32), nullptr, {{"x-request-id", "bad id"}}, &made_id),
            grpc::StatusCode::INVALID_ARGUMENT);
  const std::string log = ::testing::internal::GetCapturedStderr();

  EXPECT_EQ(id_back, "trace-42.a");
  EXPECT_THAT(made_id, ::testing::MatchesRegex("[0-9a-f]{32}"));
  EXPECT_THAT(log, Not(HasSubstr("sekrit")));
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    if (absl::StrContains(line, R"("log":"access")")) lines.emplace_back(line);
  }
  ASSERT_EQ(lines.size(), 2u) << log;
  EXPECT_THAT(lines[0],
              HasSubstr(R"("request_id":"trace-42.a","method":"Attend","model":"default")"));
  EXPECT_THAT(lines[0], HasSubstr(R"("shapes":{"hidden_states":[1,4,768]},"code":"OK")"));
  EXPECT_THAT(lines[0], HasSubstr(R"("queue_seconds":)"));
  EXPECT_THAT(lines[0], HasSubstr(R"("compute_seconds":)"));
  EXPECT_THAT(lines[1], HasSubstr(absl::StrCat(R"("request_id":")", made_id, R"(")")));
  EXPECT_THAT(lines[1], HasSubstr(R"("code":"INVALID_ARGUMENT","message":")"));
  EXPECT_THAT(lines[1], Not(HasSubstr("queue_seconds")));
}

}  // namespace
}  // namespace attnserve::server
