// The real server on an ephemeral port, called through the generated stubs.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "server/api/attend_plan.h"
#include "server/api/attention_service.h"
#include "server/attn_server.h"
#include "server/models/model_registry.h"
#include "tests/server/api/attend_requests.h"
#include "tests/server/api/blockable_server.h"

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
  // 800 KiB: the output of a [4, 64] request (768 KiB, plus framing) fits,
  // with its mean maps (64 KiB, under the map limit) it does not.
  options.max_send_message_bytes = 800 << 10;
  options.lame_duck_seconds = 0;
  options.drain_timeout_seconds = 5;
  return options;
}

using testing::Floats;
using testing::RandomValues;
using testing::RawRequest;

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
    core::HeadConfig requested;
    requested.d_model = 768;
    requested.num_heads = 12;
    core::HeadConfig config = *core::ResolveHeadConfig(requested);
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
    core::LayerInputs inputs;
    inputs.hidden_states = input;
    inputs.layout = *core::SequenceLayout::Padded(c.batch, c.seq);
    core::ForwardOptions options;
    options.maps.mode = c.core_maps;
    std::vector<float> maps(
        *core::AttentionMapElements(layer->config(), inputs.layout, inputs.layout, options.maps));
    core::ForwardOutputs outputs;
    outputs.output = absl::MakeSpan(output);
    outputs.attention_maps = absl::MakeSpan(maps);
    ASSERT_TRUE(layer->Forward(inputs, options, outputs).ok());
    EXPECT_EQ(response.model(), "default");
    EXPECT_EQ(response.kernel_path(), c.core_maps == core::AttentionMapMode::kNone
                                          ? "fp32/blocked"
                                          : "fp32/materialized");
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

v1::Tensor BoolTensor(std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_BOOL);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  t.set_raw_data(std::string(n, '\1'));
  return t;
}

v1::Tensor FloatTensor(std::vector<int64_t> shape, const std::vector<float>& values) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_raw_data(values.data(), values.size() * sizeof(float));
  return t;
}

// Replaces the model with a seeded ad-hoc layer.
void SetAdHoc(v1::AttendRequest& r, int d_model, int heads, int kv_heads, int head_dim, int rotary_dim) {
  r.clear_model();
  v1::HeadConfig* c = r.mutable_layer()->mutable_head_config();
  c->set_d_model(d_model);
  c->set_num_heads(heads);
  c->set_num_kv_heads(kv_heads);
  c->set_head_dim(head_dim);
  c->mutable_rotary()->set_rotary_dim(rotary_dim);
  r.mutable_layer()->set_seed(3);
}

// Random projected q [b, h, sq, d], k and v [b, kvh, skv(v: skv_v), d].
void SetProjected(v1::AttendRequest& r, int64_t b, int64_t h, int64_t sq, int64_t d, int64_t kvh,
                  int64_t skv_v, int64_t skv = 5) {
  v1::ProjectedHeads* p = r.mutable_projected();
  *p->mutable_q() = FloatTensor({b, h, sq, d}, RandomValues(b * h * sq * d, 11));
  *p->mutable_k() = FloatTensor({b, kvh, skv, d}, RandomValues(b * kvh * skv * d, 12));
  *p->mutable_v() = FloatTensor({b, kvh, skv_v, d}, RandomValues(b * kvh * skv_v * d, 13));
}

