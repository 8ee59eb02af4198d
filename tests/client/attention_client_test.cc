#include "client/attention_client.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::client {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(ChannelTarget, KeepsOneAddressAndUrisAsTheyAre) {
  EXPECT_EQ(*ChannelTarget("localhost:50051"), "localhost:50051");
  EXPECT_EQ(*ChannelTarget("127.0.0.1:50051"), "127.0.0.1:50051");
  EXPECT_EQ(*ChannelTarget("dns:///attnserve-headless:50051"), "dns:///attnserve-headless:50051");
  EXPECT_EQ(*ChannelTarget("ipv4:127.0.0.1:1,127.0.0.1:2"), "ipv4:127.0.0.1:1,127.0.0.1:2");
  EXPECT_EQ(*ChannelTarget("unix:/run/attnserve.sock"), "unix:/run/attnserve.sock");
}

TEST(ChannelTarget, TurnsAListOfReplicasIntoAnIpUri) {
  EXPECT_EQ(*ChannelTarget("127.0.0.1:5001,127.0.0.1:5002, 127.0.0.1:5003"),
            "ipv4:127.0.0.1:5001,127.0.0.1:5002,127.0.0.1:5003");
  EXPECT_EQ(*ChannelTarget("[::1]:5001,[::1]:5002"), "ipv6:[::1]:5001,[::1]:5002");
}

TEST(ChannelTarget, RefusesListsGrpcCannotResolve) {
  EXPECT_THAT(ChannelTarget(""), StatusIs(absl::StatusCode::kInvalidArgument, "target"));
  absl::StatusOr<std::string> names = ChannelTarget("localhost:1,localhost:2");
  EXPECT_THAT(names, StatusIs(absl::StatusCode::kInvalidArgument, "target: 'localhost:1'"));
  EXPECT_THAT(names, StatusIs(absl::StatusCode::kInvalidArgument, "dns:///"));
  EXPECT_THAT(ChannelTarget("127.0.0.1:1,,127.0.0.1:2"),
              StatusIs(absl::StatusCode::kInvalidArgument, "empty entry"));
  EXPECT_THAT(ChannelTarget("127.0.0.1:1,[::1]:2"),
              StatusIs(absl::StatusCode::kInvalidArgument, "mixes"));
  for (const char* bad :
       {"127.0.0.1,127.0.0.1:2", "127.0.0.1:0,127.0.0.1:2", "127.0.0.1:70000,127.0.0.1:2",
        "127.0.0.1:x,127.0.0.1:2", "::1:5,::1:6", "300.0.0.1:1,127.0.0.1:2"}) {
    EXPECT_THAT(ChannelTarget(bad), StatusIs(absl::StatusCode::kInvalidArgument, "target")) << bad;
  }
}

TEST(ServiceConfig, RoundRobinWithHealthCheckingAndRetriesOfUnavailable) {
  ClientOptions options;
  options.lb_policy = "round_robin";
  options.retry = {.max_attempts = 3,
                   .initial_backoff_seconds = 0.1,
                   .max_backoff_seconds = 2,
                   .backoff_multiplier = 1.5};
  EXPECT_EQ(*ServiceConfigJson(options),
            "{\"loadBalancingConfig\": [{\"round_robin\": {}}], "
            "\"healthCheckConfig\": {\"serviceName\": \"attnserve.v1.AttentionService\"}, "
            "\"methodConfig\": [{\"name\": [{\"service\": \"attnserve.v1.AttentionService\"}, "
            "{\"service\": \"grpc.health.v1.Health\"}], \"retryPolicy\": {\"maxAttempts\": 3, "
            "\"initialBackoff\": \"0.100000s\", \"maxBackoff\": \"2.000000s\", "
            "\"backoffMultiplier\": 1.5, \"retryableStatusCodes\": [\"UNAVAILABLE\"]}}]}");
}

