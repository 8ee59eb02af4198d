#include "client/request_builder.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/marshalling.h"
#include "absl/strings/str_cat.h"
#include "cli/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_files.h"
#include "tests/core/status_matchers.h"

namespace attnserve::client {

using ::attnserve::cli::WriteNpyFile;

namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A model's head configuration as GetModel reports it.
v1::HeadConfig ModelConfig(int d_model = 8, int heads = 2, int kv_heads = 2, int head_dim = 4) {
  v1::HeadConfig config;
  config.set_d_model(d_model);
  config.set_num_heads(heads);
  config.set_num_kv_heads(kv_heads);
  config.set_head_dim(head_dim);
  config.set_scale(1.0f / std::sqrt(static_cast<float>(head_dim)));
  return config;
}

std::vector<float> Floats(const v1::Tensor& tensor) {
  std::vector<float> values(tensor.raw_data().size() / sizeof(float));
  std::memcpy(values.data(), tensor.raw_data().data(), tensor.raw_data().size());
  return values;
}

std::vector<int64_t> Shape(const v1::Tensor& tensor) {
  return std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end());
}

absl::StatusOr<AttendCall> Build(const AttendOptions& options,
                                 const v1::HeadConfig& config = ModelConfig()) {
  return BuildAttendRequest(options, &config);
}

TEST(FlagLists, ParseCommaSeparatedNumbers) {
  Int64List ints;
  std::string error;
  ASSERT_TRUE(absl::ParseFlag("3,5, 8", &ints, &error)) << error;
  EXPECT_THAT(ints.values, ElementsAre(3, 5, 8));
  ASSERT_TRUE(absl::ParseFlag("", &ints, &error)) << error;
  EXPECT_TRUE(ints.values.empty());
  EXPECT_FALSE(absl::ParseFlag("3,x", &ints, &error));
  EXPECT_THAT(error, HasSubstr("'x' is not a number"));
  EXPECT_FALSE(absl::ParseFlag("3,,4", &ints, &error));
  EXPECT_FALSE(absl::ParseFlag("1.5", &ints, &error));

  FloatList floats;
  ASSERT_TRUE(absl::ParseFlag("1,0,0.5,-inf", &floats, &error)) << error;
  EXPECT_THAT(floats.values, ElementsAre(1.0f, 0.0f, 0.5f, -INFINITY));
  EXPECT_FALSE(absl::ParseFlag("1,a", &floats, &error));

  EXPECT_EQ(absl::UnparseFlag(Int64List{{3, 5, 8}}), "3,5,8");
  EXPECT_EQ(absl::UnparseFlag(FloatList{{1, 0.5}}), "1,0.5");
}

TEST(BuildAttendRequest, DefaultsAskForTodaysRequest) {
  absl::StatusOr<AttendCall> call = Build(AttendOptions{});
  ASSERT_THAT(call, IsOk());
  const v1::AttendRequest& r = call->request;
  EXPECT_EQ(r.model(), "default");
  EXPECT_FALSE(r.has_layer());
  EXPECT_EQ(r.hidden_states().dtype(), v1::DATA_TYPE_FP32);
  EXPECT_THAT(Shape(r.hidden_states()), ElementsAre(1, 16, 8));
  EXPECT_EQ(r.hidden_states().raw_data().size(), 16u * 8 * 4);
  EXPECT_FALSE(r.has_attention_maps());
  EXPECT_FALSE(r.causal());
  EXPECT_FALSE(r.has_context());
  EXPECT_FALSE(r.has_mask());
  EXPECT_FALSE(r.has_projected());
  EXPECT_EQ(r.sequence_lengths_size(), 0);
  EXPECT_EQ(r.head_mask_size(), 0);
  EXPECT_EQ(r.position_offsets_size(), 0);
  EXPECT_EQ(r.precision(), v1::PRECISION_FP32);
  EXPECT_EQ(r.output_dtype(), v1::DATA_TYPE_FP32);
  EXPECT_EQ(call->batch, 1);
  EXPECT_THAT(call->query_lengths, ElementsAre(16));
  EXPECT_THAT(call->key_lengths, ElementsAre(16));
  EXPECT_EQ(call->input_source, "random (seed 1)");
}

