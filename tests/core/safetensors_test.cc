// safetensors parsing (round trips and a table of defects, each with its
// reason) and the checkpoint layouts (each layout's tensors back to the
// weights they were written from).
#include "core/safetensors.h"

#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"
#include "core/bf16.h"
#include "core/checkpoint_layouts.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/checkpoint_writer.h"
#include "tests/core/safetensors_writer.h"
#include "tests/core/status_matchers.h"
#include "tests/temp_path.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::FloatToBf16;
using ::attnserve::testing::FloatToF16;
using ::attnserve::testing::ConfigJson;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::LayoutCase;
using ::attnserve::testing::WriteLayout;
using ::attnserve::testing::SafetensorsWriter;
using ::attnserve::testing::StatusIs;

using ::attnserve::testing::TempPath;

std::vector<float> Ramp(int64_t n, float scale) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i - n / 2) + 0.125f;
  return v;
}

TEST(Safetensors, RoundTripsFp32Bf16AndFp16) {
  SafetensorsWriter writer;
  const std::vector<float> values = Ramp(12, 0.37f);
  writer.Add("a.f32", {3, 4}, values, "F32");
  writer.Add("b.bf16", {12}, values, "BF16");
  writer.Add("c.f16", {2, 2, 3}, values, "F16");
  writer.Add("empty", {0, 5}, {}, "F32");
  const std::string path = TempPath("roundtrip.safetensors");
  writer.Write(path);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_EQ(file->tensors().size(), 4u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->tensors().at("c.f16").shape, (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(file->tensors().at("b.bf16").dtype, SafetensorsDtype::kBF16);

  absl::StatusOr<std::vector<float>> f32 = file->ReadFloat("a.f32");
  ASSERT_THAT(f32, IsOk());
  EXPECT_EQ(*f32, values);
  absl::StatusOr<std::vector<float>> bf16 = file->ReadFloat("b.bf16");
  absl::StatusOr<std::vector<float>> f16 = file->ReadFloat("c.f16");
  ASSERT_THAT(bf16, IsOk());
  ASSERT_THAT(f16, IsOk());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ((*bf16)[i], Bfloat16ToFloat(FloatToBf16(values[i])));
    EXPECT_EQ((*f16)[i], HalfToFloat(FloatToF16(values[i])));
    // BF16 keeps 8 significant bits, F16 11: rounding to nearest is within a
    // relative 2^-8 and 2^-11 (half a unit in the last place of each).
    EXPECT_NEAR((*bf16)[i], values[i], std::abs(values[i]) * 0x1p-8);
    EXPECT_NEAR((*f16)[i], values[i], std::abs(values[i]) * 0x1p-11);
  }
  EXPECT_TRUE(file->ReadFloat("empty")->empty());
  ::unlink(path.c_str());
}

TEST(Safetensors, HalfConversionIsExactOnKnownValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x0200), std::ldexp(1.0f, -15));
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_EQ(Bfloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bfloat16ToFloat(0xc0a0), -5.0f);
}

struct Defect {
  std::string name;
  std::string bytes;
  absl::StatusCode code;
  std::string reason;
  std::string read;  // a tensor to read after a successful Open, if any
};

std::string WithLength(uint64_t length, const std::string& rest) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + rest;
}

std::string Entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return absl::StrCat("{\"t\":{\"dtype\":\"", dtype, "\",\"shape\":", shape,
                      ",\"data_offsets\":", offsets, "}}");
}

// "[0,0,...]" with `n` zeros.
std::string ManyZeros(int n) {
  std::string out = "[0";
  for (int i = 1; i < n; ++i) out += ",0";
  return out + "]";
}

// A header object of `n` members `before` i `after` (e.g. "t0":{}), inside
// "__metadata__" when `in_metadata`.
std::string ManyEntries(const std::string& before, const std::string& after, int n,
                        bool in_metadata) {
  std::string out = in_metadata ? "{\"__metadata__\":{" : "{";
  for (int i = 0; i < n; ++i) absl::StrAppend(&out, i == 0 ? "" : ",", before, i, after);
  return out + (in_metadata ? "}}" : "}");
}

