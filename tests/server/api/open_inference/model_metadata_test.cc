// ModelMetadataFromInfo: a model's Open Inference Protocol metadata says what
// its attnserve.v1 description says, in the protocol's terms.
#include "server/api/open_inference/model_metadata.h"

#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve::server::open_inference {
namespace {

using ::testing::ElementsAre;

v1::ModelInfo GqaInfo() {
  v1::ModelInfo info;
  info.set_name("llama-layer");
  info.set_causal(true);
  info.set_description("a test model");
  v1::HeadConfig* head = info.mutable_head_config();
  head->set_d_model(64);
  head->set_num_heads(8);
  head->set_num_kv_heads(2);
  head->set_head_dim(8);
  head->set_scale(0.25f);
  head->set_context_dim(48);
  head->mutable_rotary()->set_rotary_dim(8);
  head->mutable_rotary()->set_theta(500000.0f);
  info.mutable_limits()->set_max_batch(64);
  info.mutable_limits()->set_max_seq_len(2048);
  info.mutable_limits()->set_max_attention_map_bytes(1 << 20);
  return info;
}

TEST(ModelMetadata, NamesEveryTensorWithItsDatatypeAndShape) {
  inference::ModelMetadataResponse m;
  ModelMetadataFromInfo(GqaInfo(), &m);
  EXPECT_EQ(m.name(), "llama-layer");
  EXPECT_THAT(m.versions(), ElementsAre("1"));
  EXPECT_EQ(m.platform(), "attnserve_attention");
  std::map<std::string, std::pair<std::string, std::vector<int64_t>>> inputs, outputs;
  for (const auto& t : m.inputs()) {
    inputs[t.name()] = {t.datatype(), {t.shape().begin(), t.shape().end()}};
  }
  for (const auto& t : m.outputs()) {
    outputs[t.name()] = {t.datatype(), {t.shape().begin(), t.shape().end()}};
  }
  using Want = std::map<std::string, std::pair<std::string, std::vector<int64_t>>>;
  EXPECT_EQ(inputs, (Want{{"hidden_states", {"FP32", {-1, -1, 64}}},
                          {"sequence_lengths", {"INT64", {-1}}},
                          {"context", {"FP32", {-1, -1, 48}}},
                          {"context_lengths", {"INT64", {-1}}},
                          {"mask", {"FP32", {-1, -1, -1}}},
                          {"head_mask", {"FP32", {8}}},
                          {"position_offsets", {"INT64", {-1}}},
                          {"attention_map_heads", {"INT64", {-1}}},
                          {"attention_map_rows", {"INT64", {-1}}}}));
  EXPECT_EQ(outputs, (Want{{"output", {"FP32", {-1, -1, 64}}},
                           {"attention_maps", {"FP32", {-1, -1, -1, -1}}},
                           {"head_entropy", {"FP32", {-1, 8}}},
                           {"head_max_weight", {"FP32", {-1, 8}}},
                           {"head_contribution", {"FP32", {-1, 8}}}}));
  EXPECT_EQ(m.inputs(0).name(), "hidden_states");  // the one required input first
  EXPECT_EQ(m.outputs(0).name(), "output");
}

TEST(ModelMetadata, PropertiesCarryTheHeadConfigurationAndLimits) {
  inference::ModelMetadataResponse m;
  ModelMetadataFromInfo(GqaInfo(), &m);
  const auto& p = m.properties();
  EXPECT_EQ(p.at("d_model"), "64");
  EXPECT_EQ(p.at("num_heads"), "8");
  EXPECT_EQ(p.at("num_kv_heads"), "2");
  EXPECT_EQ(p.at("head_dim"), "8");
  EXPECT_EQ(p.at("context_dim"), "48");
  EXPECT_EQ(p.at("scale"), "0.25");
  EXPECT_EQ(p.at("rotary_dim"), "8");
  EXPECT_EQ(p.at("rotary_theta"), "500000");
  EXPECT_EQ(p.at("causal"), "true");
  EXPECT_EQ(p.at("max_batch"), "64");
  EXPECT_EQ(p.at("max_seq_len"), "2048");
  EXPECT_EQ(p.at("max_attention_map_bytes"), "1048576");
  EXPECT_EQ(p.at("input_datatypes"), "FP32,BF16");
  EXPECT_EQ(p.at("description"), "a test model");

  v1::ModelInfo plain = GqaInfo();
  plain.set_causal(false);
  plain.mutable_head_config()->set_context_dim(0);  // unset: d_model
  plain.mutable_head_config()->mutable_rotary()->set_rotary_dim(0);
  inference::ModelMetadataResponse n;
  ModelMetadataFromInfo(plain, &n);
  EXPECT_EQ(n.properties().at("causal"), "false");
  EXPECT_EQ(n.properties().at("context_dim"), "64");
  EXPECT_EQ(n.properties().count("rotary_theta"), 0u);
}

}  // namespace
}  // namespace attnserve::server::open_inference