struct BadRequest {
  std::string name;
  std::function<void(v1::AttendRequest&)> corrupt;
  grpc::StatusCode code;
  std::string field;  // the message must name it
  std::string flag = "";  // and, for a limit of this server, the flag that sets it
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
      {"huge unknown model name", [](auto& r) { r.set_model(std::string(20000, 'm')); },
       grpc::StatusCode::NOT_FOUND, "model: no model named 'mmm"},
      {"thousands of dimensions",
       [&](auto& r) { set_shape(r, std::vector<int64_t>(5000, 1)); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"},
      {"no hidden states", [](auto& r) { r.clear_hidden_states(); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states"},
      {"rank 1", [&](auto& r) { set_shape(r, {8 * 768}); }, grpc::StatusCode::INVALID_ARGUMENT,
       "hidden_states.shape: expected rank 3"},
      {"packed without lengths", [&](auto& r) { set_shape(r, {8, 768}); },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths: required with packed"},
      {"packed lengths do not sum to tokens",
       [&](auto& r) {
         set_shape(r, {8, 768});
         for (int64_t n : {3, 4}) r.add_sequence_lengths(n);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths"},
      {"padded lengths count", [](auto& r) { r.add_sequence_lengths(2); },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths"},
      {"length beyond the tensor",
       [](auto& r) {
         r.add_sequence_lengths(2);
         r.add_sequence_lengths(5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths"},
      {"length zero",
       [](auto& r) {
         r.add_sequence_lengths(0);
         r.add_sequence_lengths(4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths"},
      {"context d_model",
       [&](auto& r) {
         *r.mutable_context() = r.hidden_states();
         r.mutable_context()->clear_shape();
         for (int64_t d : {2, 6, 512}) r.mutable_context()->add_shape(d);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context.shape[2] (context_dim)"},
      {"context batch",
       [&](auto& r) {
         *r.mutable_context() = r.hidden_states();
         r.mutable_context()->clear_shape();
         for (int64_t d : {1, 8, 768}) r.mutable_context()->add_shape(d);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context"},
      {"context_lengths without context", [](auto& r) { r.add_context_lengths(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "context_lengths"},
      {"mask without kind",
       [&](auto& r) { *r.mutable_mask()->mutable_values() = BoolTensor({2, 4, 4}); },
       grpc::StatusCode::INVALID_ARGUMENT, "mask.kind"},
      {"mask of the wrong shape",
       [&](auto& r) {
         r.mutable_mask()->set_kind(v1::AttentionMask::KIND_ALLOWED);
         *r.mutable_mask()->mutable_values() = BoolTensor({2, 3, 4});
       },
       grpc::StatusCode::INVALID_ARGUMENT, "mask.values.shape[1] (seq_q)"},
      {"mask of the wrong rank",
       [&](auto& r) {
         r.mutable_mask()->set_kind(v1::AttentionMask::KIND_ALLOWED);
         *r.mutable_mask()->mutable_values() = BoolTensor({4, 4});
       },
       grpc::StatusCode::INVALID_ARGUMENT, "mask.values.shape"},
      {"additive mask of booleans",
       [&](auto& r) {
         r.mutable_mask()->set_kind(v1::AttentionMask::KIND_ADDITIVE);
         *r.mutable_mask()->mutable_values() = BoolTensor({1, 4, 4});
       },
       grpc::StatusCode::INVALID_ARGUMENT, "mask.values.dtype"},
      {"head mask length", [](auto& r) { r.add_head_mask(1.0f); }, grpc::StatusCode::INVALID_ARGUMENT,
       "head_mask"},
      {"head mask NaN",
       [](auto& r) {
         for (int h = 0; h < 12; ++h) r.add_head_mask(h == 3 ? NAN : 1.0f);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "head_mask"},
      {"position offsets without RoPE",
       [](auto& r) {
         r.add_position_offsets(0);
         r.add_position_offsets(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "position_offsets"},
      {"unknown precision", [](auto& r) { r.set_precision(static_cast<v1::Precision>(5)); },
       grpc::StatusCode::INVALID_ARGUMENT, "precision"},
      {"bool output", [](auto& r) { r.set_output_dtype(v1::DATA_TYPE_BOOL); },
       grpc::StatusCode::INVALID_ARGUMENT, "output_dtype"},
      {"heads with mean maps",
       [](auto& r) {
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_MEAN);
         r.mutable_attention_maps()->add_heads(0);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "attention_maps.heads"},
      {"head out of range",
       [](auto& r) {
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
         r.mutable_attention_maps()->add_heads(12);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "attention_maps.heads"},
      {"query row out of range",
       [](auto& r) {
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
         r.mutable_attention_maps()->add_query_rows(4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "attention_maps.query_rows"},
      {"model and layer", [](auto& r) { r.mutable_layer()->set_seed(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "model: set model or layer"},
      {"layer without head config",
       [](auto& r) {
         r.clear_model();
         r.mutable_layer()->set_seed(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.head_config"},
      {"heads not dividing d_model",
       [](auto& r) { SetAdHoc(r, 768, 5, 0, 0, 0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "layer.head_config.num_heads"},
      {"kv heads not dividing heads",
       [](auto& r) { SetAdHoc(r, 768, 12, 5, 0, 0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "layer.head_config.num_kv_heads"},
      {"self-attention on a layer with a context width",
       [](auto& r) {
         SetAdHoc(r, 768, 12, 0, 0, 0);
         r.mutable_layer()->mutable_head_config()->set_context_dim(24);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context: required"},
      {"rotary dim odd", [](auto& r) { SetAdHoc(r, 768, 12, 0, 0, 7); },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.head_config.rotary"},
      {"rotary dim too large", [](auto& r) { SetAdHoc(r, 768, 12, 0, 0, 66); },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.head_config.rotary"},
      {"layer without weights",
       [](auto& r) {
         SetAdHoc(r, 768, 12, 0, 0, 0);
         r.mutable_layer()->clear_seed();
       },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.weights"},
      {"inline weight of the wrong shape",
       [](auto& r) {
         SetAdHoc(r, 768, 12, 0, 0, 0);
         v1::LayerWeights* w = r.mutable_layer()->mutable_inline_weights();
         for (v1::Tensor* t : {w->mutable_w_q(), w->mutable_b_q(), w->mutable_w_k(), w->mutable_b_k(),
                               w->mutable_w_v(), w->mutable_b_v(), w->mutable_w_o(), w->mutable_b_o()}) {
           t->add_shape(1);
           t->add_float_data(0.0f);
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.inline_weights.w_q"},
      {"ad-hoc layer whose scratch is over the limit",
       [](auto& r) {
         // 1024 heads of 4096 dims over a 1-wide model: small weights (50 MB
         // as FP32), but about 80 MiB of scratch per token: 64 tokens would
         // need 5 GiB, over the default 2 GiB.
         SetAdHoc(r, 1, 1024, 1, 4096, 0);
         r.mutable_hidden_states()->clear_shape();
         for (int64_t d : {1, 64, 1}) r.mutable_hidden_states()->add_shape(d);
         r.mutable_hidden_states()->set_raw_data(std::string(64 * 4, '\0'));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "request: needs about", "--max_scratch_bytes"},
      {"packed lengths beyond the tokens are invalid, not over a limit",
       [&](auto& r) {
         set_shape(r, {8, 768});
         for (int64_t n : {8, 99}) r.add_sequence_lengths(n);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths"},
      {"projected core without head_dim or d_model",
       [&](auto& r) {
         r.clear_hidden_states();
         SetAdHoc(r, 0, 4, 2, 0, 0);
         r.mutable_layer()->clear_seed();
         SetProjected(r, 2, 4, 5, 8, 2, 5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.head_config.head_dim"},
      {"NaN in a real token",
       [](auto& r) {
         float nan = NAN;
         std::memcpy(&(*r.mutable_hidden_states()->mutable_raw_data())[4 * 770], &nan, 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states: sequence 0 holds nan at position 1"},
      {"seeded layer over the weight limit",
       [](auto& r) { SetAdHoc(r, 8192, 64, 0, 0, 0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "layer (weight bytes as FP32)", "--max_adhoc_weight_bytes"},
      {"hidden states and projected heads",
       [](auto& r) { r.mutable_projected()->mutable_q()->add_shape(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states: set hidden_states or projected"},
      {"projected q of the wrong head count",
       [&](auto& r) {
         r.clear_hidden_states();
         SetProjected(r, 2, 6, 5, 64, 12, 5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "projected.q.shape[1] (num_heads)"},
      {"projected v unlike k",
       [&](auto& r) {
         r.clear_hidden_states();
         SetProjected(r, 2, 12, 5, 64, 12, 6);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "projected.v.shape[2] (seq_kv)"},
      {"projected with position offsets",
       [&](auto& r) {
         r.clear_hidden_states();
         SetProjected(r, 2, 12, 5, 64, 12, 5);
         r.add_position_offsets(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "position_offsets"},
      {"projected with context",
       [&](auto& r) {
         *r.mutable_context() = r.hidden_states();
         r.clear_hidden_states();
         SetProjected(r, 2, 12, 5, 64, 12, 5);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context"},
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
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape[0] (batch)", "--max_batch"},
      {"seq over limit",
       [&](auto& r) {
         std::vector<float> values = RandomValues(65 * 768, 4);
         set_shape(r, {1, 65, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape[1] (seq)", "--max_seq_len"},
      {"map bytes over limit",
       [&](auto& r) {
         // 4 x 12 x 64 x 64 x 4 bytes = 768 KiB of maps > 256 KiB.
         std::vector<float> values = RandomValues(4 * 64 * 768, 5);
         set_shape(r, {4, 64, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "attention_maps", "--max_attention_map_bytes"},
      {"response over send limit",
       [&](auto& r) {
         // 768 KiB of output + 64 KiB of mean maps (under 256 KiB) > 800 KiB.
         std::vector<float> values = RandomValues(4 * 64 * 768, 6);
         set_shape(r, {4, 64, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
         r.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_MEAN);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "response", "--max_send_message_bytes"},
      {"packed sequences over the batch limit",
       [&](auto& r) {
         set_shape(r, {8, 768});
         for (int i = 0; i < 8; ++i) r.add_sequence_lengths(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths (sequences)", "--max_batch"},
      {"a packed sequence over the length limit",
       [&](auto& r) {
         std::vector<float> values = RandomValues(66 * 768, 7);
         set_shape(r, {66, 768});
         r.mutable_hidden_states()->set_raw_data(values.data(), values.size() * 4);
         for (int64_t n : {1, 65}) r.add_sequence_lengths(n);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "sequence_lengths[1]", "--max_seq_len"},
      {"context over the length limit",
       [&](auto& r) {
         std::vector<float> values = RandomValues(2 * 65 * 768, 8);
         *r.mutable_context() = FloatTensor({2, 65, 768}, values);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "context.shape[1] (seq)", "--max_seq_len"},
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
    if (!c.flag.empty()) {
      EXPECT_NE(status.error_message().find(absl::StrCat("(", c.flag, ")")), std::string::npos)
          << "message '" << status.error_message() << "' does not name " << c.flag;
    }
    // Echoed input is abbreviated: a message never grows with the request.
    EXPECT_LT(status.error_message().size(), 600u);
    v1::AttendResponse after;
    ASSERT_TRUE(Attend(good, &after).ok());
    EXPECT_EQ(after.output().raw_data(), expected.output().raw_data());
  }
}

// The output of the built-in model for `request` ([batch, seq, 768] raw FP32
// hidden states), computed in this process.
std::vector<float> InProcessOutput(const v1::AttendRequest& request) {
  core::HeadConfig requested;
  requested.d_model = 768;
  requested.num_heads = 12;
  const core::HeadConfig config = *core::ResolveHeadConfig(requested);
  auto layer = *core::AttentionLayer::Create(config, core::SeededWeights(config, kSeed));
  const std::vector<float> input = Floats(request.hidden_states());
  std::vector<float> output(input.size());
  core::LayerInputs inputs;
  inputs.hidden_states = input;
  inputs.layout = *core::SequenceLayout::Padded(request.hidden_states().shape(0),
                                                request.hidden_states().shape(1));
  core::ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  EXPECT_TRUE(layer->Forward(inputs, {}, outputs).ok());
  return output;
}

TEST(AttentionServiceQueue, FullQueueAnswersResourceExhaustedAndTheAdmittedCallSucceeds) {
  ServerOptions options = TestOptions();
  options.max_queued_requests = 1;
  options.max_batch_tokens = 0;  // every call alone: the queue holds calls, not batches
  testing::BlockableServer server(options, kSeed);
  const v1::AttendRequest request = RawRequest(2, 16, RandomValues(2 * 16 * 768, std::random_device{}()));
  server.Block();
  // The first call takes the one queue slot and stays there: the executor is busy.
  auto admitted = server.Start(request);
  ASSERT_TRUE(server.WaitForQueueDepth(1));
  // Eight more, from eight threads at once: every one finds the queue full.
  std::vector<grpc::Status> refused(8);
  std::vector<std::thread> clients;
  for (size_t i = 0; i < refused.size(); ++i) {
    clients.emplace_back([&, i] {
      v1::AttendResponse response;
      refused[i] = server.Attend(request, &response);
    });
  }
  for (auto& t : clients) t.join();
  for (const grpc::Status& status : refused) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_NE(status.error_message().find("queue is full"), std::string::npos)
        << status.error_message();
  }
  EXPECT_FALSE(admitted->done.HasBeenNotified());
  server.Release();
  admitted->done.WaitForNotification();
  ASSERT_TRUE(admitted->status.ok()) << admitted->status.error_message();
  EXPECT_TRUE(BitEqual(Floats(admitted->response.output()), InProcessOutput(request)));
  // The slot is free again: the same request is admitted and answered.
  v1::AttendResponse after;
  ASSERT_TRUE(server.Attend(request, &after).ok());
  EXPECT_EQ(after.output().raw_data(), admitted->response.output().raw_data());
}

TEST(AttentionServiceQueue, TakenMemoryBudgetIsResourceExhaustedButOverTheWholeBudgetIsInvalid) {
  const v1::AttendRequest request = RawRequest(1, 32, RandomValues(32 * 768, std::random_device{}()));
  // What the request reserves from the in-flight budget, by the server's own
  // estimate; the budget holds one such request and a half.
  ModelRegistry registry;
  ASSERT_TRUE(registry.Add(*MakeBuiltinModel(kSeed)).ok());
  ServerOptions options = TestOptions();
  options.max_queued_requests = 8;
  options.max_batch_tokens = 0;
  const absl::StatusOr<AttendPlan> plan =
      PlanAttend(request, registry, options.limits, options.max_send_message_bytes,
                 options.block_kernels);
  ASSERT_TRUE(plan.ok()) << plan.status();
  options.max_inflight_bytes = std::max<int64_t>(plan->memory_bytes * 3 / 2, int64_t{1} << 20);
  ASSERT_LT(options.max_inflight_bytes, 2 * plan->memory_bytes)
      << "the request is too small for this test; make it longer";
  testing::BlockableServer server(options, kSeed);
  server.Block();
  auto admitted = server.Start(request);
  ASSERT_TRUE(server.WaitForQueueDepth(1));

  // The same request again fits the budget but not beside the first: load,
  // which passes once the first is done.
  v1::AttendResponse response;
  const grpc::Status busy = server.Attend(request, &response);
  EXPECT_EQ(busy.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << busy.error_message();
  EXPECT_NE(busy.error_message().find("in-flight memory budget is taken"), std::string::npos)
      << busy.error_message();
  // One longer than the whole budget can never be admitted: INVALID_ARGUMENT,
  // naming the flag, whatever is in flight.
  const v1::AttendRequest longer = RawRequest(1, 64, RandomValues(64 * 768, 2));
  const grpc::Status never = server.Attend(longer, &response);
  EXPECT_EQ(never.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << never.error_message();
  EXPECT_NE(never.error_message().find("--max_inflight_bytes"), std::string::npos)
      << never.error_message();

  server.Release();
  admitted->done.WaitForNotification();
  ASSERT_TRUE(admitted->status.ok()) << admitted->status.error_message();
  // The first request's reservation returns to the budget once its batch has
  // run, which may be just after its answer reached us: retry until the budget
  // is back (a minute at most), and only ever for the budget.
  grpc::Status retried = server.Attend(request, &response);
  for (const absl::Time give_up = absl::Now() + absl::Seconds(60);
       !retried.ok() && absl::Now() < give_up; retried = server.Attend(request, &response)) {
    ASSERT_EQ(retried.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << retried.error_message();
    ASSERT_NE(retried.error_message().find("in-flight memory budget is taken"), std::string::npos)
        << retried.error_message();
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(retried.ok()) << retried.error_message();
  EXPECT_TRUE(BitEqual(Floats(response.output()), InProcessOutput(request)));
  EXPECT_EQ(server.Attend(longer, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(AttentionServiceQueue, ADrainingServiceRefusesNewCallsWithUnavailable) {
  testing::BlockableServer server(TestOptions(), kSeed);
  const v1::AttendRequest request = RawRequest(1, 2, RandomValues(2 * 768, 1));
  v1::AttendResponse response;
  ASSERT_TRUE(server.Attend(request, &response).ok());
  server.service().set_state(AttentionServiceImpl::State::kDraining);
  const grpc::Status status = server.Attend(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(status.error_message().find("shutting down"), std::string::npos)
      << status.error_message();
}

// ModelInfer checks in Attend's order -- authentication, parsing, admission,
// the model, then the request's fields -- so the same fault gets the same
// code on both APIs: an unknown model with a bad tensor is NOT_FOUND (not
// INVALID_ARGUMENT), and an unknown model while draining is UNAVAILABLE (not
// NOT_FOUND).
TEST(AttentionServiceQueue, ModelInferChecksInAttendsOrder) {
  testing::BlockableServer server(TestOptions(), kSeed);
  v1::AttendRequest attend = RawRequest(1, 2, RandomValues(2 * 768, 2));
  attend.set_model("no-such-model");
  attend.mutable_hidden_states()->add_shape(5);  // a bad tensor: rank 4
  inference::ModelInferRequest infer;
  infer.set_model_name("no-such-model");
  auto* input = infer.add_inputs();
  input->set_name("hidden_states");
  input->set_datatype("FP64");  // a bad tensor
  for (int64_t d : {1, 2, 768}) input->add_shape(d);
  infer.add_raw_input_contents(std::string(2 * 768 * 8, '\0'));
  auto model_infer = [&](grpc::Status* status) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    inference::ModelInferResponse response;
    *status = server.oip_stub().ModelInfer(&context, infer, &response);
  };
  v1::AttendResponse response;
  grpc::Status attended = server.Attend(attend, &response);
  EXPECT_EQ(attended.error_code(), grpc::StatusCode::NOT_FOUND) << attended.error_message();
  grpc::Status inferred;
  model_infer(&inferred);
  EXPECT_EQ(inferred.error_code(), grpc::StatusCode::NOT_FOUND) << inferred.error_message();
  EXPECT_NE(inferred.error_message().find("model_name: "), std::string::npos)
      << inferred.error_message();
  // A known model: the bad tensor is named.
  infer.set_model_name(std::string(server::kBuiltinModelName));
  model_infer(&inferred);
  EXPECT_EQ(inferred.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << inferred.error_message();
  EXPECT_NE(inferred.error_message().find("inputs[0] (hidden_states).datatype"), std::string::npos)
      << inferred.error_message();

  server.service().set_state(AttentionServiceImpl::State::kDraining);
  infer.set_model_name("no-such-model");
  attended = server.Attend(attend, &response);
  EXPECT_EQ(attended.error_code(), grpc::StatusCode::UNAVAILABLE) << attended.error_message();
  model_infer(&inferred);
  EXPECT_EQ(inferred.error_code(), grpc::StatusCode::UNAVAILABLE) << inferred.error_message();
  EXPECT_NE(inferred.error_message().find("shutting down"), std::string::npos)
      << inferred.error_message();
}

TEST(AttentionServiceShutdown, HealthSaysNotServingAndNewCallsAreRefusedWhileACallInFlightFinishes) {
  ServerOptions options = TestOptions();
  options.lame_duck_seconds = 0;
  options.drain_timeout_seconds = 120;
  // A call held in flight by the queue delay (it waits for batch-mates that
  // never come) keeps the server draining -- listening, NOT_SERVING, refusing
  // new calls -- for up to 10 s after it was queued: the checks below need
  // milliseconds of that.
  options.max_batch_tokens = 1 << 20;
  options.max_queue_delay_us = 10 * 1000 * 1000;
  auto server = AttnServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->LoadModelsAndServe().ok());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);

  const v1::AttendRequest held = RawRequest(1, 4, RandomValues(4 * 768, std::random_device{}()));
  grpc::ClientContext held_context;
  held_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::AttendResponse held_response;
  grpc::Status held_status;
  absl::Notification held_done;
  stub->async()->Attend(&held_context, &held, &held_response, [&](grpc::Status s) {
    held_status = std::move(s);
    held_done.Notify();
  });
  ASSERT_TRUE(testing::WaitForSample([&] { return (*server)->MetricsText(); },
                                     "attnserve_queue_depth", 1))
      << "the held call was never queued";

  std::thread stopper([&] { (*server)->Shutdown(); });
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (true) {
    grpc::ClientContext context;
    HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok());
    if (response.status() == HealthCheckResponse::NOT_SERVING) break;
    ASSERT_LT(absl::Now(), give_up) << "health never said NOT_SERVING";
    absl::SleepFor(absl::Milliseconds(5));
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::AttendResponse response;
  grpc::Status status = stub->Attend(&context, RawRequest(1, 2, RandomValues(2 * 768, 1)), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(status.error_message().find("shutting down"), std::string::npos)
      << status.error_message();
  EXPECT_FALSE(held_done.HasBeenNotified()) << "the checks took longer than the held call's delay";
  // The call in flight finishes, with its right answer, before the server stops.
  held_done.WaitForNotification();
  ASSERT_TRUE(held_status.ok()) << held_status.error_message();
  EXPECT_TRUE(BitEqual(Floats(held_response.output()), InProcessOutput(held)));
  stopper.join();
}

TEST_F(AttentionServiceTest, PaddingMayHoldAnythingButScoresThatOverflowGiveZeroWeights) {
  Serve();
  // NaN in padding rows is never read.
  std::vector<float> values = RandomValues(2 * 4 * 768, 5);
  for (int64_t i = (4 + 3) * 768; i < 8 * 768; ++i) values[i] = NAN;  // sequence 1, row 3
  v1::AttendRequest request = RawRequest(2, 4, values);
  for (int64_t n : {4, 3}) request.add_sequence_lengths(n);
  v1::AttendResponse response;
  grpc::Status status = Attend(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (float v : Floats(response.output())) ASSERT_TRUE(std::isfinite(v));

  // Finite inputs whose scores overflow: q . k = -1e32, plus an additive mask
  // of -FLT_MAX, is -inf for every key. The row gets weights 0, not NaN.
  v1::AttendRequest overflow;
  v1::HeadConfig* c = overflow.mutable_layer()->mutable_head_config();
  c->set_num_heads(1);
  c->set_head_dim(1);
  v1::ProjectedHeads* p = overflow.mutable_projected();
  *p->mutable_q() = FloatTensor({1, 1, 1, 1}, {1.0f});
  *p->mutable_k() = FloatTensor({1, 1, 3, 1}, {-1e32f, -1e32f, -1e32f});
  *p->mutable_v() = FloatTensor({1, 1, 3, 1}, {1.0f, 2.0f, 3.0f});
  overflow.mutable_mask()->set_kind(v1::AttentionMask::KIND_ADDITIVE);
  *overflow.mutable_mask()->mutable_values() =
      FloatTensor({1, 1, 3}, std::vector<float>(3, -std::numeric_limits<float>::max()));
  overflow.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
  status = Attend(overflow, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Floats(response.output()), std::vector<float>({0.0f}));
  EXPECT_EQ(Floats(response.attention_maps()), std::vector<float>(3, 0.0f));
}

// The wire form of every attention option reaches the core as the in-process
// call below (bit for bit). The core's math is proven against the reference in
// tests/core and against PyTorch in tests/parity.
class AttentionOptionsTest : public AttentionServiceTest {
 protected:
  struct Expected {
    std::vector<float> output, maps, entropy, max_weight, contribution;
  };

  // Runs `layer` in process like the server should for these inputs.
  static Expected RunLayer(core::AttentionLayer& layer, const core::LayerInputs& inputs,
                           const core::ForwardOptions& options, bool stats) {
    Expected e;
    const int64_t rows = inputs.layout.rows();
    e.output.resize(rows * layer.config().d_model);
    const core::SequenceLayout& keys = inputs.context_layout ? *inputs.context_layout : inputs.layout;
    e.maps.resize(*core::AttentionMapElements(layer.config(), inputs.layout, keys, options.maps));
    core::ForwardOutputs out;
    out.output = absl::MakeSpan(e.output);
    out.attention_maps = absl::MakeSpan(e.maps);
    if (stats) {
      for (auto* v : {&e.entropy, &e.max_weight, &e.contribution}) {
        v->resize(inputs.layout.batch() * layer.config().num_heads);
      }
      out.head_entropy = absl::MakeSpan(e.entropy);
      out.head_max_weight = absl::MakeSpan(e.max_weight);
      out.head_contribution = absl::MakeSpan(e.contribution);
    }
    absl::StatusOr<core::ForwardInfo> info = layer.Forward(inputs, options, out);
    EXPECT_TRUE(info.ok()) << info.status();
    return e;
  }
};

TEST_F(AttentionOptionsTest, PackedCausalMaskedHeadGatedRequestEqualsTheCore) {
  Serve();
  const std::vector<int64_t> lengths = {3, 6, 1};
  const std::vector<float> input = RandomValues(10 * 768, std::random_device{}());
  v1::AttendRequest request;
  request.set_model("default");
  *request.mutable_hidden_states() = FloatTensor({10, 768}, input);
  for (int64_t n : lengths) request.add_sequence_lengths(n);
  request.set_causal(true);
  // Allowed mask [1, 1, 6]: key 4 is hidden from every query.
  v1::Tensor mask = BoolTensor({1, 1, 6});
  (*mask.mutable_raw_data())[4] = 0;
  request.mutable_mask()->set_kind(v1::AttentionMask::KIND_ALLOWED);
  *request.mutable_mask()->mutable_values() = mask;
  std::vector<float> head_mask(12, 1.0f);
  head_mask[2] = 0.0f;
  head_mask[7] = 0.5f;
  for (float g : head_mask) request.add_head_mask(g);
  request.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
  for (int h : {7, 2, 0}) request.mutable_attention_maps()->add_heads(h);
  for (int row : {5, 0}) request.mutable_attention_maps()->add_query_rows(row);
  request.mutable_attention_maps()->set_head_statistics(true);

  v1::AttendResponse response;
  grpc::Status status = Attend(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  auto layer = InProcessLayer();
  core::LayerInputs inputs;
  inputs.hidden_states = input;
  inputs.layout = *core::SequenceLayout::Packed(lengths);
  inputs.causal = true;
  const std::vector<float> mask_values = {1, 1, 1, 1, 0, 1};
  inputs.mask = {.kind = core::ExplicitMask::Kind::kAllowed, .values = mask_values,
                 .batch_dim = 1, .q_dim = 1, .kv_dim = 6};
  inputs.head_mask = head_mask;
  core::ForwardOptions options;
  options.maps = {.mode = core::AttentionMapMode::kPerHead, .heads = {7, 2, 0}, .query_rows = {5, 0}};
  options.head_statistics = true;
  const Expected e = RunLayer(*layer, inputs, options, /*stats=*/true);

  EXPECT_EQ(std::vector<int64_t>(response.output().shape().begin(), response.output().shape().end()),
            (std::vector<int64_t>{10, 768}));
  EXPECT_EQ(std::vector<int64_t>(response.attention_maps().shape().begin(),
                                 response.attention_maps().shape().end()),
            (std::vector<int64_t>{3, 3, 2, 6}));
  EXPECT_TRUE(BitEqual(Floats(response.output()), e.output));
  EXPECT_TRUE(BitEqual(Floats(response.attention_maps()), e.maps));
  EXPECT_TRUE(BitEqual(Floats(response.head_statistics().entropy()), e.entropy));
  EXPECT_TRUE(BitEqual(Floats(response.head_statistics().max_weight()), e.max_weight));
  EXPECT_TRUE(BitEqual(Floats(response.head_statistics().contribution()), e.contribution));
  EXPECT_EQ(response.precision(), v1::PRECISION_FP32);
}

TEST_F(AttentionOptionsTest, CrossAttentionWithPaddingAndBf16OutputEqualsTheCore) {
  Serve();
  const uint32_t seed = std::random_device{}();
  const std::vector<float> queries = RandomValues(2 * 3 * 768, seed);
  const std::vector<float> context = RandomValues(2 * 5 * 768, seed + 1);
  v1::AttendRequest request;
  request.set_model("default");
  *request.mutable_hidden_states() = FloatTensor({2, 3, 768}, queries);
  for (int64_t n : {3, 2}) request.add_sequence_lengths(n);
  *request.mutable_context() = FloatTensor({2, 5, 768}, context);
  for (int64_t n : {5, 4}) request.add_context_lengths(n);
  request.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_MEAN);
  request.set_output_dtype(v1::DATA_TYPE_BF16);

  v1::AttendResponse response;
  grpc::Status status = Attend(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  auto layer = InProcessLayer();
  core::LayerInputs inputs;
  inputs.hidden_states = queries;
  inputs.layout = *core::SequenceLayout::Padded(2, 3, {3, 2});
  inputs.context = context;
  inputs.context_layout = *core::SequenceLayout::Padded(2, 5, {5, 4});
  core::ForwardOptions options;
  options.maps.mode = core::AttentionMapMode::kMeanOverHeads;
  const Expected e = RunLayer(*layer, inputs, options, /*stats=*/false);

  // BF16 on the wire: each value is the FP32 result rounded to nearest even.
  auto bf16 = [](const v1::Tensor& t) {
    std::vector<float> values(t.raw_data().size() / 2);
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t half;
      std::memcpy(&half, &t.raw_data()[2 * i], 2);
      const uint32_t bits = static_cast<uint32_t>(half) << 16;
      std::memcpy(&values[i], &bits, 4);
    }
    return values;
  };
  auto round_bf16 = [](std::vector<float> values) {
    for (float& v : values) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
      std::memcpy(&v, &bits, 4);
    }
    return values;
  };
  EXPECT_EQ(response.output().dtype(), v1::DATA_TYPE_BF16);
  EXPECT_TRUE(BitEqual(bf16(response.output()), round_bf16(e.output)));
  EXPECT_TRUE(BitEqual(bf16(response.attention_maps()), round_bf16(e.maps)));
  EXPECT_EQ(response.attention_maps().shape_size(), 3);
  EXPECT_EQ(response.attention_maps().shape(2), 5);
}

TEST_F(AttentionOptionsTest, ProjectedHeadsRunTheAttentionCoreAlone) {
  Serve();
  v1::AttendRequest request;
  request.set_model("default");
  SetProjected(request, 2, 12, 4, 64, 12, 6, 6);
  for (int64_t n : {6, 3}) request.add_context_lengths(n);
  request.set_causal(true);
  request.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
  request.mutable_attention_maps()->set_head_statistics(true);

  v1::AttendResponse response;
  grpc::Status status = Attend(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  const std::vector<float> q = RandomValues(2 * 12 * 4 * 64, 11), k = RandomValues(2 * 12 * 6 * 64, 12),
                           v = RandomValues(2 * 12 * 6 * 64, 13);
  auto core = *core::AttentionCore::Create(InProcessLayer()->config());
  core::CoreInputs inputs;
  inputs.q = q;
  inputs.k = k;
  inputs.v = v;
  inputs.batch = 2;
  inputs.q_len = 4;
  inputs.kv_len = 6;
  const std::vector<int64_t> q_lengths = {4, 4}, kv_lengths = {6, 3};
  inputs.q_lengths = q_lengths;
  inputs.kv_lengths = kv_lengths;
  inputs.causal = true;
  core::ForwardOptions options;
  options.maps.mode = core::AttentionMapMode::kPerHead;
  options.head_statistics = true;
  std::vector<float> output(q.size()), maps(2 * 12 * 4 * 6), entropy(24), max_weight(24);
  core::ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  outputs.attention_maps = absl::MakeSpan(maps);
  outputs.head_entropy = absl::MakeSpan(entropy);
  outputs.head_max_weight = absl::MakeSpan(max_weight);
  ASSERT_TRUE(core->Run(inputs, options, outputs).ok());

  EXPECT_EQ(response.output().shape_size(), 4);
  EXPECT_TRUE(BitEqual(Floats(response.output()), output));
  EXPECT_TRUE(BitEqual(Floats(response.attention_maps()), maps));
  EXPECT_TRUE(BitEqual(Floats(response.head_statistics().entropy()), entropy));
  EXPECT_TRUE(BitEqual(Floats(response.head_statistics().max_weight()), max_weight));
  EXPECT_FALSE(response.head_statistics().has_contribution());
}

TEST_F(AttentionOptionsTest, SeededAdHocGroupedRotaryLayerEqualsTheCoreAndInlineWeightsAgree) {
  Serve();
  core::HeadConfig requested;
  requested.d_model = 64;
  requested.num_heads = 8;
  requested.num_kv_heads = 2;
  requested.rotary = {.rotary_dim = 4, .theta = 500.0f};
  const core::HeadConfig config = *core::ResolveHeadConfig(requested);
  const std::vector<float> input = RandomValues(8 * 64, std::random_device{}());
  v1::AttendRequest request;
  v1::HeadConfig* wire = request.mutable_layer()->mutable_head_config();
  wire->set_d_model(64);
  wire->set_num_heads(8);
  wire->set_num_kv_heads(2);
  wire->mutable_rotary()->set_rotary_dim(4);
  wire->mutable_rotary()->set_theta(500.0f);
  request.mutable_layer()->set_seed(99);
  *request.mutable_hidden_states() = FloatTensor({8, 64}, input);
  for (int64_t n : {3, 5}) request.add_sequence_lengths(n);
  for (int64_t p : {7, 0}) request.add_position_offsets(p);
  request.set_causal(true);

  v1::AttendResponse seeded;
  grpc::Status status = Attend(request, &seeded);
  ASSERT_TRUE(status.ok()) << status.error_message();

  const core::AttentionWeights weights = core::SeededWeights(config, 99);
  auto layer = *core::AttentionLayer::Create(config, weights);
  core::LayerInputs inputs;
  inputs.hidden_states = input;
  inputs.layout = *core::SequenceLayout::Packed({3, 5});
  inputs.causal = true;
  const std::vector<int64_t> offsets = {7, 0};
  inputs.position_offsets = offsets;
  const Expected e = RunLayer(*layer, inputs, {}, /*stats=*/false);
  EXPECT_TRUE(BitEqual(Floats(seeded.output()), e.output));
  EXPECT_EQ(seeded.model(), "");

  // The same weights sent inline give the same result.
  v1::LayerWeights* w = request.mutable_layer()->mutable_inline_weights();
  const int64_t q = 8 * 8, kv = 2 * 8;
  *w->mutable_w_q() = FloatTensor({64, q}, weights.w_q);
  *w->mutable_b_q() = FloatTensor({q}, weights.b_q);
  *w->mutable_w_k() = FloatTensor({64, kv}, weights.w_k);
  *w->mutable_b_k() = FloatTensor({kv}, weights.b_k);
  *w->mutable_w_v() = FloatTensor({64, kv}, weights.w_v);
  *w->mutable_b_v() = FloatTensor({kv}, weights.b_v);
  *w->mutable_w_o() = FloatTensor({q, 64}, weights.w_o);
  *w->mutable_b_o() = FloatTensor({64}, weights.b_o);
  v1::AttendResponse inline_response;
  status = Attend(request, &inline_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(BitEqual(Floats(inline_response.output()), e.output));
}

TEST_F(AttentionOptionsTest, Bf16PrecisionRunsWhereSupportedAndSaysWhichRan) {
  Serve();
  const std::vector<float> input = RandomValues(2 * 16 * 768, std::random_device{}());
  v1::AttendRequest request = RawRequest(2, 16, input);
  v1::AttendResponse fp32, bf16;
  ASSERT_TRUE(Attend(request, &fp32).ok());
  request.set_precision(v1::PRECISION_BF16);
  ASSERT_TRUE(Attend(request, &bf16).ok());
  EXPECT_EQ(bf16.precision(), core::Bf16Supported() ? v1::PRECISION_BF16 : v1::PRECISION_FP32);
  EXPECT_EQ(bf16.kernel_path().substr(0, 4), core::Bf16Supported() ? "bf16" : "fp32");
  const std::vector<float> a = Floats(fp32.output()), b = Floats(bf16.output());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * double(a[i] - b[i]);
    norm += a[i] * double(a[i]);
  }
  EXPECT_LE(std::sqrt(diff / norm), 2e-2);
}

}  // namespace
}  // namespace attnserve::server