TEST(Safetensors, EachDefectIsRefusedWithItsReason) {
  const std::string data16(16, '\0');
  SafetensorsWriter good;
  good.Add("t", {2, 2}, {1, 2, 3, 4});
  const std::string good_bytes = good.Bytes();
  SafetensorsWriter i64;
  i64.AddRaw("t", "I64", "[2]", std::string(16, '\0'));
  const std::vector<Defect> defects = {
      {"empty file", "", absl::StatusCode::kInvalidArgument, "shorter than the 8-byte header length", ""},
      {"header length past EOF", WithLength(1000, "{}"), absl::StatusCode::kInvalidArgument,
       "header length 1000 passes the end of the file", ""},
      {"huge header length", WithLength(~uint64_t{0}, "{}"), absl::StatusCode::kInvalidArgument,
       "passes the end of the file", ""},
      {"header not JSON", SafetensorsWriter::Assemble("{\"t\": [1, 2", ""),
       absl::StatusCode::kInvalidArgument, "header is not valid JSON", ""},
      {"header not an object", SafetensorsWriter::Assemble("[1, 2, 3]", ""),
       absl::StatusCode::kInvalidArgument, "header is JSON but not an object", ""},
      {"bad dtype", SafetensorsWriter::Assemble(Entry("F33", "[4]", "[0,16]"), data16),
       absl::StatusCode::kInvalidArgument, "tensor 't': unknown dtype 'F33'", ""},
      {"offsets out of range", SafetensorsWriter::Assemble(Entry("F32", "[4]", "[0,16]"), "abcd"),
       absl::StatusCode::kInvalidArgument, "pass the end of the data section", ""},
      {"offsets reversed", SafetensorsWriter::Assemble(Entry("F32", "[0]", "[8,4]"), data16),
       absl::StatusCode::kInvalidArgument, "begin <= end", ""},
      {"wrong size", SafetensorsWriter::Assemble(Entry("F32", "[3]", "[0,16]"), data16),
       absl::StatusCode::kInvalidArgument, "hold 16 bytes, but shape [3] of F32 needs 12", ""},
      {"overlapping",
       SafetensorsWriter::Assemble(
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
           "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
           data16),
       absl::StatusCode::kInvalidArgument, "tensors 'a' [0, 8) and 'b' [4, 12) overlap", ""},
      {"shape overflow",
       SafetensorsWriter::Assemble(Entry("F32", "[4294967296,4294967296]", "[0,16]"), data16),
       absl::StatusCode::kInvalidArgument, "shape [4294967296, 4294967296] overflows", ""},
      {"negative dim", SafetensorsWriter::Assemble(Entry("F32", "[-4]", "[0,16]"), data16),
       absl::StatusCode::kInvalidArgument, "not a non-negative 64-bit integer", ""},
      {"fractional dim", SafetensorsWriter::Assemble(Entry("F32", "[4.0]", "[0,16]"), data16),
       absl::StatusCode::kInvalidArgument, "not a non-negative 64-bit integer", ""},
      {"missing offsets", SafetensorsWriter::Assemble("{\"t\":{\"dtype\":\"F32\",\"shape\":[4]}}", data16),
       absl::StatusCode::kInvalidArgument, "data_offsets missing", ""},
      {"unknown field",
       SafetensorsWriter::Assemble(
           "{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0],\"x\":1}}", ""),
       absl::StatusCode::kInvalidArgument, "unknown field 'x'", ""},
      {"metadata not strings", SafetensorsWriter::Assemble("{\"__metadata__\":{\"a\":1}}", ""),
       absl::StatusCode::kInvalidArgument, "__metadata__ 'a' is not a string", ""},
      {"duplicate name",
       SafetensorsWriter::Assemble(
           "{\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
           "\"t\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}",
           ""),
       absl::StatusCode::kInvalidArgument, "names 't' twice", ""},
      {"deep nesting", SafetensorsWriter::Assemble(std::string(100, '[') + std::string(100, ']'), ""),
       absl::StatusCode::kInvalidArgument, "nests deeper than", ""},
      // What a header's text may unfold into is bounded while it is parsed:
      // a list longer than any shape, more values than a checkpoint has.
      {"long list", SafetensorsWriter::Assemble(Entry("F32", ManyZeros(65), "[0,0]"), ""),
       absl::StatusCode::kInvalidArgument, "header has a list of more than 64 elements", ""},
      {"too many values", SafetensorsWriter::Assemble(ManyEntries("\"k", "\":\"\"", 600000, true), ""),
       absl::StatusCode::kInvalidArgument,
       absl::StrCat("header holds more than ", kMaxSafetensorsHeaderValues, " JSON values"), ""},
      // 400,000 entries parse in linear time (a parser that scanned the
      // header's object each time an entry closes would take many minutes
      // here) and the first entry's defect is reported.
      {"many entries", SafetensorsWriter::Assemble(ManyEntries("\"t", "\":{}", 400000, false), ""),
       absl::StatusCode::kInvalidArgument, "tensor 't0': dtype missing", ""},
      {"truncated data", good_bytes.substr(0, good_bytes.size() - 3),
       absl::StatusCode::kInvalidArgument, "out of range, or the file is truncated", ""},
      {"missing tensor", good_bytes, absl::StatusCode::kNotFound, "no tensor named 'q'", "q"},
      {"integer dtype read as weights", i64.Bytes(), absl::StatusCode::kInvalidArgument,
       "has dtype I64; weights must be F32, BF16 or F16", "t"},
  };
  for (const Defect& d : defects) {
    SCOPED_TRACE(d.name);
    const std::string path = TempPath("defect.safetensors");
    SafetensorsWriter::WriteFile(path, d.bytes);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    if (d.read.empty()) {
      EXPECT_THAT(file, StatusIs(d.code, d.reason));
      // The message names the file.
      EXPECT_THAT(file, StatusIs(d.code, path));
    } else {
      ASSERT_THAT(file, IsOk());
      EXPECT_THAT(file->ReadFloat(d.read), StatusIs(d.code, d.reason));
    }
    ::unlink(path.c_str());
  }
}

