// InferResponseFromAttend: the Attend response's tensors -- raw buffers kept
// out of the message, raw_data in it, or float_data -- reach the Open
// Inference Protocol's reply in the named order, raw or typed as the form
// says, with their bytes unchanged.
#include "server/api/open_inference/infer_response.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::server::open_inference {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;

std::vector<float> RandomFloats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

std::string Bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

RawBytes RawOf(const std::string& bytes) {
  RawBytes raw = RawBytes::Uninitialized(bytes.size());
  std::memcpy(raw.data(), bytes.data(), bytes.size());
  return raw;
}

// A computed response: output [1, 2, 3] and per-head maps [1, 2, 2, 2] as
// raw buffers, statistics [1, 2] as raw_data in the message.
struct Computed {
  std::vector<float> output = RandomFloats(6, 1);
  std::vector<float> maps = RandomFloats(8, 2);
  std::vector<float> entropy = RandomFloats(2, 3);
  std::vector<float> max_weight = RandomFloats(2, 4);
  std::vector<float> contribution = RandomFloats(2, 5);
  WireResponse response;

  Computed() {
    v1::AttendResponse& m = response.message;
    m.set_model("default");
    m.set_kernel_path("fp32/materialized");
    m.set_precision(v1::PRECISION_FP32);
    m.mutable_timing()->mutable_queue()->set_nanos(25000);
    m.mutable_timing()->mutable_compute()->set_seconds(1);
    m.mutable_timing()->set_batch_size(1);
    m.mutable_timing()->set_batch_tokens(2);
    Header(m.mutable_output(), {1, 2, 3});
    response.output_raw = RawOf(Bytes(output));
    Header(m.mutable_attention_maps(), {1, 2, 2, 2});
    response.maps_raw = RawOf(Bytes(maps));
    v1::HeadStatistics* stats = m.mutable_head_statistics();
    Header(stats->mutable_entropy(), {1, 2})->set_raw_data(Bytes(entropy));
    Header(stats->mutable_max_weight(), {1, 2})->set_raw_data(Bytes(max_weight));
    Header(stats->mutable_contribution(), {1, 2})->set_raw_data(Bytes(contribution));
  }
  static v1::Tensor* Header(v1::Tensor* t, std::vector<int64_t> shape) {
    t->set_dtype(v1::DATA_TYPE_FP32);
    for (int64_t d : shape) t->add_shape(d);
    return t;
  }
};

InferReplyForm Form(std::vector<std::string> outputs, bool raw) {
  InferReplyForm form;
  form.outputs = std::move(outputs);
  form.raw = raw;
  return form;
}

std::string TypedBytes(const inference::ModelInferResponse::InferOutputTensor& t) {
  const auto& v = t.contents().fp32_contents();
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(InferResponse, RawRepliesCarryEveryNamedOutputsBytesInOrder) {
  Computed c;
  InferReplyForm form{.id = "r1",
                      .outputs = {kHeadMaxWeight, kOutput, kAttentionMaps, kHeadEntropy,
                                  kHeadContribution},
                      .raw = true};
  inference::ModelInferResponse reply;
  ASSERT_THAT(InferResponseFromAttend(form, c.response, &reply), IsOk());
  EXPECT_EQ(reply.model_name(), "default");
  EXPECT_EQ(reply.model_version(), "1");
  EXPECT_EQ(reply.id(), "r1");
  ASSERT_EQ(reply.outputs_size(), 5);
  ASSERT_EQ(reply.raw_output_contents_size(), 5);
  const std::vector<std::string> want = {Bytes(c.max_weight), Bytes(c.output), Bytes(c.maps),
                                         Bytes(c.entropy), Bytes(c.contribution)};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(reply.outputs(i).name(), form.outputs[i]);
    EXPECT_EQ(reply.outputs(i).datatype(), "FP32");
    EXPECT_FALSE(reply.outputs(i).has_contents());
    EXPECT_EQ(reply.raw_output_contents(i), want[i]) << form.outputs[i];
  }
  EXPECT_THAT(reply.outputs(1).shape(), ElementsAre(1, 2, 3));
  EXPECT_THAT(reply.outputs(2).shape(), ElementsAre(1, 2, 2, 2));
  EXPECT_THAT(reply.outputs(0).shape(), ElementsAre(1, 2));
  const auto& p = reply.parameters();
  EXPECT_EQ(p.at("kernel_path").string_param(), "fp32/materialized");
  EXPECT_EQ(p.at("precision").string_param(), "fp32");
  EXPECT_EQ(p.at("queue_us").int64_param(), 25);
  EXPECT_EQ(p.at("compute_us").int64_param(), 1000000);
  EXPECT_EQ(p.at("batch_size").int64_param(), 1);
  EXPECT_EQ(p.at("batch_tokens").int64_param(), 2);
}

