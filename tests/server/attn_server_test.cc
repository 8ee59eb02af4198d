// The whole server (AttnServer) on real ports: what it does for a hostile or
// unlucky network -- one instance per port, a drain that ends in UNAVAILABLE
// (retryable) rather than CANCELLED -- and the process guard's parts: the
// open-file limit, the listener probe the watchdog runs, and the watchdog.
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/workspace.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "server/process_guard.h"
#include "tests/server/api/blockable_server.h"

namespace attnserve::server {
namespace {

ServerOptions TestOptions() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.builtin_model_seed = 7;
  options.lame_duck_seconds = 0;
  options.drain_timeout_seconds = 5;
  return options;
}

v1::AttendRequest SmallRequest(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(4 * 768);
  for (float& v : values) v = normal(rng);
  v1::AttendRequest request;
  request.set_model("default");
  v1::Tensor* t = request.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {1, 4, 768}) t->add_shape(d);
  t->set_raw_data(values.data(), values.size() * sizeof(float));
  return request;
}

// A TCP socket listening on a free loopback port that never accepts: what a
// gRPC listener that stopped accepting looks like from outside.
class DeafListener {
 public:
  DeafListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(listen(fd_, 16), 0);
    socklen_t size = sizeof(address);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
  }
  ~DeafListener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(AttnServerPort, ASecondInstanceOnABusyPortFailsToStartWithAClearMessage) {
  auto first = AttnServer::Create(TestOptions());
  ASSERT_TRUE(first.ok()) << first.status();
  ServerOptions second_options = TestOptions();
  second_options.listen_address = absl::StrCat("127.0.0.1:", (*first)->port());
  auto second = AttnServer::Create(second_options);
  ASSERT_FALSE(second.ok()) << "a second server started on busy port " << (*first)->port();
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("--listen_address"), std::string::npos)
      << second.status();
  EXPECT_NE(second.status().message().find("another process"), std::string::npos)
      << second.status();
}

// The compute worker's workspace caches the primitives it runs; the server
// turns oneDNN's own cache off (it only held second copies and shapes the
// workspace had evicted: memory that grew with every new batch shape), unless
// the environment sets its capacity.
TEST(AttnServerOneDnn, StartingTurnsOneDnnsOwnPrimitiveCacheOffUnlessTheEnvironmentSetsIt) {
  if (std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") != nullptr ||
      std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY") != nullptr) {
    GTEST_SKIP() << "the environment sets oneDNN's primitive cache capacity";
  }
  // oneDNN's default, as before the server starts.
  ASSERT_EQ(core::SetOneDnnPrimitiveCacheCapacityUnlessSet(1024).value_or(-1), 1024);
  {
    auto server = AttnServer::Create(TestOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(core::OneDnnPrimitiveCacheCapacity(), 0);
  }
  // A deployment that sets the variable keeps what oneDNN made of it (as if
  // it had read 77 at its first use).
  ASSERT_EQ(core::SetOneDnnPrimitiveCacheCapacityUnlessSet(77).value_or(-1), 77);
  ASSERT_EQ(setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "77", /*overwrite=*/1), 0);
  {
    auto server = AttnServer::Create(TestOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(core::OneDnnPrimitiveCacheCapacity(), 77);
  }
  unsetenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY");
  EXPECT_EQ(core::SetOneDnnPrimitiveCacheCapacityUnlessSet(-1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Later tests in this process see what a started server leaves.
  ASSERT_EQ(core::SetOneDnnPrimitiveCacheCapacityUnlessSet(0).value_or(-1), 0);
}

// The replica's name travels in every answer (what a client behind the proxy
// reads to see where its session lives): in the initial metadata of a
// successful call, in the trailers of a refused one (whose answer must stay
// trailers-only for clients to retry it elsewhere); without a name, nowhere.
TEST(AttnServerReplica, EveryAnswerNamesTheReplicaThatServedIt) {
  const std::string name = absl::StrCat("replica-", std::random_device{}() % 1000);
  for (const std::string& replica_name : {name, std::string()}) {
    ServerOptions options = TestOptions();
    options.replica_name = replica_name;
    auto server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    ASSERT_TRUE((*server)->LoadModelsAndServe().ok());
    auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));
    v1::AttendRequest unknown_model = SmallRequest(1);
    unknown_model.set_model("no-such-model");
    for (const v1::AttendRequest& request : {SmallRequest(2), unknown_model}) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      v1::AttendResponse response;
      const grpc::Status status = stub->Attend(&context, request, &response);
      EXPECT_EQ(status.error_code(), request.model() == "default" ? grpc::StatusCode::OK
                                                                  : grpc::StatusCode::NOT_FOUND)
          << status.error_message();
      const auto& initial = context.GetServerInitialMetadata();
      const auto& trailing = context.GetServerTrailingMetadata();
      const auto& named = status.ok() ? initial : trailing;
      const auto found = named.find("attnserve-replica");
      if (replica_name.empty()) {
        EXPECT_EQ(found, named.end());
      } else {
        ASSERT_NE(found, named.end()) << "model " << request.model();
        EXPECT_EQ(std::string(found->second.data(), found->second.size()), replica_name);
        EXPECT_EQ(named.count("attnserve-replica"), 1u);
      }
      if (!status.ok()) {
        EXPECT_EQ(initial.count("attnserve-replica"), 0u) << "a refusal sent headers of ours";
      }
    }
    (*server)->Shutdown();
  }
}

