// The real server on an ephemeral port, called through the generated stubs.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"

namespace attnserve::server {
namespace {

using grpc::health::v1::HealthCheckResponse;

constexpr uint64_t kSeed = 7;

ServerOptions TestOptions() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.builtin_model_seed = kSeed;
  options.limits.max_batch = 4;
  options.limits.max_seq_len = 64;
  options.limits.max_attention_map_bytes = 256 << 10;
  // 800 KiB: the output of a [4, 64] request (768 KiB) fits, with its mean
  // maps (64 KiB, under the map limit) it does not.
  options.max_send_message_bytes = 800 << 10;
  options.drain_timeout_seconds = 5;
  return options;
}

std::vector<float> RandomValues(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

v1::AttendRequest RawRequest(int64_t batch, int64_t seq, const std::vector<float>& values,
                             v1::AttentionMapMode maps = v1::ATTENTION_MAP_MODE_NONE) {
  v1::AttendRequest request;
  request.set_model("default");
  v1::Tensor* t = request.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {batch, seq, int64_t{768}}) t->add_shape(d);
  t->set_raw_data(values.data(), values.size() * sizeof(float));
  request.mutable_attention_maps()->set_mode(maps);
  return request;
}

std::vector<float> Floats(const v1::Tensor& t) {
  if (t.float_data_size() > 0) return {t.float_data().begin(), t.float_data().end()};
  std::vector<float> values(t.raw_data().size() / sizeof(float));
  std::memcpy(values.data(), t.raw_data().data(), t.raw_data().size());
  return values;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class AttentionServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = AttnServer::Create(TestOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::AttentionService::NewStub(channel_);
    health_ = grpc::health::v1::Health::NewStub(channel_);
  }

  void Serve() { ASSERT_TRUE(server_->LoadModelsAndServe().ok()); }

  grpc::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->Attend(&context, request, response);
  }

  HealthCheckResponse::ServingStatus Health(const std::string& service) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status = health_->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  }

  // The same layer as the server's model, run in this process.
  static std::unique_ptr<core::AttentionLayer> InProcessLayer() {
    core::HeadConfig config = *core::ResolveHeadConfig({.d_model = 768, .num_heads = 12});
    return *core::AttentionLayer::Create(config, core::SeededWeights(config, kSeed));
  }

  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

