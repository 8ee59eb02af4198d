// Each rule is checked once, in core/validation.h: an invalid case sent through
// the gRPC API (the real server on port 0, the generated stub) and the same case
// through the core API (AttentionLayer::Forward, AttentionCore::Run) get the same
// verdict, INVALID_ARGUMENT, and the same rule named: the wire's field path and
// the core's map one to one, and the words after them are the same.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_core.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/bf16.h"
#include "core/validation.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "tests/core/attention_test_util.h"

namespace attnserve::server {
namespace {

constexpr uint64_t kWeightSeed = 3;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The layer (and, without projections, the core) both APIs run: GQA and RoPE,
// so that every rule applies.
constexpr int64_t kDModel = 32, kHeads = 4, kKvHeads = 2, kHeadDim = 8, kRotaryDim = 8;
constexpr int64_t kBatch = 2, kSeq = 4, kKvSeq = 5;  // kKvSeq: projected keys only

core::HeadConfig Config(int64_t rotary_dim) {
  core::HeadConfig config;
  config.d_model = kDModel;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.rotary.rotary_dim = rotary_dim;
  return *core::ResolveHeadConfig(config);
}

// One call, in terms both APIs can carry.
struct Call {
  bool projected = false;
  std::vector<float> hidden;   // [kBatch, kSeq, kDModel] (not projected)
  std::vector<float> q, k, v;  // [kBatch, kHeads, kSeq, kHeadDim], k/v [kBatch, kKvHeads, kKvSeq, kHeadDim]
  bool bf16 = false;           // the wire carries the inputs and the mask as BF16
  core::ExplicitMask::Kind mask_kind = core::ExplicitMask::Kind::kNone;
  std::array<int64_t, 3> mask_shape = {1, kSeq, kSeq};
  std::vector<float> mask;
  std::vector<float> head_mask;
  std::vector<int64_t> position_offsets;
  int64_t rotary_dim = kRotaryDim;  // the layer's (not projected)
  core::MapSelection maps;
};

v1::Tensor WireTensor(const std::vector<int64_t>& shape, const std::vector<float>& values,
                      bool bf16) {
  v1::Tensor t;
  for (int64_t d : shape) t.add_shape(d);
  if (bf16) {
    t.set_dtype(v1::DATA_TYPE_BF16);
    std::vector<core::Bf16> halves(values.size());
    for (size_t i = 0; i < values.size(); ++i) halves[i] = core::FloatToBf16(values[i]);
    t.set_raw_data(halves.data(), halves.size() * sizeof(core::Bf16));
  } else {
    t.set_dtype(v1::DATA_TYPE_FP32);
    t.set_raw_data(values.data(), values.size() * sizeof(float));
  }
  return t;
}

v1::AttendRequest ToWire(const Call& call) {
  v1::AttendRequest r;
  v1::HeadConfig* c = r.mutable_layer()->mutable_head_config();
  c->set_num_heads(kHeads);
  c->set_num_kv_heads(kKvHeads);
  c->set_head_dim(kHeadDim);
  if (call.projected) {
    // d_model 0: the core alone (no weights, no RoPE).
    *r.mutable_projected()->mutable_q() = WireTensor({kBatch, kHeads, kSeq, kHeadDim}, call.q, call.bf16);
    *r.mutable_projected()->mutable_k() = WireTensor({kBatch, kKvHeads, kKvSeq, kHeadDim}, call.k, call.bf16);
    *r.mutable_projected()->mutable_v() = WireTensor({kBatch, kKvHeads, kKvSeq, kHeadDim}, call.v, call.bf16);
  } else {
    c->set_d_model(kDModel);
    c->mutable_rotary()->set_rotary_dim(call.rotary_dim);
    r.mutable_layer()->set_seed(kWeightSeed);
    *r.mutable_hidden_states() = WireTensor({kBatch, kSeq, kDModel}, call.hidden, call.bf16);
  }
  if (call.mask_kind != core::ExplicitMask::Kind::kNone) {
    r.mutable_mask()->set_kind(call.mask_kind == core::ExplicitMask::Kind::kAdditive
                                   ? v1::AttentionMask::KIND_ADDITIVE
                                   : v1::AttentionMask::KIND_ALLOWED);
    *r.mutable_mask()->mutable_values() = WireTensor(
        {call.mask_shape[0], call.mask_shape[1], call.mask_shape[2]}, call.mask, call.bf16);
  }
  for (float gate : call.head_mask) r.add_head_mask(gate);
  for (int64_t offset : call.position_offsets) r.add_position_offsets(offset);
  v1::AttentionMapRequest* maps = r.mutable_attention_maps();
  switch (call.maps.mode) {
    case core::AttentionMapMode::kNone:
      maps->set_mode(v1::ATTENTION_MAP_MODE_NONE);
      break;
    case core::AttentionMapMode::kPerHead:
      maps->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
      break;
    case core::AttentionMapMode::kMeanOverHeads:
      maps->set_mode(v1::ATTENTION_MAP_MODE_MEAN);
      break;
  }
  for (int64_t h : call.maps.heads) maps->add_heads(static_cast<int32_t>(h));
  for (int64_t row : call.maps.query_rows) maps->add_query_rows(static_cast<int32_t>(row));
  return r;
}

// The values as the server reads them: BF16 on the wire is what core gets.
std::vector<float> AsSent(const std::vector<float>& values, bool bf16) {
  if (!bf16) return values;
  std::vector<float> sent(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    sent[i] = core::Bfloat16ToFloat(core::FloatToBf16(values[i]));
  }
  return sent;
}

absl::Status RunCore(const Call& call) {
  const core::HeadConfig config = Config(call.rotary_dim);
  const std::vector<float> mask_values = AsSent(call.mask, call.bf16);
  core::ExplicitMask mask;
  mask.kind = call.mask_kind;
  mask.values = mask_values;
  mask.batch_dim = call.mask_shape[0];
  mask.q_dim = call.mask_shape[1];
  mask.kv_dim = call.mask_shape[2];
  core::ForwardOptions options;
  options.maps = call.maps;
  core::ForwardOutputs outputs;
  const core::SequenceLayout queries = *core::SequenceLayout::Padded(kBatch, kSeq, {});
  const core::SequenceLayout keys =
      *core::SequenceLayout::Padded(kBatch, call.projected ? kKvSeq : kSeq, {});
  std::vector<float> maps(
      static_cast<size_t>(core::AttentionMapElements(config, queries, keys, call.maps).value_or(0)));
  outputs.attention_maps = absl::MakeSpan(maps);
  if (call.projected) {
    const std::vector<float> q = AsSent(call.q, call.bf16), k = AsSent(call.k, call.bf16),
                             v = AsSent(call.v, call.bf16);
    std::vector<float> output(q.size());
    outputs.output = absl::MakeSpan(output);
    core::CoreInputs inputs;
    inputs.q = q;
    inputs.k = k;
    inputs.v = v;
    inputs.batch = kBatch;
    inputs.q_len = kSeq;
    inputs.kv_len = kKvSeq;
    inputs.mask = mask;
    inputs.head_mask = call.head_mask;
    auto core = core::AttentionCore::Create(config);
    if (!core.ok()) return core.status();
    return (*core)->Run(inputs, options, outputs).status();
  }
  const std::vector<float> hidden = AsSent(call.hidden, call.bf16);
  std::vector<float> output(hidden.size());
  outputs.output = absl::MakeSpan(output);
  core::LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = queries;
  inputs.mask = mask;
  inputs.head_mask = call.head_mask;
  inputs.position_offsets = call.position_offsets;
  auto layer = core::AttentionLayer::Create(config, core::SeededWeights(config, kWeightSeed));
  if (!layer.ok()) return layer.status();
  return (*layer)->Forward(inputs, options, outputs).status();
}

struct Case {
  std::string name;
  std::function<void(Call&)> make_invalid;
  std::string core_field;  // where core's message names the rule
  std::string wire_field;  // where the server's does
};

class ValidationAgreementTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.builtin_model_seed = 7;
    options.lame_duck_seconds = 0;
    options.drain_timeout_seconds = 5;
    auto server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->LoadModelsAndServe().ok());
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));

    const uint64_t seed = testing::FreshSeed();
    seed_trace_ = testing::SeedTrace(seed);
    std::mt19937_64 rng(seed);
    layer_call_.hidden = testing::RandomNormal(kBatch * kSeq * kDModel, rng);
    projected_call_.projected = true;
    projected_call_.q = testing::RandomNormal(kBatch * kHeads * kSeq * kHeadDim, rng);
    projected_call_.k = testing::RandomNormal(kBatch * kKvHeads * kKvSeq * kHeadDim, rng);
    projected_call_.v = testing::RandomNormal(kBatch * kKvHeads * kKvSeq * kHeadDim, rng);
  }

  grpc::Status Attend(const Call& call) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::AttendResponse response;
    return stub_->Attend(&context, ToWire(call), &response);
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::string seed_trace_;
  Call layer_call_, projected_call_;  // valid
};