TEST(Safetensors, ADirectoryOrMissingFileIsRefused) {
  EXPECT_THAT(SafetensorsFile::Open("/"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   "not a regular file"));
  EXPECT_THAT(SafetensorsFile::Open(TempPath("absent")),
              StatusIs(absl::StatusCode::kNotFound, "cannot open"));
}

// --- Layouts --------------------------------------------------------------

float Rounded(float v, const std::string& dtype) {
  if (dtype == "BF16") return Bfloat16ToFloat(FloatToBf16(v));
  if (dtype == "F16") return HalfToFloat(FloatToF16(v));
  return v;
}

TEST(CheckpointLayouts, EachLayoutLoadsTheWeightsItWasWrittenFrom) {
  auto head = [](int64_t d, int64_t h, int64_t kv, int64_t rotary) {
    HeadConfig c;
    c.d_model = d;
    c.num_heads = h;
    c.num_kv_heads = kv;
    c.rotary.rotary_dim = rotary;
    return c;
  };
  const std::vector<LayoutCase> cases = {
      {"torch_mha", head(16, 4, 4, 0), "", "F32"},
      {"torch_mha", head(16, 2, 2, 0), "encoder.attn.", "BF16"},
      {"bert", head(24, 3, 3, 0), "bert.encoder.layer.3.attention.", "F32"},
      {"bert", head(24, 3, 3, 0), "encoder.layer.0.attention.", "F16"},
      {"gpt2", head(16, 4, 4, 0), "h.3.attn.", "F32"},
      {"llama", head(32, 8, 2, 4), "model.layers.1.self_attn.", "F32"},
      {"llama", head(32, 4, 1, 8), "model.layers.0.self_attn.", "BF16"},
  };
  uint64_t seed = 11;
  for (const LayoutCase& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.layout, " ", c.prefix, " ", c.dtype));
    absl::StatusOr<CheckpointConfig> config = ParseCheckpointConfig(ConfigJson(c), "config.json");
    ASSERT_THAT(config, IsOk());
    EXPECT_EQ(WeightLayoutName(config->layout), c.layout);
    EXPECT_EQ(config->causal, c.layout == "gpt2" || c.layout == "llama");
    const HeadConfig& h = config->head_config;
    AttentionWeights expected = SeededWeights(h, seed++);
    if (c.layout == "llama") {  // no biases
      for (auto* b : {&expected.b_q, &expected.b_k, &expected.b_v, &expected.b_o}) {
        std::fill(b->begin(), b->end(), 0.0f);
      }
    }
    const std::string path = TempPath("layout.safetensors");
    WriteLayout(c, h, expected).Write(path);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_THAT(file, IsOk());
    absl::StatusOr<AttentionWeights> loaded = LoadCheckpointWeights(*file, *config);
    ASSERT_THAT(loaded, IsOk());
    auto same = [&](const std::vector<float>& got, const std::vector<float>& want, const char* n) {
      ASSERT_EQ(got.size(), want.size()) << n;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], Rounded(want[i], c.dtype)) << n << "[" << i << "]";
      }
    };
    same(loaded->w_q, expected.w_q, "w_q");
    same(loaded->b_q, expected.b_q, "b_q");
    same(loaded->w_k, expected.w_k, "w_k");
    same(loaded->b_k, expected.b_k, "b_k");
    same(loaded->w_v, expected.w_v, "w_v");
    same(loaded->b_v, expected.b_v, "b_v");
    same(loaded->w_o, expected.w_o, "w_o");
    same(loaded->b_o, expected.b_o, "b_o");
    EXPECT_THAT(ValidateWeights(h, *loaded), IsOk());
    ::unlink(path.c_str());
  }
}

