#include "client/attend_report.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/file_io.h"
#include "cli/npy.h"
#include "client/attention_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_files.h"
#include "tests/core/status_matchers.h"

namespace attnserve::client {

using ::attnserve::cli::NpyArray;
using ::attnserve::cli::ReadFileBytes;
using ::attnserve::cli::ReadNpyFile;

namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

void SetFloats(v1::Tensor* tensor, std::vector<int64_t> shape, const std::vector<float>& values) {
  tensor->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : shape) tensor->add_shape(d);
  tensor->set_raw_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

v1::HeadConfig Config() {
  v1::HeadConfig config;
  config.set_d_model(8);
  config.set_num_heads(2);
  config.set_num_kv_heads(2);
  config.set_head_dim(4);
  return config;
}

// A call for a ragged batch of 2 (lengths 2 and 1, padded to 2) with per-head
// maps and statistics, and the response a server would give.
struct Exchange {
  AttendOptions options;
  AttendCall call;
  v1::AttendResponse response;
};

Exchange RaggedExchange() {
  Exchange e;
  e.options.lengths = {2, 1};
  e.options.maps = "per-head";
  e.options.stats = true;
  e.options.precision = "bf16";
  const v1::HeadConfig config = Config();
  absl::StatusOr<AttendCall> call = BuildAttendRequest(e.options, &config);
  EXPECT_THAT(call, IsOk());
  e.call = *call;
  v1::AttendResponse& r = e.response;
  r.set_model("default");
  r.set_kernel_path("fp32/materialized");
  r.set_precision(v1::PRECISION_FP32);  // the CPU had no BF16
  std::vector<float> output(2 * 2 * 8);
  for (size_t i = 0; i < output.size(); ++i) output[i] = 0.5f * i;
  SetFloats(r.mutable_output(), {2, 2, 8}, output);
  // [batch 2, heads 2, 2, 2]; sequence 1's second row is padding (zeros).
  SetFloats(r.mutable_attention_maps(), {2, 2, 2, 2},
            {1, 0, 0.25f, 0.75f, 0.5f, 0.5f, 0.5f, 0.5f, 1, 0, 0, 0, 1, 0, 0, 0});
  SetFloats(r.mutable_head_statistics()->mutable_entropy(), {2, 2}, {0.1f, 0.6931f, 0, 0});
  SetFloats(r.mutable_head_statistics()->mutable_max_weight(), {2, 2}, {0.9f, 0.5f, 1, 1});
  SetFloats(r.mutable_head_statistics()->mutable_contribution(), {2, 2}, {3.5f, 1.25f, 2, 0});
  return e;
}

TEST(FormatAttendSummary, SaysWhatRanAndTheLengths) {
  const Exchange e = RaggedExchange();
  const std::string text = FormatAttendSummary(e.call, e.response);
  EXPECT_THAT(text, HasSubstr("model default: d_model 8, heads 2, kv heads 2, head_dim 4"));
  EXPECT_THAT(text, HasSubstr("kernel fp32/materialized, precision fp32 (asked bf16; the server's "
                              "CPU has no native bf16)"));
  EXPECT_THAT(text, HasSubstr("input  [2, 2, 8] FP32, random (seed 1)"));
  EXPECT_THAT(text, HasSubstr("sequence lengths 2, 1"));
  EXPECT_THAT(text, HasSubstr("output [2, 2, 8] FP32"));
  EXPECT_THAT(text, HasSubstr("output first values: +0.00000 +0.50000 +1.00000"));
  // Row sums skip sequence 1's padding row, so all are 1.
  EXPECT_THAT(text, HasSubstr("head  0: 1.0000000 .. 1.0000000   largest weight 1.0000"));
  EXPECT_THAT(text, HasSubstr("head  1: 1.0000000 .. 1.0000000   largest weight 1.0000"));
  EXPECT_THAT(text, HasSubstr("head statistics, sequence 0 (2 queries x 2 keys; uniform weights: "
                              "entropy ln 2 = 0.6931)"));
  EXPECT_THAT(text, HasSubstr("head statistics, sequence 1 (1 queries x 1 keys"));
  EXPECT_THAT(text, HasSubstr("       0           0.1000       0.9000         3.5000"));
}

TEST(FormatAttendSummary, PackedCrossAttentionAndOptionsAreListed) {
  AttendOptions options;
  options.lengths = {3, 1};
  options.packed = true;
  options.context_lengths = {2, 5};
  options.causal = true;
  options.head_mask = {1, 0};
  const v1::HeadConfig config = Config();
  absl::StatusOr<AttendCall> call = BuildAttendRequest(options, &config);
  ASSERT_THAT(call, IsOk());
  v1::AttendResponse response;
  response.set_precision(v1::PRECISION_FP32);
  SetFloats(response.mutable_output(), {4, 8}, std::vector<float>(32, 1.0f));
  const std::string text = FormatAttendSummary(*call, response);
  EXPECT_THAT(text, HasSubstr("precision fp32\n"));
  EXPECT_THAT(text, HasSubstr("input  packed [4, 8] FP32"));
  EXPECT_THAT(text, HasSubstr("sequence lengths 3, 1"));
  EXPECT_THAT(text, HasSubstr("context packed [7, 8] FP32"));
  EXPECT_THAT(text, HasSubstr("context lengths 2, 5"));
  EXPECT_THAT(text, HasSubstr("causal; head_mask 1,0"));
  EXPECT_THAT(text, Not(HasSubstr("attention maps")));
}

TEST(FormatHeadStatistics, AveragesLargeBatchesAndMarksMissingContribution) {
  AttendCall call;
  call.query_lengths.assign(5, 4);
  call.key_lengths.assign(5, 4);
  v1::HeadStatistics stats;
  SetFloats(stats.mutable_entropy(), {5, 1}, {1, 2, 3, 4, 5});
  SetFloats(stats.mutable_max_weight(), {5, 1}, {0.5f, 0.5f, 0.5f, 0.5f, 1});
  absl::StatusOr<std::string> text = FormatHeadStatistics(call, stats);
  ASSERT_THAT(text, IsOk());
  EXPECT_THAT(*text, HasSubstr("mean over the 5 sequences"));
  EXPECT_THAT(*text, HasSubstr("       0           3.0000       0.6000              -"));

  SetFloats(stats.mutable_contribution(), {2, 1}, {1, 2});
  EXPECT_THAT(FormatHeadStatistics(call, stats),
              StatusIs(absl::StatusCode::kInvalidArgument, "shapes differ"));
}

TEST(TensorValues, DecodesBf16) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::DATA_TYPE_BF16);
  tensor.add_shape(3);
  // 1.0 = 0x3f80, -2.0 = 0xc000, 0.15625 = 0x3e20 (upper halves of binary32).
  tensor.set_raw_data(std::string("\x80\x3f\x00\xc0\x20\x3e", 6));
  absl::StatusOr<std::vector<float>> values = TensorValues(tensor);
  ASSERT_THAT(values, IsOk());
  EXPECT_THAT(*values, ElementsAre(1.0f, -2.0f, 0.15625f));
  tensor.add_shape(2);
  EXPECT_THAT(TensorValues(tensor), StatusIs(absl::StatusCode::kInvalidArgument, "raw_data"));
}