TEST(BuildAttendRequest, RandomStatesAreNormalAndSeeded) {
  AttendOptions options;
  options.batch = 4;
  options.seq = 64;
  absl::StatusOr<AttendCall> a = Build(options);
  absl::StatusOr<AttendCall> b = Build(options);
  options.seed = 2;
  absl::StatusOr<AttendCall> c = Build(options);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(a->request.hidden_states().raw_data(), b->request.hidden_states().raw_data());
  EXPECT_NE(a->request.hidden_states().raw_data(), c->request.hidden_states().raw_data());
  double sum = 0, sum_sq = 0;
  const std::vector<float> x = Floats(a->request.hidden_states());
  for (float v : x) {
    sum += v;
    sum_sq += v * v;
  }
  EXPECT_NEAR(sum / x.size(), 0.0, 0.1);
  EXPECT_NEAR(sum_sq / x.size(), 1.0, 0.1);
}

TEST(BuildAttendRequest, LengthsMakeARaggedBatchWithZeroPadding) {
  AttendOptions options;
  options.lengths = {3, 5, 2};
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  // Batch and padded length come from the lengths.
  EXPECT_THAT(Shape(call->request.hidden_states()), ElementsAre(3, 5, 8));
  EXPECT_THAT(call->request.sequence_lengths(), ElementsAre(3, 5, 2));
  EXPECT_THAT(call->query_lengths, ElementsAre(3, 5, 2));
  EXPECT_FALSE(call->packed);
  const std::vector<float> x = Floats(call->request.hidden_states());
  // Sequence 0's token 3 is padding: zero. Its token 2 is not.
  for (int j = 0; j < 8; ++j) EXPECT_EQ(x[(0 * 5 + 3) * 8 + j], 0.0f);
  EXPECT_NE(x[(0 * 5 + 2) * 8], 0.0f);
}

TEST(BuildAttendRequest, PackedSendsTheSameTokensAsPadded) {
  AttendOptions padded;
  padded.lengths = {2, 3};
  AttendOptions packed = padded;
  packed.packed = true;
  absl::StatusOr<AttendCall> a = Build(padded);
  absl::StatusOr<AttendCall> b = Build(packed);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_TRUE(b->packed);
  EXPECT_THAT(Shape(b->request.hidden_states()), ElementsAre(5, 8));
  EXPECT_THAT(b->request.sequence_lengths(), ElementsAre(2, 3));
  const std::vector<float> x = Floats(a->request.hidden_states());  // [2, 3, 8]
  const std::vector<float> y = Floats(b->request.hidden_states());  // [5, 8]
  auto padded_row = [&](int b_, int i) {
    return std::vector<float>(&x[(b_ * 3 + i) * 8], &x[(b_ * 3 + i) * 8 + 8]);
  };
  auto packed_row = [&](int t) { return std::vector<float>(&y[t * 8], &y[t * 8 + 8]); };
  EXPECT_EQ(packed_row(0), padded_row(0, 0));
  EXPECT_EQ(packed_row(1), padded_row(0, 1));
  EXPECT_EQ(packed_row(2), padded_row(1, 0));
  EXPECT_EQ(packed_row(4), padded_row(1, 2));
}

TEST(BuildAttendRequest, ContextMakesCrossAttention) {
  AttendOptions options;
  options.batch = 2;
  options.seq = 4;
  options.context_seq = 6;
  options.context_lengths = {6, 2};
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  EXPECT_TRUE(call->cross_attention);
  EXPECT_THAT(Shape(call->request.context()), ElementsAre(2, 6, 8));
  EXPECT_EQ(call->request.context().dtype(), v1::DATA_TYPE_FP32);
  EXPECT_THAT(call->request.context_lengths(), ElementsAre(6, 2));
  EXPECT_THAT(call->key_lengths, ElementsAre(6, 2));
  EXPECT_THAT(call->query_lengths, ElementsAre(4, 4));
  // Context states follow the queries' in the random stream: they differ.
  EXPECT_NE(call->request.context().raw_data().substr(0, 32),
            call->request.hidden_states().raw_data().substr(0, 32));

  AttendOptions packed;
  packed.lengths = {1, 2};
  packed.packed = true;
  packed.context_lengths = {3, 4};
  absl::StatusOr<AttendCall> packed_call = Build(packed);
  ASSERT_THAT(packed_call, IsOk());
  EXPECT_THAT(Shape(packed_call->request.context()), ElementsAre(7, 8));
  EXPECT_THAT(packed_call->request.context_lengths(), ElementsAre(3, 4));
}