TEST(ServiceConfig, LeavesOutWhatIsNotAsked) {
  ClientOptions options;  // default policy, retries on
  std::string json = *ServiceConfigJson(options);
  EXPECT_THAT(json, Not(HasSubstr("loadBalancingConfig")));
  EXPECT_THAT(json, Not(HasSubstr("healthCheckConfig")));  // pick_first would ignore it
  EXPECT_THAT(json, HasSubstr("\"maxAttempts\": 4"));

  options.lb_policy = "round_robin";
  options.health_check_service = "";
  options.retry.max_attempts = 1;
  EXPECT_EQ(*ServiceConfigJson(options), "{\"loadBalancingConfig\": [{\"round_robin\": {}}]}");
}

TEST(ServiceConfig, RefusesWhatGrpcWouldReject) {
  ClientOptions options;
  options.lb_policy = "least_request";
  EXPECT_THAT(ServiceConfigJson(options),
              StatusIs(absl::StatusCode::kInvalidArgument, "lb_policy"));
  options = ClientOptions();
  for (int attempts : {0, 6}) {
    options.retry.max_attempts = attempts;
    EXPECT_THAT(ServiceConfigJson(options),
                StatusIs(absl::StatusCode::kInvalidArgument, "max_attempts"));
  }
  options = ClientOptions();
  options.retry.initial_backoff_seconds = 0;
  EXPECT_THAT(ServiceConfigJson(options), StatusIs(absl::StatusCode::kInvalidArgument, "backoff"));
  options = ClientOptions();
  options.health_check_service = "x\"}";
  EXPECT_THAT(ServiceConfigJson(options),
              StatusIs(absl::StatusCode::kInvalidArgument, "health_check_service"));
}

TEST(AttentionClient, CreateChecksTargetAndPolicy) {
  ClientOptions options;
  options.target = "127.0.0.1:1,127.0.0.1:2";
  options.lb_policy = "round_robin";
  EXPECT_THAT(AttentionClient::Create(options), IsOk());
  options.lb_policy = "random";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, "lb_policy"));
  options.lb_policy = "";
  options.target = "a:1,b:2";
  EXPECT_THAT(AttentionClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, "target"));
}

// gRPC parses the service config when the channel is created; a config it
// rejects makes a lame channel whose every call fails INVALID_ARGUMENT ("Failed
// to create ... channel"), instead of the connection error a valid one gives
// on closed ports.
TEST(AttentionClient, GrpcAcceptsTheServiceConfig) {
  ClientOptions options;
  options.target = "127.0.0.1:1,127.0.0.1:2";  // nothing listens on port 1 or 2
  options.lb_policy = "round_robin";
  options.timeout_seconds = 2;
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  ASSERT_THAT(client, IsOk());
  auto health = (*client)->CheckHealth("");
  ASSERT_FALSE(health.ok());
  EXPECT_THAT(std::string(health.status().message()), Not(HasSubstr("Failed to create")));
  EXPECT_TRUE(health.status().code() == absl::StatusCode::kUnavailable ||
              health.status().code() == absl::StatusCode::kDeadlineExceeded)
      << health.status();
}

// gRPC's own words for a message over a receive limit, as the message_size
// filter writes them on either side.
absl::Status LargerThanMax(int64_t size, int64_t limit) {
  return absl::ResourceExhaustedError(
      absl::StrCat("Received message larger than max (", size, " vs. ", limit, ")"));
}