TEST_F(ValidationAgreementTest, EveryInvalidCaseGetsTheSameVerdictAndRuleFromTheWireAndTheCore) {
  SCOPED_TRACE(seed_trace_);
  // The valid calls run on both: each case below is invalid by its one change.
  for (const Call* call : {&layer_call_, &projected_call_}) {
    EXPECT_TRUE(RunCore(*call).ok()) << RunCore(*call);
    const grpc::Status wire = Attend(*call);
    EXPECT_TRUE(wire.ok()) << wire.error_message();
  }

  const auto additive = [](Call& c, std::array<int64_t, 3> shape) {
    c.mask_kind = core::ExplicitMask::Kind::kAdditive;
    c.mask_shape = shape;
    c.mask.assign(static_cast<size_t>(shape[0] * shape[1] * shape[2]), 0.0f);
  };
  const Case cases[] = {
      {"mask value NaN",
       [&](Call& c) {
         additive(c, {1, kSeq, kSeq});
         c.mask[5] = kNaN;
       },
       "mask.values[5]", "mask.values[5]"},
      {"+inf in an additive mask",
       [&](Call& c) {
         additive(c, {kBatch, kSeq, kSeq});
         c.mask[21] = kInf;
       },
       "mask.values[21]", "mask.values[21]"},
      {"+inf in an additive mask sent as BF16",
       [&](Call& c) {
         c.bf16 = true;
         additive(c, {kBatch, 1, kSeq});
         c.mask[6] = kInf;
       },
       "mask.values[6]", "mask.values[6]"},
      {"NaN in an allowed mask",
       [&](Call& c) {
         additive(c, {1, 1, kSeq});
         c.mask_kind = core::ExplicitMask::Kind::kAllowed;
         c.mask[2] = kNaN;
       },
       "mask.values[2]", "mask.values[2]"},
      {"mask dim neither 1 nor full",
       [&](Call& c) { additive(c, {1, kSeq - 1, kSeq}); },
       "mask.q_dim", "mask.values.shape[1] (seq_q)"},
      {"mask batch dim neither 1 nor full", [&](Call& c) { additive(c, {3, kSeq, kSeq}); },
       "mask.batch_dim", "mask.values.shape[0] (batch)"},
      {"head_mask negative",
       [](Call& c) { c.head_mask = {1.0f, 1.0f, 1.0f, -0.5f}; }, "head_mask[3]", "head_mask[3]"},
      {"head_mask NaN", [](Call& c) { c.head_mask = {1.0f, kNaN, 1.0f, 1.0f}; }, "head_mask[1]",
       "head_mask[1]"},
      {"head_mask wrong count", [](Call& c) { c.head_mask = {1.0f, 1.0f, 1.0f}; }, "head_mask",
       "head_mask"},
      {"position offset -1", [](Call& c) { c.position_offsets = {-1, 0}; }, "position_offsets[0]",
       "position_offsets[0]"},
      {"position offset 2^30 + 1",
       [](Call& c) { c.position_offsets = {0, core::kMaxPositionOffset + 1}; },
       "position_offsets[1]", "position_offsets[1]"},
      {"position offsets for a layer without RoPE",
       [](Call& c) {
         c.rotary_dim = 0;
         c.position_offsets = {0, 0};
       },
       "position_offsets", "position_offsets"},
      {"map head out of range",
       [](Call& c) {
         c.maps.mode = core::AttentionMapMode::kPerHead;
         c.maps.heads = {0, kHeads};
       },
       "maps.heads[1]", "attention_maps.heads[1]"},
      {"too many map heads",
       [](Call& c) {
         c.maps.mode = core::AttentionMapMode::kPerHead;
         c.maps.heads = {0, 1, 2, 3, 0};
       },
       "maps.heads", "attention_maps.heads"},
      {"map heads with mean maps",
       [](Call& c) {
         c.maps.mode = core::AttentionMapMode::kMeanOverHeads;
         c.maps.heads = {0};
       },
       "maps.heads", "attention_maps.heads"},
      {"query row out of range",
       [](Call& c) {
         c.maps.mode = core::AttentionMapMode::kMeanOverHeads;
         c.maps.query_rows = {1, kSeq};
       },
       "maps.query_rows[1]", "attention_maps.query_rows[1]"},
      // Blocked path with maps: the wire cannot express it (an AttendRequest
      // names no attention path; the server lets the core choose, and maps
      // make it materialized), so only core checks ForwardOptions.attention_path.
      {"non-finite hidden state",
       [](Call& c) { c.hidden[(1 * kSeq + 2) * kDModel + 7] = kNaN; }, "hidden_states",
       "hidden_states"},
      {"non-finite hidden state sent as BF16",
       [](Call& c) {
         c.bf16 = true;
         c.hidden[(0 * kSeq + 3) * kDModel] = -kInf;
       },
       "hidden_states", "hidden_states"},
      {"non-finite projected q",
       [](Call& c) { c.q[((1 * kHeads + 2) * kSeq + 1) * kHeadDim + 3] = kInf; }, "q",
       "projected.q"},
      {"non-finite projected v sent as BF16",
       [](Call& c) {
         c.bf16 = true;
         c.v[((0 * kKvHeads + 1) * kKvSeq + 4) * kHeadDim] = kNaN;
       },
       "v", "projected.v"},
      {"mask on projected heads: kv dim neither 1 nor full",
       [&](Call& c) { additive(c, {1, kSeq, kKvSeq - 1}); }, "mask.kv_dim",
       "mask.values.shape[2] (seq_kv)"},
  };

  for (const Case& test : cases) {
    const bool on_projected = absl::StrContains(test.name, "projected");
    Call call = on_projected ? projected_call_ : layer_call_;
    test.make_invalid(call);
    SCOPED_TRACE(test.name);
    const absl::Status core = RunCore(call);
    const grpc::Status wire = Attend(call);
    ASSERT_EQ(core.code(), absl::StatusCode::kInvalidArgument) << core;
    ASSERT_EQ(wire.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << wire.error_message();
    // "<field>: <what>" from both, each in its own field names, the same <what>.
    const std::string core_prefix = test.core_field + ": ";
    const std::string wire_prefix = test.wire_field + ": ";
    ASSERT_TRUE(absl::StartsWith(core.message(), core_prefix)) << core.message();
    ASSERT_TRUE(absl::StartsWith(wire.error_message(), wire_prefix)) << wire.error_message();
    EXPECT_EQ(core.message().substr(core_prefix.size()),
              wire.error_message().substr(wire_prefix.size()));
  }
}

}  // namespace
}  // namespace attnserve::server