TEST(BuildAttendRequest, AttentionOptionsLandInTheirFields) {
  AttendOptions options;
  options.batch = 2;
  options.seq = 3;
  options.causal = true;
  options.head_mask = {1.0f, 0.0f};
  options.position_offsets = {0, 7};
  options.precision = "bf16";
  options.output_dtype = "bf16";
  options.maps = "per-head";
  options.heads = {1};
  options.rows = {2, 0};
  options.stats = true;
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  const v1::AttendRequest& r = call->request;
  EXPECT_TRUE(r.causal());
  EXPECT_THAT(r.head_mask(), ElementsAre(1.0f, 0.0f));
  EXPECT_THAT(r.position_offsets(), ElementsAre(0, 7));
  EXPECT_EQ(r.precision(), v1::PRECISION_BF16);
  EXPECT_EQ(r.output_dtype(), v1::DATA_TYPE_BF16);
  EXPECT_EQ(r.attention_maps().mode(), v1::ATTENTION_MAP_MODE_PER_HEAD);
  EXPECT_THAT(r.attention_maps().heads(), ElementsAre(1));
  EXPECT_THAT(r.attention_maps().query_rows(), ElementsAre(2, 0));
  EXPECT_TRUE(r.attention_maps().head_statistics());
}

TEST(BuildAttendRequest, StatsAloneAsksForNoMaps) {
  AttendOptions options;
  options.stats = true;
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  EXPECT_EQ(call->request.attention_maps().mode(), v1::ATTENTION_MAP_MODE_NONE);
  EXPECT_TRUE(call->request.attention_maps().head_statistics());
  options.stats = false;
  options.maps = "mean";
  call = Build(options);
  ASSERT_THAT(call, IsOk());
  EXPECT_EQ(call->request.attention_maps().mode(), v1::ATTENTION_MAP_MODE_MEAN);
  EXPECT_FALSE(call->request.attention_maps().head_statistics());
}

TEST(BuildAttendRequest, MaskFilesTravelAsBoolOrFloat) {
  AttendOptions options;
  options.seq = 2;
  options.context_seq = 3;
  options.mask = TestData("mask_bool_1x2x3.npy");
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  const v1::AttentionMask& mask = call->request.mask();
  EXPECT_EQ(mask.kind(), v1::AttentionMask::KIND_ALLOWED);
  EXPECT_EQ(mask.values().dtype(), v1::DATA_TYPE_BOOL);
  EXPECT_THAT(Shape(mask.values()), ElementsAre(1, 2, 3));
  EXPECT_EQ(mask.values().raw_data(), std::string("\1\0\1\0\1\1", 6));

  const std::string additive = TempPath("additive.npy");
  ASSERT_THAT(WriteNpyFile(additive, {1, 1, 3}, {0.0f, -INFINITY, 0.0f}), IsOk());
  options.mask = additive;
  options.mask_kind = "additive";
  call = Build(options);
  ASSERT_THAT(call, IsOk());
  EXPECT_EQ(call->request.mask().kind(), v1::AttentionMask::KIND_ADDITIVE);
  EXPECT_EQ(call->request.mask().values().dtype(), v1::DATA_TYPE_FP32);
  EXPECT_THAT(Floats(call->request.mask().values()), ElementsAre(0.0f, -INFINITY, 0.0f));
}