TEST(CheckpointLayouts, MissingAndMisShapedTensorsAreNamed) {
  LayoutCase c{"bert", {}, "encoder.layer.3.attention.", "F32"};
  c.head.d_model = 8;
  c.head.num_heads = 2;
  absl::StatusOr<CheckpointConfig> config = ParseCheckpointConfig(ConfigJson(c), "config.json");
  ASSERT_THAT(config, IsOk());
  const AttentionWeights w = SeededWeights(config->head_config, 1);
  const std::string path = TempPath("shapes.safetensors");

  // Another layer's prefix: the tensor the config asks for is missing.
  LayoutCase other = c;
  other.prefix = "encoder.layer.2.attention.";
  WriteLayout(other, config->head_config, w).Write(path);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_THAT(LoadCheckpointWeights(*file, *config),
              StatusIs(absl::StatusCode::kNotFound,
                       "no tensor named 'encoder.layer.3.attention.self.query.weight'"));

  // A checkpoint of another width: the shape is named.
  LayoutCase wide = c;
  wide.head.d_model = 12;
  absl::StatusOr<CheckpointConfig> wide_config = ParseCheckpointConfig(ConfigJson(wide), "c");
  ASSERT_THAT(wide_config, IsOk());
  WriteLayout(c, wide_config->head_config, SeededWeights(wide_config->head_config, 1)).Write(path);
  file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_THAT(LoadCheckpointWeights(*file, *config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "tensor 'encoder.layer.3.attention.self.query.weight' has shape [12, 12]; "
                       "the head configuration needs [8, 8]"));

  // A non-finite weight.
  AttentionWeights bad = w;
  bad.b_v[1] = std::nanf("");
  WriteLayout(c, config->head_config, bad).Write(path);
  file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  EXPECT_THAT(LoadCheckpointWeights(*file, *config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "tensor 'encoder.layer.3.attention.self.value.bias' element 1 is not finite"));
  ::unlink(path.c_str());
}