TEST(AttnServerDrain, ACallStillInFlightWhenTheDrainTimeoutEndsAnswersUnavailable) {
  ServerOptions options = TestOptions();
  options.drain_timeout_seconds = 0;
  // The call is held in the queue, waiting for batch-mates that never come,
  // for far longer than the drain lasts.
  options.max_batch_tokens = 1 << 20;
  options.max_queue_delay_us = 10 * 1000 * 1000;
  auto server = AttnServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->LoadModelsAndServe().ok());
  auto stub = v1::AttentionService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));

  const v1::AttendRequest held = SmallRequest(std::random_device{}());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::AttendResponse response;
  grpc::Status status;
  absl::Notification done;
  stub->async()->Attend(&context, &held, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  ASSERT_TRUE(testing::WaitForSample([&] { return (*server)->MetricsText(); },
                                     "attnserve_queue_depth", 1))
      << "the held call was never queued";
  const absl::Time stop = absl::Now();
  (*server)->Shutdown();
  done.WaitForNotification();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_NE(status.error_message().find("shutting down"), std::string::npos)
      << status.error_message();
  // Not after the batching delay it was waiting out.
  EXPECT_LT(absl::Now() - stop, absl::Seconds(9));
}

// The body of http://127.0.0.1:port/path (HTTP/1.0, read to the close).
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\n\r\n");
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

TEST(AttnServerReadiness, AttnserveServingAndReadySayWhetherTheServerServes) {
  ServerOptions options = TestOptions();
  options.metrics_address = "127.0.0.1:0";
  auto server = AttnServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->metrics_port();
  EXPECT_EQ(testing::SampleValue((*server)->MetricsText(), "attnserve_serving"), 0);
  EXPECT_NE(HttpGet(port, "/ready").find("attnserve_serving 0"), std::string::npos);
  ASSERT_TRUE((*server)->LoadModelsAndServe().ok());
  EXPECT_EQ(testing::SampleValue((*server)->MetricsText(), "attnserve_serving"), 1);
  const std::string ready = HttpGet(port, "/ready");
  EXPECT_NE(ready.find("attnserve_serving 1"), std::string::npos) << ready;
  // /ready holds that one gauge (and the endpoint's own counters): a proxy's
  // health check reads it whole.
  EXPECT_EQ(ready.find("attnserve_requests_total"), std::string::npos) << ready;
  EXPECT_LT(ready.size(), 2048u) << ready;  // with the endpoint's own exposer_* counters
  EXPECT_NE(HttpGet(port, "/metrics").find("attnserve_serving 1"), std::string::npos);
  std::thread stopper([&] { (*server)->Shutdown(); });
  EXPECT_TRUE(testing::WaitForSample([&] { return (*server)->MetricsText(); },
                                     "attnserve_serving", 0));
  stopper.join();
}

TEST(ProcessGuard, ProbeListenerSaysWhetherThePortAcceptsConnections) {
  auto server = AttnServer::Create(TestOptions());
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Status serving = ProbeListener("127.0.0.1", (*server)->port(), absl::Seconds(30));
  EXPECT_TRUE(serving.ok()) << serving;
  // The server listens on 127.0.0.1 only; "localhost" may resolve to ::1 first.
  const absl::Status by_name = ProbeListener("localhost", (*server)->port(), absl::Seconds(30));
  EXPECT_TRUE(by_name.ok()) << by_name;

  DeafListener deaf;
  const absl::Status unanswered = ProbeListener("127.0.0.1", deaf.port(), absl::Milliseconds(300));
  EXPECT_EQ(unanswered.code(), absl::StatusCode::kUnavailable) << unanswered;
  EXPECT_NE(unanswered.message().find("stayed in the listen backlog"), std::string::npos)
      << unanswered;

  (*server)->Shutdown();
  const absl::Status refused = ProbeListener("127.0.0.1", (*server)->port(), absl::Seconds(30));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_NE(refused.message().find("cannot connect"), std::string::npos) << refused;
}