TEST(MessageSizeError, ARequestOverTheServersLimitNamesTheServersFlag) {
  const absl::Status explained =
      ExplainMessageSizeError(LargerThanMax(5000123, 1048576), /*request_bytes=*/5000123,
                              /*client_limit=*/256 << 20);
  EXPECT_EQ(explained.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(explained.message(), HasSubstr("the request (5000123 bytes)"));
  EXPECT_THAT(explained.message(),
              HasSubstr("server's limit of 1048576 bytes (attnserve --max_receive_message_bytes)"));
  EXPECT_THAT(explained.message(), HasSubstr("send less per call"));
  EXPECT_THAT(explained.message(),
              HasSubstr("(gRPC: Received message larger than max (5000123 vs. 1048576))"));
  EXPECT_THAT(explained.message(), Not(HasSubstr("client's")));
}

TEST(MessageSizeError, AResponseOverTheClientsLimitNamesTheClientsFlag) {
  const absl::Status explained = ExplainMessageSizeError(
      LargerThanMax(9000, 4096), /*request_bytes=*/120, /*client_limit=*/4096);
  EXPECT_EQ(explained.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(explained.message(), HasSubstr("the response (9000 bytes)"));
  EXPECT_THAT(explained.message(),
              HasSubstr("this client's limit of 4096 bytes (--max_receive_message_bytes)"));
  EXPECT_THAT(explained.message(), Not(HasSubstr("attnserve")));
}

TEST(MessageSizeError, SizesThatFitNeitherSideNameBothFlags) {
  const absl::Status explained =
      ExplainMessageSizeError(LargerThanMax(700, 500), /*request_bytes=*/10, /*client_limit=*/600);
  EXPECT_EQ(explained.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(explained.message(), HasSubstr("attnserve --max_receive_message_bytes"));
  EXPECT_THAT(explained.message(), HasSubstr("this client's (--max_receive_message_bytes)"));
}

TEST(MessageSizeError, OtherStatusesPassUnchanged) {
  for (const absl::Status& status :
       {absl::ResourceExhaustedError("the compute queue is full (--max_queued_requests)"),
        absl::InvalidArgumentError("Received message larger than max (5 vs. 4)"),
        absl::ResourceExhaustedError("Received message larger than max (x vs. 4)"),
        absl::OkStatus()}) {
    EXPECT_EQ(ExplainMessageSizeError(status, 5, 4), status) << status;
  }
}

TEST(AttentionClient, CreateChecksTheReceiveLimit) {
  ClientOptions options;
  options.target = "127.0.0.1:1";
  for (int64_t bad : {int64_t{0}, int64_t{-1}, int64_t{1} << 31}) {
    options.max_receive_message_bytes = bad;
    EXPECT_THAT(AttentionClient::Create(options),
                StatusIs(absl::StatusCode::kInvalidArgument, "max_receive_message_bytes"))
        << bad;
  }
  options.max_receive_message_bytes = (int64_t{1} << 31) - 1;
  EXPECT_THAT(AttentionClient::Create(options), IsOk());
}

// The positive control of GrpcAcceptsTheServiceConfig: a service config gRPC
// rejects makes the lame channel it looks for (INVALID_ARGUMENT, "Failed to
// create ... channel"; the reason goes to gRPC's log only).
TEST(AttentionClient, GrpcMakesALameChannelOfAServiceConfigItRejects) {
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON("{\"loadBalancingConfig\": [{\"no_such_policy\": {}}]}");
  auto channel = grpc::CreateCustomChannel("127.0.0.1:1", grpc::InsecureChannelCredentials(), args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, {}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("Failed to create"));
}

TEST(AttentionClient, RefusesARoutingKeyThatCannotBeAHeaderValue) {
  ClientOptions options;
  options.target = "127.0.0.1:1";
  const std::vector<std::string> bad_keys = {"two\nlines", "tab\there", std::string("nul\0", 4),
                                            "caf\xc3\xa9"};
  for (const std::string& bad : bad_keys) {
    options.routing_key = bad;
    EXPECT_THAT(AttentionClient::Create(options),
                StatusIs(absl::StatusCode::kInvalidArgument, "routing_key"));
  }
  options.routing_key = "session-7f3a 42";
  EXPECT_THAT(AttentionClient::Create(options).status(), IsOk());
}

}  // namespace
}  // namespace attnserve::client