TEST(CheckpointLayouts, ConfigMistakesNameTheField) {
  struct Case {
    std::string json;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"not json", "not valid JSON"},
      {"[1]", "not a JSON object"},
      {"{\"d_model\":8,\"num_heads\":2}", "layout: required"},
      {"{\"layout\":\"t5\",\"d_model\":8,\"num_heads\":2}", "layout: 't5' is not one of"},
      {"{\"layout\":\"bert\",\"num_heads\":2}", "d_model: required"},
      {"{\"layout\":\"bert\",\"d_model\":8,\"num_heads\":3}", "does not divide d_model"},
      {"{\"layout\":\"bert\",\"d_model\":8,\"num_heads\":2,\"heads\":2}", "heads: unknown field"},
      {"{\"layout\":\"bert\",\"d_model\":8,\"num_heads\":2,\"weights\":\"../x.safetensors\"}",
       "weights: must be a plain file name"},
      {"{\"layout\":\"bert\",\"d_model\":8,\"num_heads\":2,\"causal\":1}", "causal: must be true or false"},
      {"{\"layout\":\"gpt2\",\"d_model\":8,\"num_heads\":2,\"num_kv_heads\":1}",
       "layout gpt2 needs num_heads x head_dim = num_kv_heads x head_dim = d_model"},
      {"{\"layout\":\"llama\",\"d_model\":8,\"num_heads\":2,\"rotary\":{\"dim\":3}}",
       "rotary_dim: must be even"},
      // layers: one model per layer of one checkpoint.
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":3})", "layers: must be {"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":0,"prefix":"h.{layer}."}})",
       "layers.count: must be an integer in [1, 1024], got 0"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":-2,"prefix":"h.{layer}."}})",
       "layers.count: must be an integer in [1, 1024], got -2"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":1025,"prefix":"h.{layer}."}})",
       "layers.count: must be an integer in [1, 1024], got 1025"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":99999999999999999999,"prefix":"h.{layer}."}})",
       "layers.count: must be an integer"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2.5,"prefix":"h.{layer}."}})",
       "layers.count: must be an integer"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":"12","prefix":"h.{layer}."}})",
       "layers.count: must be an integer"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"prefix":"h.{layer}."}})",
       "layers.count: required"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2}})",
       "layers.prefix: required with layers.count, holding {layer}"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2,"prefix":"h.0.attn."}})",
       "layers.prefix: 'h.0.attn.' does not hold {layer}"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2,"prefix":"h.{Layer}."}})",
       "layers.prefix: 'h.{Layer}.' does not hold {layer}"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2,"prefix":7}})",
       "layers.prefix: must be a string"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2,"prefix":"h.{layer}.","first":1}})",
       "layers.first: unknown field (known: count, prefix, prefixes)"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2,"prefixes":["a.","b."]}})",
       "layers: give count and prefix, or prefixes, not both"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"prefixes":[]}})",
       "layers.prefixes: must be a list of 1 to 1024"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"prefixes":["a.",3]}})",
       "layers.prefixes[1]: must be a string"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"prefixes":["a.","b.","a."]}})",
       "layers.prefixes[2]: the same as layers.prefixes[0]"},
      {R"({"layout":"gpt2","d_model":8,"num_heads":2,"prefix":"h.0.","layers":{"count":2,"prefix":"h.{layer}."}})",
       "prefix: not with layers"},
      // Layers 0..9 take 1024 bytes, layer 10 one more.
      {absl::StrCat(R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":11,"prefix":")",
                    std::string(1023, 'x'), R"({layer}"}})"),
       "layers.prefix: layer 10's prefix is longer than 1024 bytes"},
      {absl::StrCat(R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"prefixes":["a.",")",
                    std::string(1025, 'x'), R"("]}})"),
       "layers.prefixes[1]: longer than 1024 bytes"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    EXPECT_THAT(ParseCheckpointConfig(c.json, "m/config.json"),
                StatusIs(absl::StatusCode::kInvalidArgument, c.reason));
  }
}