TEST(BuildAttendRequest, InputFileReplacesRandomStates) {
  const std::string padded = TempPath("input_padded.npy");
  std::vector<float> values(2 * 3 * 8);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * i;
  ASSERT_THAT(WriteNpyFile(padded, {2, 3, 8}, values), IsOk());
  AttendOptions options;
  options.input = padded;
  options.lengths = {3, 1};
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  EXPECT_THAT(Shape(call->request.hidden_states()), ElementsAre(2, 3, 8));
  EXPECT_EQ(Floats(call->request.hidden_states()), values);
  EXPECT_EQ(call->batch, 2);
  EXPECT_EQ(call->input_source, padded);

  // Rank 2 is packed: the lengths say where the sequences are.
  const std::string packed = TempPath("input_packed.npy");
  ASSERT_THAT(WriteNpyFile(packed, {6, 8}, std::vector<float>(48, 1.0f)), IsOk());
  options.input = packed;
  options.lengths = {4, 2};
  call = Build(options);
  ASSERT_THAT(call, IsOk());
  EXPECT_TRUE(call->packed);
  EXPECT_THAT(Shape(call->request.hidden_states()), ElementsAre(6, 8));
  EXPECT_THAT(call->request.sequence_lengths(), ElementsAre(4, 2));
}

// The BF16 value nearest to x, found independently of the builder's rounding:
// the two BF16 neighbours of x (truncated, and one step away from zero),
// compared in double; on a tie the one with an even last bit.
float NearestBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t low_bits = bits & 0xffff0000u;
  const uint32_t high_bits = low_bits + 0x10000u;
  float low, high;
  std::memcpy(&low, &low_bits, sizeof(low));
  std::memcpy(&high, &high_bits, sizeof(high));
  const double to_low = std::abs(static_cast<double>(x) - low);
  const double to_high = std::abs(static_cast<double>(high) - x);
  if (to_low != to_high) return to_low < to_high ? low : high;
  return (low_bits & 0x10000u) == 0 ? low : high;
}

std::vector<float> WidenedBf16(const v1::Tensor& tensor) {
  std::vector<float> values(tensor.raw_data().size() / sizeof(uint16_t));
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t word;
    std::memcpy(&word, tensor.raw_data().data() + i * sizeof(word), sizeof(word));
    const uint32_t bits = static_cast<uint32_t>(word) << 16;
    std::memcpy(&values[i], &bits, sizeof(bits));
  }
  return values;
}

TEST(BuildAttendRequest, InputDtypeBf16SendsTheStatesRoundedToNearestEven) {
  AttendOptions options;
  options.batch = 2;
  options.seq = 5;
  options.context_seq = 3;
  options.seed = 11;
  absl::StatusOr<AttendCall> fp32 = Build(options);
  options.input_dtype = "bf16";
  absl::StatusOr<AttendCall> bf16 = Build(options);
  ASSERT_THAT(fp32, IsOk());
  ASSERT_THAT(bf16, IsOk());
  for (auto [sent, exact] : {std::pair{&bf16->request.hidden_states(), &fp32->request.hidden_states()},
                             std::pair{&bf16->request.context(), &fp32->request.context()}}) {
    EXPECT_EQ(sent->dtype(), v1::DATA_TYPE_BF16);
    EXPECT_EQ(Shape(*sent), Shape(*exact));
    const std::vector<float> values = Floats(*exact);
    ASSERT_EQ(sent->raw_data().size(), values.size() * sizeof(uint16_t));
    const std::vector<float> widened = WidenedBf16(*sent);
    int inexact = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_EQ(widened[i], NearestBf16(values[i])) << "value " << i << ": " << values[i];
      inexact += widened[i] != values[i];
    }
    EXPECT_GT(inexact, 0) << "random states should need rounding";
  }

  // Ties go to the even neighbour; --input's values are converted too.
  const std::string ties = TempPath("input_ties.npy");
  const float one_ulp = std::ldexp(1.0f, -7);  // BF16's step at 1
  const std::vector<float> tie_values = {1.0f + one_ulp / 2, 1.0f + 3 * one_ulp / 2,
                                         -(1.0f + one_ulp / 2), 1.0f + one_ulp / 4, 0.0f,
                                         -2.0f, 1.0f + 3 * one_ulp / 4, 65504.0f};
  ASSERT_THAT(WriteNpyFile(ties, {1, 1, 8}, tie_values), IsOk());
  AttendOptions from_file;
  from_file.input = ties;
  from_file.input_dtype = "bf16";
  absl::StatusOr<AttendCall> call = Build(from_file);
  ASSERT_THAT(call, IsOk());
  EXPECT_THAT(WidenedBf16(call->request.hidden_states()),
              ElementsAre(1.0f, 1.0f + 2 * one_ulp, -1.0f, 1.0f, 0.0f, -2.0f, 1.0f + one_ulp,
                          65536.0f));
}