TEST(InferResponse, TypedRepliesCarryFp32ContentsFromRawBuffersOrFloatData) {
  Computed c;
  InferReplyForm form = Form({kOutput, kAttentionMaps, kHeadEntropy}, false);
  inference::ModelInferResponse reply;
  ASSERT_THAT(InferResponseFromAttend(form, c.response, &reply), IsOk());
  EXPECT_EQ(reply.raw_output_contents_size(), 0);
  EXPECT_EQ(TypedBytes(reply.outputs(0)), Bytes(c.output));
  EXPECT_EQ(TypedBytes(reply.outputs(1)), Bytes(c.maps));
  EXPECT_EQ(TypedBytes(reply.outputs(2)), Bytes(c.entropy));

  // float_data (Attend's answer to typed hidden states) goes over as is.
  WireResponse floats;
  Computed::Header(floats.message.mutable_output(), {1, 2, 3});
  for (float v : c.output) floats.message.mutable_output()->add_float_data(v);
  inference::ModelInferResponse typed;
  ASSERT_THAT(InferResponseFromAttend(Form({kOutput}, false), floats, &typed), IsOk());
  EXPECT_EQ(TypedBytes(typed.outputs(0)), Bytes(c.output));
  // ... and as bytes when the form is raw.
  inference::ModelInferResponse raw;
  ASSERT_THAT(InferResponseFromAttend(Form({kOutput}, true), floats, &raw), IsOk());
  EXPECT_EQ(raw.raw_output_contents(0), Bytes(c.output));
}

TEST(InferResponse, Bf16OutputsKeepTheirWordsAndDatatype) {
  WireResponse response;
  v1::Tensor* out = response.message.mutable_output();
  out->set_dtype(v1::DATA_TYPE_BF16);
  out->add_shape(1);
  out->add_shape(1);
  out->add_shape(2);
  const std::string words("\x80\x3f\x80\xbf", 4);
  response.output_raw = RawOf(words);
  response.message.set_precision(v1::PRECISION_BF16);
  inference::ModelInferResponse reply;
  ASSERT_THAT(InferResponseFromAttend(Form({kOutput}, true), response, &reply), IsOk());
  EXPECT_EQ(reply.outputs(0).datatype(), "BF16");
  EXPECT_EQ(reply.raw_output_contents(0), words);
  EXPECT_EQ(reply.parameters().at("precision").string_param(), "bf16");
  // A typed reply cannot hold BF16: that form is a broken invariant.
  WireResponse again;
  *again.message.mutable_output() = *out;
  again.output_raw = RawOf(words);
  inference::ModelInferResponse typed;
  EXPECT_THAT(InferResponseFromAttend(Form({kOutput}, false), again, &typed),
              StatusIs(absl::StatusCode::kInternal, "BF16"));
}

TEST(InferResponse, AnOutputNotComputedIsInternal) {
  WireResponse response;
  Computed::Header(response.message.mutable_output(), {1, 1, 1})->add_float_data(1);
  inference::ModelInferResponse reply;
  EXPECT_THAT(InferResponseFromAttend(Form({kAttentionMaps}, true), response, &reply),
              StatusIs(absl::StatusCode::kInternal, "outputs: 'attention_maps' was not computed"));
}

}  // namespace
}  // namespace attnserve::server::open_inference
