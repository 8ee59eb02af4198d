// AttendStream through the real server on an ephemeral port, called with the
// client library (AttentionClient::AttendStream) and the generated stub: the
// maps it streams equal the in-process layer's bit for bit and the
// double-precision reference within 1e-5; each message stays under the
// server's message limit, which no longer bounds the maps (the map limit
// does); errors arrive as the stream's status; a client that stops reading
// ends its call and the server serves on.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "tests/core/reference_attention.h"
#include "tests/server/api/attend_requests.h"
#include "tests/server/api/blockable_server.h"

namespace attnserve::server {
namespace {

constexpr uint64_t kSeed = 11;
// Each message of a response stays under this; the maps may be larger.
constexpr int64_t kMaxMessageBytes = 2 << 20;

ServerOptions StreamOptions() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.builtin_model_seed = kSeed;
  options.limits.max_batch = 4;
  options.limits.max_seq_len = 256;
  options.limits.max_attention_map_bytes = 16 << 20;
  options.max_send_message_bytes = kMaxMessageBytes;
  options.lame_duck_seconds = 0;
  options.drain_timeout_seconds = 5;
  return options;
}

using testing::Floats;
using testing::RandomValues;
using testing::RawRequest;

class AttendStreamServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Create(StreamOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->LoadModelsAndServe().ok());
    client::ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", server_->port());
    options.retry.max_attempts = 1;
    // A client that accepts no message over the server's limit: the stream
    // must keep every message under it.
    options.max_receive_message_bytes = kMaxMessageBytes;
    absl::StatusOr<std::unique_ptr<client::AttentionClient>> client =
        client::AttentionClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  std::string Metrics() const { return server_->MetricsText(); }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<client::AttentionClient> client_;
};

TEST_F(AttendStreamServiceTest, StreamedMapsEqualTheInProcessLayerAndTheReference) {
  core::HeadConfig requested;
  requested.d_model = 768;
  requested.num_heads = 12;
  const core::HeadConfig config = *core::ResolveHeadConfig(requested);
  const core::AttentionWeights weights = core::SeededWeights(config, kSeed);
  auto layer = *core::AttentionLayer::Create(config, weights);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  struct Case {
    int64_t batch, seq;
    v1::AttentionMapMode wire;
    core::AttentionMapMode core;
  };
  for (const Case& c : {Case{2, 64, v1::ATTENTION_MAP_MODE_PER_HEAD, core::AttentionMapMode::kPerHead},
                        Case{3, 17, v1::ATTENTION_MAP_MODE_MEAN, core::AttentionMapMode::kMeanOverHeads}}) {
    SCOPED_TRACE(absl::StrCat("batch ", c.batch, " seq ", c.seq));
    const std::vector<float> input = RandomValues(c.batch * c.seq * 768, seed + c.seq);
    int64_t chunks = 0;
    absl::StatusOr<v1::AttendResponse> response =
        client_->AttendStream(RawRequest(c.batch, c.seq, input, c.wire), &chunks);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_GE(chunks, 1);

    core::LayerInputs inputs;
    inputs.hidden_states = input;
    inputs.layout = *core::SequenceLayout::Padded(c.batch, c.seq);
    core::ForwardOptions options;
    options.maps.mode = c.core;
    std::vector<float> output(input.size());
    std::vector<float> maps(
        *core::AttentionMapElements(config, inputs.layout, inputs.layout, options.maps));
    core::ForwardOutputs outputs;
    outputs.output = absl::MakeSpan(output);
    outputs.attention_maps = absl::MakeSpan(maps);
    ASSERT_TRUE(layer->Forward(inputs, options, outputs).ok());
    EXPECT_EQ(Floats(response->output()), output);
    const std::vector<float> streamed = Floats(response->attention_maps());
    EXPECT_EQ(streamed, maps);

    const testing::ReferenceResult reference = testing::ReferenceLayer(config, weights, inputs);
    const std::vector<double>& expected = c.core == core::AttentionMapMode::kPerHead
                                              ? reference.per_head_maps
                                              : reference.mean_maps;
    ASSERT_EQ(streamed.size(), expected.size());
    double worst = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      worst = std::max(worst, std::abs(streamed[i] - expected[i]));
    }
    EXPECT_LT(worst, 1e-5);  // probabilities: absolute error
  }
}

TEST_F(AttendStreamServiceTest, Bf16MapsOfSomeHeadsAndRowsComeAsAttendSendsThem) {
  const std::vector<float> input = RandomValues(2 * 40 * 768, std::random_device{}());
  v1::AttendRequest request = RawRequest(2, 40, input, v1::ATTENTION_MAP_MODE_PER_HEAD);
  request.set_output_dtype(v1::DATA_TYPE_BF16);
  for (int h : {7, 2, 11}) request.mutable_attention_maps()->add_heads(h);
  for (int r : {39, 0, 5}) request.mutable_attention_maps()->add_query_rows(r);
  absl::StatusOr<v1::AttendResponse> unary = client_->Attend(request);
  ASSERT_TRUE(unary.ok()) << unary.status();
  absl::StatusOr<v1::AttendResponse> streamed = client_->AttendStream(request);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ(streamed->attention_maps().dtype(), v1::DATA_TYPE_BF16);
  EXPECT_EQ(streamed->attention_maps().SerializeAsString(),
            unary->attention_maps().SerializeAsString());
  EXPECT_EQ(streamed->output().SerializeAsString(), unary->output().SerializeAsString());
}