TEST(BuildAttendRequest, LayerSeedSendsAnAdHocLayerInsteadOfTheModel) {
  AttendOptions options;
  options.layer_seed = 7;
  options.d_model = 12;
  options.num_heads = 6;
  options.num_kv_heads = 2;
  options.rotary_dim = 2;
  options.rope_theta = 500;
  options.position_offsets = {3};
  absl::StatusOr<AttendCall> call = BuildAttendRequest(options, nullptr);
  ASSERT_THAT(call, IsOk());
  const v1::AttendRequest& r = call->request;
  EXPECT_TRUE(r.model().empty());
  ASSERT_TRUE(r.has_layer());
  EXPECT_EQ(r.layer().seed(), 7u);
  EXPECT_EQ(r.layer().head_config().d_model(), 12);
  EXPECT_EQ(r.layer().head_config().num_heads(), 6);
  EXPECT_EQ(r.layer().head_config().num_kv_heads(), 2);
  EXPECT_EQ(r.layer().head_config().head_dim(), 0);  // the server's default
  EXPECT_EQ(r.layer().head_config().rotary().rotary_dim(), 2);
  EXPECT_EQ(r.layer().head_config().rotary().theta(), 500.0f);
  // The resolved configuration sizes the inputs.
  EXPECT_EQ(call->config.head_dim(), 2);
  EXPECT_THAT(Shape(r.hidden_states()), ElementsAre(1, 16, 12));
}

TEST(BuildAttendRequest, ProjectedSendsRandomHeadsShapedByTheConfig) {
  AttendOptions options;
  options.projected = true;
  options.batch = 2;
  options.seq = 5;
  options.context_seq = 7;
  options.lengths = {5, 3};
  absl::StatusOr<AttendCall> call = Build(options, ModelConfig(16, 4, 2, 6));
  ASSERT_THAT(call, IsOk());
  const v1::AttendRequest& r = call->request;
  EXPECT_FALSE(r.has_hidden_states());
  EXPECT_FALSE(r.has_context());  // k and v carry the keys
  EXPECT_THAT(Shape(r.projected().q()), ElementsAre(2, 4, 5, 6));
  EXPECT_THAT(Shape(r.projected().k()), ElementsAre(2, 2, 7, 6));
  EXPECT_THAT(Shape(r.projected().v()), ElementsAre(2, 2, 7, 6));
  EXPECT_EQ(r.projected().q().raw_data().size(), 2u * 4 * 5 * 6 * 4);
  EXPECT_THAT(r.sequence_lengths(), ElementsAre(5, 3));
  EXPECT_NE(r.projected().k().raw_data(), r.projected().v().raw_data());

  // With an ad-hoc layer: the layer's head config, no model.
  AttendOptions adhoc;
  adhoc.projected = true;
  adhoc.layer_seed = 1;
  adhoc.d_model = 8;
  adhoc.num_heads = 2;
  adhoc.seq = 3;
  call = BuildAttendRequest(adhoc, nullptr);
  ASSERT_THAT(call, IsOk());
  EXPECT_THAT(Shape(call->request.projected().q()), ElementsAre(1, 2, 3, 4));
  EXPECT_TRUE(call->request.has_layer());
}

struct BadCase {
  std::string name;
  AttendOptions options;
  std::string message;  // starts with the flag
};