TEST_F(AttentionServiceTest, HealthIsNotServingUntilTheModelIsWarmThenServing) {
  EXPECT_EQ(Health(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health("attnserve.v1.AttentionService"), HealthCheckResponse::NOT_SERVING);
  v1::AttendResponse response;
  EXPECT_EQ(Attend(RawRequest(1, 2, RandomValues(2 * 768, 1)), &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  Serve();
  EXPECT_EQ(Health(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health("attnserve.v1.AttentionService"), HealthCheckResponse::SERVING);
}

TEST_F(AttentionServiceTest, ListModelsAndGetModelReportTheHeadConfiguration) {
  Serve();
  grpc::ClientContext list_context;
  v1::ListModelsResponse list;
  ASSERT_TRUE(stub_->ListModels(&list_context, {}, &list).ok());
  ASSERT_EQ(list.models_size(), 1);
  const v1::ModelInfo& model = list.models(0);
  EXPECT_EQ(model.name(), "default");
  EXPECT_EQ(model.head_config().d_model(), 768);
  EXPECT_EQ(model.head_config().num_heads(), 12);
  EXPECT_EQ(model.head_config().num_kv_heads(), 12);
  EXPECT_EQ(model.head_config().head_dim(), 64);
  EXPECT_FLOAT_EQ(model.head_config().scale(), 0.125f);
  EXPECT_EQ(model.limits().max_seq_len(), 64);

  grpc::ClientContext get_context;
  v1::GetModelRequest get;
  get.set_name("default");
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModel(&get_context, get, &info).ok());
  EXPECT_EQ(info.SerializeAsString(), model.SerializeAsString());

  grpc::ClientContext missing_context;
  get.set_name("no-such-model");
  grpc::Status missing = stub_->GetModel(&missing_context, get, &info);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(missing.error_message().find("no-such-model"), std::string::npos);
}

TEST_F(AttentionServiceTest, RoundTripEqualsInProcessCoreBitForBit) {
  Serve();
  auto layer = InProcessLayer();
  const std::random_device::result_type seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  struct Case {
    int64_t batch, seq;
    v1::AttentionMapMode wire_maps;
    core::AttentionMapMode core_maps;
  };
  for (const Case& c : {Case{1, 1, v1::ATTENTION_MAP_MODE_NONE, core::AttentionMapMode::kNone},
                        Case{2, 9, v1::ATTENTION_MAP_MODE_PER_HEAD, core::AttentionMapMode::kPerHead},
                        Case{3, 17, v1::ATTENTION_MAP_MODE_MEAN, core::AttentionMapMode::kMeanOverHeads},
                        Case{4, 64, v1::ATTENTION_MAP_MODE_NONE, core::AttentionMapMode::kNone}}) {
    SCOPED_TRACE(absl::StrCat("batch ", c.batch, " seq ", c.seq, " maps ", c.wire_maps));
    const std::vector<float> input = RandomValues(c.batch * c.seq * 768, seed + c.seq);
    v1::AttendResponse response;
    grpc::Status status = Attend(RawRequest(c.batch, c.seq, input, c.wire_maps), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();

    std::vector<float> output(input.size());
    const int64_t map_elements =
        *core::AttentionMapElements(layer->config(), {c.batch, c.seq}, c.core_maps);
    std::vector<float> maps(map_elements);
    core::ForwardOptions options;
    options.attention_maps = c.core_maps;
    ASSERT_TRUE(
        layer->Forward(input, {c.batch, c.seq}, options, {absl::MakeSpan(output), absl::MakeSpan(maps)})
            .ok());
    EXPECT_EQ(response.model(), "default");
    EXPECT_EQ(response.kernel_path(), "fp32/materialized");
    EXPECT_EQ(response.output().dtype(), v1::DATA_TYPE_FP32);
    EXPECT_EQ(std::vector<int64_t>(response.output().shape().begin(), response.output().shape().end()),
              (std::vector<int64_t>{c.batch, c.seq, 768}));
    EXPECT_TRUE(BitEqual(Floats(response.output()), output));
    if (c.core_maps == core::AttentionMapMode::kNone) {
      EXPECT_FALSE(response.has_attention_maps());
    } else {
      EXPECT_EQ(response.attention_maps().shape_size(),
                c.core_maps == core::AttentionMapMode::kPerHead ? 4 : 3);
      EXPECT_TRUE(BitEqual(Floats(response.attention_maps()), maps));
    }
    EXPECT_EQ(response.timing().batch_size(), 1);
    EXPECT_GT(response.timing().compute().seconds() * 1e9 + response.timing().compute().nanos(), 0);
  }
}

TEST_F(AttentionServiceTest, FloatDataRequestGetsFloatDataResponseWithTheSameValues) {
  Serve();
  const std::vector<float> input = RandomValues(3 * 768, std::random_device{}());
  v1::AttendRequest raw = RawRequest(1, 3, input, v1::ATTENTION_MAP_MODE_PER_HEAD);
  v1::AttendRequest hand_written = raw;
  hand_written.mutable_hidden_states()->clear_raw_data();
  hand_written.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
  for (float v : input) hand_written.mutable_hidden_states()->add_float_data(v);

  v1::AttendResponse from_raw, from_floats;
  ASSERT_TRUE(Attend(raw, &from_raw).ok());
  ASSERT_TRUE(Attend(hand_written, &from_floats).ok());
  EXPECT_TRUE(from_floats.output().raw_data().empty());
  EXPECT_EQ(from_floats.output().float_data_size(), 3 * 768);
  EXPECT_TRUE(BitEqual(Floats(from_floats.output()), Floats(from_raw.output())));
  EXPECT_TRUE(BitEqual(Floats(from_floats.attention_maps()), Floats(from_raw.attention_maps())));
}

TEST_F(AttentionServiceTest, Bf16InputEqualsFp32InputOfTheSameValues) {
  Serve();
  std::vector<float> input = RandomValues(5 * 768, std::random_device{}());
  std::string bf16(input.size() * 2, '\0');
  for (size_t i = 0; i < input.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &input[i], 4);
    const uint16_t upper = static_cast<uint16_t>(bits >> 16);  // truncation: exact in both forms
    std::memcpy(&bf16[2 * i], &upper, 2);
    bits = static_cast<uint32_t>(upper) << 16;
    std::memcpy(&input[i], &bits, 4);
  }
  v1::AttendRequest as_bf16 = RawRequest(1, 5, input);
  as_bf16.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_BF16);
  as_bf16.mutable_hidden_states()->set_raw_data(bf16);
  v1::AttendResponse a, b;
  ASSERT_TRUE(Attend(as_bf16, &a).ok());
  ASSERT_TRUE(Attend(RawRequest(1, 5, input), &b).ok());
  EXPECT_TRUE(BitEqual(Floats(a.output()), Floats(b.output())));
}

struct BadRequest {
  std::string name;
  std::function<void(v1::AttendRequest&)> corrupt;
  grpc::StatusCode code;
  std::string field;  // the message must name it
};

TEST_F(AttentionServiceTest, EveryBadInputGetsItsCodeAndTheNextRequestSucceeds) {
  Serve();
  const std::vector<float> good_values = RandomValues(2 * 4 * 768, 3);
  auto set_shape = [](v1::AttendRequest& r, std::vector<int64_t> shape) {
    r.mutable_hidden_states()->clear_shape();
    for (int64_t d : shape) r.mutable_hidden_states()->add_shape(d);
  };
  const int64_t big = int64_t{1} << 40;
  const std::vector<BadRequest> cases = {
      {"no model", [](auto& r) { r.clear_model(); }, grpc::StatusCode::INVALID_ARGUMENT, "model"},
      {"unknown model", [](auto& r) { r.set_model("bert-large"); }, grpc::StatusCode::NOT_FOUND,
       "model: no model named 'bert-large'"},
      {"no hidden states", [](auto& r) { r.clear_hidden_states(); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states"},
      {"rank 2", [&](auto& r) { set_shape(r, {8, 768}); }, grpc::StatusCode::INVALID_ARGUMENT,
       "hidden_states.shape: expected rank 3"},
      {"rank 4", [&](auto& r) { set_shape(r, {1, 2, 4, 768}); }, grpc::StatusCode::INVALID_ARGUMENT,
       "hidden_states.shape: expected rank 3"},
      {"zero seq", [&](auto& r) { set_shape(r, {2, 0, 768}); }, grpc::StatusCode::INVALID_ARGUMENT,
       "hidden_states.shape[1] (seq)"},
      {"negative batch", [&](auto& r) { set_shape(r, {-2, 4, 768}); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape[0] (batch)"},
      {"d_model mismatch", [&](auto& r) { set_shape(r, {2, 6, 512}); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape[2] (d_model)"},
      {"byte count", [](auto& r) { r.mutable_hidden_states()->mutable_raw_data()->pop_back(); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.raw_data"},
      {"byte count for bf16",
       [](auto& r) { r.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_BF16); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.raw_data"},
      {"no values", [](auto& r) { r.mutable_hidden_states()->clear_raw_data(); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states"},
      {"float count",
       [](auto& r) {
         r.mutable_hidden_states()->clear_raw_data();
         r.mutable_hidden_states()->add_float_data(1.0f);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.float_data"},
      {"raw and float",
       [](auto& r) { r.mutable_hidden_states()->add_float_data(1.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states"},
      {"bf16 float_data",
       [](auto& r) {
         r.mutable_hidden_states()->clear_raw_data();
         r.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_BF16);
         r.mutable_hidden_states()->add_float_data(1.0f);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.dtype"},
      {"no dtype", [](auto& r) { r.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.dtype"},
      {"unknown dtype",
       [](auto& r) { r.mutable_hidden_states()->set_dtype(static_cast<v1::DataType>(7)); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.dtype"},
      {"product overflows", [&](auto& r) { set_shape(r, {big, big, 768}); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"},
      {"bytes overflow",
       [&](auto& r) { set_shape(r, {std::numeric_limits<int64_t>::max() / 768, 1, 768}); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"},
      {"unknown map mode",
       [](auto& r) { r.mutable_attention_maps()->set_mode(static_cast<v1::AttentionMapMode>(9)); },
       grpc::StatusCode::INVALID_ARGUMENT, "attention_maps.mode"},
      {"batch over limit",
       [&](auto& r) {
         set_shape(r, {8, 1, 768});  // same number of values: 8 x 1 x 768
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "hidden_states.shape[0] (batch)"},
      {"seq over limit",
       [&](auto& r) {
         std::vector<float> values = RandomValues(65 * 768, 4);
         set_shape(r, {1, 65, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "hidden_states.shape[1] (seq)"},
      {"map bytes over limit",
       [&](auto& r) {
         // 4 x 12 x 64 x 64 x 4 bytes = 768 KiB of maps > 256 KiB.
         std::vector<float> values = RandomValues(4 * 64 * 768, 5);
         set_shape(r, {4, 64, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "attention_maps"},
      {"response over send limit",
       [&](auto& r) {
         // 768 KiB of output + 64 KiB of mean maps (under 256 KiB) > 800 KiB.
         std::vector<float> values = RandomValues(4 * 64 * 768, 6);
         set_shape(r, {4, 64, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_MEAN);
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "response"},
  };
  const v1::AttendRequest good = RawRequest(2, 4, good_values);
  v1::AttendResponse expected;
  ASSERT_TRUE(Attend(good, &expected).ok());
  for (const BadRequest& c : cases) {
    SCOPED_TRACE(c.name);
    v1::AttendRequest bad = good;
    c.corrupt(bad);
    v1::AttendResponse response;
    grpc::Status status = Attend(bad, &response);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_NE(status.error_message().find(c.field), std::string::npos)
        << "message '" << status.error_message() << "' does not name " << c.field;
    v1::AttendResponse after;
    ASSERT_TRUE(Attend(good, &after).ok());
    EXPECT_EQ(after.output().raw_data(), expected.output().raw_data());
  }
}

}  // namespace
}  // namespace attnserve::server