TEST_F(AttendStreamServiceTest, MapsOverTheMessageLimitStreamWhereAttendRefusesThem) {
  // [4, 12, 128, 128] FP32 is 3 MiB: under the map limit, over the message
  // limit (the output, 1.5 MiB, is under it).
  const v1::AttendRequest request =
      RawRequest(4, 128, RandomValues(4 * 128 * 768, std::random_device{}()),
              v1::ATTENTION_MAP_MODE_PER_HEAD);
  absl::StatusOr<v1::AttendResponse> unary = client_->Attend(request);
  EXPECT_EQ(unary.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unary.status().message().find("--max_send_message_bytes"), std::string::npos)
      << unary.status();
  EXPECT_NE(unary.status().message().find("AttendStream"), std::string::npos) << unary.status();

  int64_t chunks = 0;
  absl::StatusOr<v1::AttendResponse> streamed = client_->AttendStream(request, &chunks);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_GE(chunks, 3);  // of at most 1 MiB each
  // Every row is a distribution.
  const std::vector<float> maps = Floats(streamed->attention_maps());
  ASSERT_EQ(maps.size(), size_t{4} * 12 * 128 * 128);
  for (size_t row = 0; row < maps.size() / 128; ++row) {
    double sum = 0;
    for (size_t j = 0; j < 128; ++j) sum += maps[row * 128 + j];
    ASSERT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }
  EXPECT_EQ(testing::SampleValue(Metrics(),
                                 "attnserve_requests_total{code=\"OK\",method=\"AttendStream\"}"),
            1);
}

TEST_F(AttendStreamServiceTest, TheMapLimitBoundsTheStreamsTotal) {
  // [2, 48, 256, 256] FP32 is 24 MiB, over the limit of 16 MiB (a layer of 48
  // heads; its output, 1.5 MiB, is under the message limit).
  v1::AttendRequest request = RawRequest(2, 256, RandomValues(2 * 256 * 768, 5),
                                      v1::ATTENTION_MAP_MODE_PER_HEAD);
  request.clear_model();
  request.mutable_layer()->mutable_head_config()->set_d_model(768);
  request.mutable_layer()->mutable_head_config()->set_num_heads(48);
  request.mutable_layer()->set_seed(3);
  absl::StatusOr<v1::AttendResponse> streamed = client_->AttendStream(request);
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(streamed.status().message().find("--max_attention_map_bytes"), std::string::npos)
      << streamed.status();
}

TEST_F(AttendStreamServiceTest, ErrorsArriveAsTheStreamsStatus) {
  v1::AttendRequest request = RawRequest(1, 4, RandomValues(4 * 768, 1), v1::ATTENTION_MAP_MODE_MEAN);
  request.set_model("no-such-model");
  EXPECT_EQ(client_->AttendStream(request).status().code(), absl::StatusCode::kNotFound);
  request.set_model("default");
  request.mutable_hidden_states()->set_shape(2, 769);
  absl::StatusOr<v1::AttendResponse> bad = client_->AttendStream(request);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("hidden_states"), std::string::npos) << bad.status();
}

TEST_F(AttendStreamServiceTest, AClientThatStopsReadingEndsItsCallAndTheServerServesOn) {
  // A client that reads the first message of 6 MiB of maps, then goes. Its
  // receive window stays small (no BDP probing), so the server cannot have
  // sent everything before the cancel.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  auto stub = v1::AttentionService::NewStub(grpc::CreateCustomChannel(
      absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials(), args));
  const v1::AttendRequest request = RawRequest(2, 256, RandomValues(2 * 256 * 768, 2),
                                            v1::ATTENTION_MAP_MODE_PER_HEAD);
  {
    grpc::ClientContext context;
    auto reader = stub->AttendStream(&context, request);
    v1::AttendStreamResponse first;
    ASSERT_TRUE(reader->Read(&first));
    ASSERT_TRUE(first.has_response());
    context.TryCancel();
    while (reader->Read(&first)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(testing::WaitForSample(
      [this] { return Metrics(); },
      "attnserve_requests_total{code=\"CANCELLED\",method=\"AttendStream\"}", 1));
  ASSERT_TRUE(
      testing::WaitForSample([this] { return Metrics(); }, "attnserve_requests_in_flight", 0));
  int64_t chunks = 0;
  absl::StatusOr<v1::AttendResponse> next = client_->AttendStream(request, &chunks);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(chunks, 6);  // 1 MiB each: 4 heads of 256 KiB
}

}  // namespace
}  // namespace attnserve::server