TEST(BuildAttendRequest, BadOptionsAreRejectedNamingTheFlag) {
  const std::string bool_mask = TestData("mask_bool_1x2x3.npy");
  const std::string input_d4 = TempPath("input_d4.npy");
  ASSERT_THAT(WriteNpyFile(input_d4, {1, 2, 4}, std::vector<float>(8)), IsOk());
  const std::string input_rank4 = TempPath("input_rank4.npy");
  ASSERT_THAT(WriteNpyFile(input_rank4, {1, 1, 2, 8}, std::vector<float>(16)), IsOk());
  const std::string input_padded = TempPath("input_padded_bad.npy");
  ASSERT_THAT(WriteNpyFile(input_padded, {2, 3, 8}, std::vector<float>(48)), IsOk());
  const std::string input_packed = TempPath("input_packed_bad.npy");
  ASSERT_THAT(WriteNpyFile(input_packed, {5, 8}, std::vector<float>(40)), IsOk());

  std::vector<BadCase> cases;
  auto add = [&](std::string name, auto set, std::string message) {
    AttendOptions o;
    set(o);
    cases.push_back({std::move(name), o, std::move(message)});
  };
  add(
      "unknown maps", [](AttendOptions& o) { o.maps = "all"; }, "--maps: 'all' is not one of");
  add(
      "unknown precision", [](AttendOptions& o) { o.precision = "fp16"; }, "--precision: 'fp16'");
  add(
      "unknown output dtype", [](AttendOptions& o) { o.output_dtype = "int8"; }, "--output_dtype");
  add(
      "unknown input dtype", [](AttendOptions& o) { o.input_dtype = "fp16"; },
      "--input_dtype: 'fp16' is not one of fp32, bf16");
  add(
      "bf16 input with projected heads",
      [](AttendOptions& o) {
        o.projected = true;
        o.input_dtype = "bf16";
      },
      "--input_dtype: bf16 applies to hidden and context states");
  add(
      "unknown mask kind",
      [&](AttendOptions& o) {
        o.mask = bool_mask;
        o.mask_kind = "x";
      },
      "--mask_kind: 'x'");
  add(
      "mask kind without mask", [](AttendOptions& o) { o.mask_kind = "allowed"; },
      "--mask_kind: given without --mask");
  add(
      "packed without lengths", [](AttendOptions& o) { o.packed = true; },
      "--packed: needs --lengths");
  add(
      "packed with seq",
      [](AttendOptions& o) {
        o.packed = true;
        o.lengths = {2};
        o.seq = 4;
      },
      "--seq: not used with --packed");
  add(
      "packed cross without context lengths",
      [](AttendOptions& o) {
        o.packed = true;
        o.lengths = {2};
        o.context_seq = 4;
      },
      "--context_lengths: required for cross-attention with --packed");
  add(
      "heads with mean maps",
      [](AttendOptions& o) {
        o.maps = "mean";
        o.heads = {0};
      },
      "--heads: only with --maps=per-head");
  add(
      "heads without maps", [](AttendOptions& o) { o.heads = {0}; }, "--heads: only with");
  add(
      "rows without maps", [](AttendOptions& o) { o.rows = {0}; }, "--rows: needs --maps");
  add(
      "length over seq",
      [](AttendOptions& o) {
        o.seq = 4;
        o.lengths = {3, 5};
      },
      "--lengths: [1] is 5, more than 4 (--seq)");
  add(
      "length zero",
      [](AttendOptions& o) {
        o.lengths = {3, 0};
      },
      "--lengths: [1] is 0");
  add(
      "lengths for another batch",
      [](AttendOptions& o) {
        o.batch = 3;
        o.lengths = {3, 5};
      },
      "--lengths: 2 lengths for a batch of 3 (--batch)");
  add(
      "packed batch mismatch",
      [](AttendOptions& o) {
        o.batch = 3;
        o.packed = true;
        o.lengths = {3, 5};
      },
      "--batch: 3, but --lengths has 2 sequences");
  add(
      "context length over context seq",
      [](AttendOptions& o) {
        o.context_seq = 4;
        o.context_lengths = {5};
      },
      "--context_lengths: [0] is 5, more than 4 (--context_seq)");
  add(
      "context lengths for another batch",
      [](AttendOptions& o) {
        o.batch = 2;
        o.context_lengths = {5};
      },
      "--context_lengths: 1 lengths for a batch of 2");
  add(
      "negative batch", [](AttendOptions& o) { o.batch = -1; },
      "--batch: must be in [1, 16777216]");
  add(
      "a tensor too big to make up",
      [](AttendOptions& o) {
        o.batch = 64;
        o.seq = 1 << 24;
      },
      "--seq: a tensor of shape [64, 16777216, 8] is more than attnctl makes up");
  add(
      "a length too big",
      [](AttendOptions& o) {
        o.packed = true;
        o.lengths = {int64_t{1} << 40};
      },
      "--lengths: [0] is 1099511627776, more than 16777216");
  add(
      "row beyond the request's int32",
      [](AttendOptions& o) {
        o.maps = "mean";
        o.rows = {int64_t{1} << 32};
      },
      "--rows: [0] is 4294967296, outside the request's int32");
  add(
      "head beyond the request's int32",
      [](AttendOptions& o) {
        o.maps = "per-head";
        o.heads = {0, -(int64_t{1} << 31) - 1};
      },
      "--heads: [1] is -2147483649, outside the request's int32");
  add(
      "mask of the wrong shape",
      [&](AttendOptions& o) {
        o.seq = 4;
        o.mask = bool_mask;
      },
      "--mask: " + bool_mask + ": shape [1, 2, 3] dimension 1 is 2; expected 1 or seq_q=4");
  add(
      "additive mask of booleans",
      [&](AttendOptions& o) {
        o.seq = 2;
        o.context_seq = 3;
        o.mask = bool_mask;
        o.mask_kind = "additive";
      },
      "--mask_kind: additive needs '<f4' values");
  add(
      "missing mask file", [](AttendOptions& o) { o.mask = "/nonexistent/m.npy"; },
      "/nonexistent/m.npy");
  add(
      "ad-hoc flag without layer seed", [](AttendOptions& o) { o.num_kv_heads = 2; },
      "--num_kv_heads: describes an ad-hoc layer: only with --layer_seed");
  add(
      "layer seed without d_model",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.num_heads = 2;
      },
      "--d_model: required");
  add(
      "layer seed without num_heads",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.d_model = 8;
      },
      "--num_heads: required");
  add(
      "kv heads not dividing heads",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.d_model = 12;
        o.num_heads = 6;
        o.num_kv_heads = 4;
      },
      "--num_kv_heads: 4 does not divide --num_heads=6");
  add(
      "heads not dividing d_model",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.d_model = 10;
        o.num_heads = 4;
      },
      "--head_dim: required: --num_heads=4 does not divide --d_model=10");
  add(
      "odd rotary dim",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.d_model = 8;
        o.num_heads = 2;
        o.rotary_dim = 3;
      },
      "--rotary_dim: 3 is not an even number in [0, head_dim=4]");
  add(
      "theta too small",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.d_model = 8;
        o.num_heads = 2;
        o.rotary_dim = 2;
        o.rope_theta = 0.5;
      },
      "--rope_theta: 0.5 is not a finite number > 1");
  add(
      "offsets without RoPE",
      [](AttendOptions& o) {
        o.layer_seed = 1;
        o.d_model = 8;
        o.num_heads = 2;
        o.position_offsets = {0};
      },
      "--position_offsets: needs --rotary_dim");
  add(
      "projected with input",
      [&](AttendOptions& o) {
        o.projected = true;
        o.input = input_d4;
      },
      "--input: not used with --projected");
  add(
      "projected packed",
      [](AttendOptions& o) {
        o.projected = true;
        o.packed = true;
        o.lengths = {2};
      },
      "--packed: projected heads are padded");
  add(
      "projected with offsets",
      [](AttendOptions& o) {
        o.projected = true;
        o.position_offsets = {0};
      },
      "--position_offsets: not used with --projected");
  add(
      "input of another width", [&](AttendOptions& o) { o.input = input_d4; },
      "--input: " + input_d4 + ": shape [1, 2, 4] has d_model 4; the layer's is 8");
  add(
      "input of rank 4", [&](AttendOptions& o) { o.input = input_rank4; },
      "expected [batch, seq, d_model]");
  add(
      "padded input with packed",
      [&](AttendOptions& o) {
        o.input = input_padded;
        o.packed = true;
      },
      "--packed: " + input_padded + " is padded [2, 3, 8]");
  add(
      "input batch mismatch",
      [&](AttendOptions& o) {
        o.input = input_padded;
        o.batch = 3;
      },
      "--batch: 3, but " + input_padded + " has 2 sequences");
  add(
      "packed input without lengths", [&](AttendOptions& o) { o.input = input_packed; },
      "--lengths: required: " + input_packed + " is packed [5, 8]");
  add(
      "packed input lengths mismatch",
      [&](AttendOptions& o) {
        o.input = input_packed;
        o.lengths = {2, 2};
      },
      "--lengths: sum to 4, but " + input_packed + " has 5 tokens");
  add(
      "bool input", [&](AttendOptions& o) { o.input = bool_mask; }, "hidden states are '<f4'");
  add(
      "png without maps", [](AttendOptions& o) { o.maps_png = "/tmp/x.png"; },
      "--maps_png: needs --maps=per-head or --maps=mean");
  add(
      "saved maps without maps", [](AttendOptions& o) { o.save_maps = "/tmp/x.npy"; },
      "--save_maps: needs --maps");
  add(
      "png sequence outside the batch",
      [](AttendOptions& o) {
        o.maps = "mean";
        o.maps_png = "/tmp/x.png";
        o.png_sequence = 1;
      },
      "--png_sequence: 1 is outside [0, 1)");
  add(
      "png sequence without png", [](AttendOptions& o) { o.png_sequence = 1; },
      "--png_sequence: only with --maps_png");
  add(
      "empty model", [](AttendOptions& o) { o.model = ""; }, "--model: required");

  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::StatusOr<AttendCall> call = c.options.layer_seed.has_value()
                                                ? BuildAttendRequest(c.options, nullptr)
                                                : Build(c.options);
    const absl::StatusCode code = c.name == "missing mask file"
                                      ? absl::StatusCode::kNotFound
                                      : absl::StatusCode::kInvalidArgument;
    EXPECT_THAT(call, StatusIs(code, c.message));
  }
}