TEST(ProcessGuard, ProbeHostTurnsWildcardsIntoLoopback) {
  EXPECT_EQ(ProbeHost("0.0.0.0:50051"), "127.0.0.1");
  EXPECT_EQ(ProbeHost(":50051"), "127.0.0.1");
  EXPECT_EQ(ProbeHost("[::]:50051"), "localhost");
  EXPECT_EQ(ProbeHost("[::1]:50051"), "::1");
  EXPECT_EQ(ProbeHost("10.1.2.3:50051"), "10.1.2.3");
  EXPECT_EQ(ProbeHost("localhost:0"), "localhost");
}

TEST(ProcessGuard, TheOpenFileLimitIsRaisedToTheHardLimitAndAMinimumAboveItRefuses) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  ASSERT_NE(before.rlim_max, RLIM_INFINITY) << "this test needs a finite hard limit";
  ASSERT_GT(before.rlim_max, 256u);
  rlimit lowered = before;
  lowered.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);

  const absl::StatusOr<int64_t> raised = RaiseOpenFileLimit(0);
  ASSERT_TRUE(raised.ok()) << raised.status();
  EXPECT_EQ(*raised, static_cast<int64_t>(before.rlim_max));
  rlimit now{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_EQ(now.rlim_cur, before.rlim_max);

  const absl::StatusOr<int64_t> refused =
      RaiseOpenFileLimit(static_cast<int64_t>(before.rlim_max) + 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("--min_open_files"), std::string::npos)
      << refused.status();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
}

TEST(ProcessGuard, ResidentBytesReadsThisProcess) {
  const int64_t before = ResidentBytes();
  ASSERT_GT(before, 0);
  // 64 MiB touched page by page is resident.
  std::vector<char> touched(64 << 20);
  for (size_t i = 0; i < touched.size(); i += 4096) touched[i] = 1;
  EXPECT_GE(ResidentBytes(), before + (48 << 20));
  EXPECT_EQ(touched[4096], 1);
}

TEST(ProcessGuard, TheWatchdogTripsOnADeafListenerAndNotOnAServingOne) {
  DeafListener deaf;
  absl::Notification tripped;
  std::string reason;
  {
    Watchdog watchdog({.host = "127.0.0.1",
                       .port = deaf.port(),
                       .interval = absl::Milliseconds(10),
                       .probe_timeout = absl::Milliseconds(100),
                       .failures = 3,
                       .on_trip =
                           [&](const std::string& why) {
                             reason = why;
                             tripped.Notify();
                           }});
    ASSERT_TRUE(tripped.WaitForNotificationWithTimeout(absl::Seconds(60)));
  }
  EXPECT_NE(reason.find("no longer accepts connections"), std::string::npos) << reason;
  EXPECT_NE(reason.find("3 probes in a row"), std::string::npos) << reason;

  // A serving port: with a memory bound every check fails for memory, and
  // the trip names memory -- the listener check, which would name the port
  // first, never failed 5 times in a row.
  auto server = AttnServer::Create(TestOptions());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::Notification memory_tripped;
  std::string memory_reason;
  {
    Watchdog watchdog({.host = "127.0.0.1",
                       .port = (*server)->port(),
                       .interval = absl::Milliseconds(10),
                       .probe_timeout = absl::Seconds(30),
                       .failures = 5,
                       .max_rss_bytes = 1,
                       .on_trip =
                           [&](const std::string& why) {
                             memory_reason = why;
                             memory_tripped.Notify();
                           }});
    ASSERT_TRUE(memory_tripped.WaitForNotificationWithTimeout(absl::Seconds(60)));
  }
  EXPECT_NE(memory_reason.find("--max_rss_bytes"), std::string::npos) << memory_reason;
  EXPECT_NE(memory_reason.find("5 checks in a row"), std::string::npos) << memory_reason;
}

}  // namespace
}  // namespace attnserve::server