// "layers": {count, prefix} gives one prefix per layer, {layer} replaced by
// 0..count-1 (everywhere it appears); {prefixes} lists them. Every other field
// is shared; LayerOfCheckpoint picks one layer's config.
TEST(CheckpointLayouts, LayersGiveEachLayerItsOwnPrefix) {
  absl::StatusOr<CheckpointConfig> counted = ParseCheckpointConfig(
      R"({"layout":"gpt2","d_model":8,"num_heads":2,"weights":"w.safetensors",
          "layers":{"count":12,"prefix":"transformer.h.{layer}.attn."}})",
      "gpt2/config.json");
  ASSERT_THAT(counted, IsOk());
  ASSERT_EQ(counted->layer_prefixes.size(), 12u);
  EXPECT_EQ(counted->layer_prefixes[0], "transformer.h.0.attn.");
  EXPECT_EQ(counted->layer_prefixes[11], "transformer.h.11.attn.");
  EXPECT_EQ(counted->prefix, "");
  absl::StatusOr<CheckpointConfig> picked = LayerOfCheckpoint(*counted, 7);
  ASSERT_THAT(picked, IsOk());
  const CheckpointConfig& layer7 = *picked;
  // Past the layers (or of a config of one layer) is an error, not the shared prefix.
  EXPECT_THAT(LayerOfCheckpoint(*counted, 12),
              StatusIs(absl::StatusCode::kInvalidArgument, "layer 12: the config describes 12"));
  CheckpointConfig one_layer = *counted;
  one_layer.layer_prefixes.clear();
  EXPECT_THAT(LayerOfCheckpoint(one_layer, 0), StatusIs(absl::StatusCode::kInvalidArgument, ""));
  EXPECT_EQ(layer7.prefix, "transformer.h.7.attn.");
  EXPECT_TRUE(layer7.layer_prefixes.empty());
  EXPECT_EQ(layer7.weights, "w.safetensors");
  EXPECT_EQ(layer7.head_config.d_model, 8);
  EXPECT_TRUE(layer7.causal);

  absl::StatusOr<CheckpointConfig> twice = ParseCheckpointConfig(
      R"({"layout":"bert","d_model":8,"num_heads":2,
          "layers":{"count":2,"prefix":"l{layer}.x{layer}."}})",
      "c");
  ASSERT_THAT(twice, IsOk());
  EXPECT_EQ(twice->layer_prefixes, (std::vector<std::string>{"l0.x0.", "l1.x1."}));

  absl::StatusOr<CheckpointConfig> listed = ParseCheckpointConfig(
      R"({"layout":"bert","d_model":8,"num_heads":2,
          "layers":{"prefixes":["encoder.layer.0.attention.","decoder.layer.0.attention.",""]}})",
      "c");
  ASSERT_THAT(listed, IsOk());
  EXPECT_EQ(listed->layer_prefixes,
            (std::vector<std::string>{"encoder.layer.0.attention.", "decoder.layer.0.attention.",
                                      ""}));

  absl::StatusOr<CheckpointConfig> single =
      ParseCheckpointConfig(R"({"layout":"bert","d_model":8,"num_heads":2,"prefix":"a."})", "c");
  ASSERT_THAT(single, IsOk());
  EXPECT_TRUE(single->layer_prefixes.empty());
}

// A config of several layers is read one layer at a time: the whole config
// is refused by the readers (it has no one prefix).
TEST(CheckpointLayouts, AConfigOfSeveralLayersIsReadOneLayerAtATime) {
  LayoutCase c{"gpt2", {}, "h.1.attn.", "F32"};
  c.head.d_model = 8;
  c.head.num_heads = 2;
  const HeadConfig h = *ResolveHeadConfig(c.head);
  const AttentionWeights w = SeededWeights(h, 3);
  const std::string path = TempPath("layers.safetensors");
  WriteLayout(c, h, w).Write(path);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  absl::StatusOr<CheckpointConfig> config = ParseCheckpointConfig(
      R"({"layout":"gpt2","d_model":8,"num_heads":2,"layers":{"count":2,"prefix":"h.{layer}.attn."}})",
      "c");
  ASSERT_THAT(config, IsOk());
  EXPECT_THAT(LoadCheckpointWeights(*file, *config),
              StatusIs(absl::StatusCode::kInvalidArgument, "describes 2 layers"));
  EXPECT_THAT(LoadCheckpointWeights(*file, *LayerOfCheckpoint(*config, 0)),
              StatusIs(absl::StatusCode::kNotFound, "h.0.attn.c_attn.weight"));
  absl::StatusOr<AttentionWeights> one = LoadCheckpointWeights(*file, *LayerOfCheckpoint(*config, 1));
  ASSERT_THAT(one, IsOk());
  EXPECT_EQ(one->w_q, w.w_q);
  EXPECT_EQ(one->b_o, w.b_o);
}

}  // namespace
}  // namespace attnserve::core