// Their counts and ranges are the server's rules (core/validation.h, under the
// request's field names): attnctl passes the values on as given.
TEST(BuildAttendRequest, ValuesTheServerChecksArePassedOnAsGiven) {
  AttendOptions options;
  options.seq = 4;
  options.head_mask = {1.0f, NAN, -1.0f};  // 3 values for 2 heads
  options.position_offsets = {-1, 5};      // 2 offsets for 1 sequence
  options.maps = "per-head";
  options.heads = {0, 2, 2};  // 3 heads of 2, one outside [0, 2)
  options.rows = {4};         // outside [0, seq 4)
  absl::StatusOr<AttendCall> call = Build(options);
  ASSERT_THAT(call, IsOk());
  const v1::AttendRequest& r = call->request;
  ASSERT_EQ(r.head_mask_size(), 3);
  EXPECT_EQ(r.head_mask(0), 1.0f);
  EXPECT_TRUE(std::isnan(r.head_mask(1)));
  EXPECT_EQ(r.head_mask(2), -1.0f);
  EXPECT_THAT(r.position_offsets(), ElementsAre(-1, 5));
  EXPECT_THAT(r.attention_maps().heads(), ElementsAre(0, 2, 2));
  EXPECT_THAT(r.attention_maps().query_rows(), ElementsAre(4));
}

TEST(ValidateAttendOptions, CatchesFlagMistakesWithoutAHeadConfig) {
  AttendOptions options;
  EXPECT_THAT(ValidateAttendOptions(options), IsOk());
  options.maps = "mean";
  options.heads = {1};
  EXPECT_THAT(ValidateAttendOptions(options),
              StatusIs(absl::StatusCode::kInvalidArgument, "--heads: only with --maps=per-head"));
}

TEST(PrecisionText, NamesEachPrecision) {
  EXPECT_EQ(PrecisionText(v1::PRECISION_FP32), "fp32");
  EXPECT_EQ(PrecisionText(v1::PRECISION_BF16), "bf16");
  EXPECT_EQ(PrecisionText(v1::PRECISION_UNSPECIFIED), "unspecified");
}

}  // namespace
}  // namespace attnserve::client