TEST(SaveAttendFiles, WritesOutputMapsAndPicture) {
  Exchange e = RaggedExchange();
  e.options.save_output = TempPath("out.npy");
  e.options.save_maps = TempPath("maps.npy");
  e.options.maps_png = TempPath("maps.png");
  e.options.png_sequence = 1;
  absl::StatusOr<std::vector<std::string>> written = SaveAttendFiles(e.options, e.call, e.response);
  ASSERT_THAT(written, IsOk());
  ASSERT_EQ(written->size(), 3u);
  EXPECT_THAT((*written)[0], HasSubstr("(output [2, 2, 8] <f4)"));
  EXPECT_THAT((*written)[2], HasSubstr("heatmap of sequence 1, 2 tiles, scale 0 .. 1"));

  absl::StatusOr<NpyArray> output = ReadNpyFile(e.options.save_output);
  ASSERT_THAT(output, IsOk());
  EXPECT_THAT(output->shape, ElementsAre(2, 2, 8));
  EXPECT_EQ(output->ToFloats()[3], 1.5f);
  absl::StatusOr<NpyArray> maps = ReadNpyFile(e.options.save_maps);
  ASSERT_THAT(maps, IsOk());
  EXPECT_THAT(maps->shape, ElementsAre(2, 2, 2, 2));
  absl::StatusOr<std::string> png = ReadFileBytes(e.options.maps_png);
  ASSERT_THAT(png, IsOk());
  EXPECT_EQ(png->substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST(SaveAttendFiles, MissingMapsIsAnError) {
  Exchange e = RaggedExchange();
  e.response.clear_attention_maps();
  e.options.maps_png = TempPath("none.png");
  EXPECT_THAT(SaveAttendFiles(e.options, e.call, e.response),
              StatusIs(absl::StatusCode::kFailedPrecondition, "no attention maps"));
}

}  // namespace
}  // namespace attnserve::client
