// AttendRequestFromInfer: every input, parameter and output name of the Open
// Inference Protocol's ModelInferRequest lands in the attnserve.v1 field it
// stands for, from raw and from typed contents, and each malformed request is
// refused with the code and the protocol's field in the message.
#include "server/api/open_inference/infer_request.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::server::open_inference {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using Input = inference::ModelInferRequest::InferInputTensor;

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  std::string bytes(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<float> RandomFloats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> values(n);
  for (float& v : values) v = dist(rng);
  return values;
}

Input* AddInput(inference::ModelInferRequest& r, const std::string& name,
                const std::string& datatype, std::vector<int64_t> shape) {
  Input* input = r.add_inputs();
  input->set_name(name);
  input->set_datatype(datatype);
  for (int64_t d : shape) input->add_shape(d);
  return input;
}

// A request for model "m" with hidden_states [2, 3, 4] of `states`, raw or typed.
inference::ModelInferRequest StatesRequest(const std::vector<float>& states, bool raw) {
  inference::ModelInferRequest r;
  r.set_model_name("m");
  Input* input = AddInput(r, kHiddenStates, "FP32", {2, 3, 4});
  if (raw) {
    r.add_raw_input_contents(Bytes(states));
  } else {
    for (float v : states) input->mutable_contents()->add_fp32_contents(v);
  }
  return r;
}

struct Translated {
  absl::Status status;
  v1::AttendRequest request;
  InferReplyForm form;
};

// Translates a copy of `r` (the translation moves raw contents out of it).
Translated Translate(inference::ModelInferRequest r) {
  Translated t;
  t.status = AttendRequestFromInfer(&r, &t.request, &t.form);
  return t;
}

TEST(InferRequest, RawFp32StatesBecomeRawDataAndTheReplyIsRaw) {
  const std::vector<float> states = RandomFloats(24, 1);
  Translated t = Translate(StatesRequest(states, /*raw=*/true));
  ASSERT_THAT(t.status, IsOk());
  EXPECT_EQ(t.request.model(), "m");
  EXPECT_EQ(t.request.hidden_states().dtype(), v1::DATA_TYPE_FP32);
  EXPECT_THAT(t.request.hidden_states().shape(), ElementsAre(2, 3, 4));
  EXPECT_EQ(t.request.hidden_states().raw_data(), Bytes(states));
  EXPECT_EQ(t.request.hidden_states().float_data_size(), 0);
  EXPECT_TRUE(t.form.raw);
  EXPECT_THAT(t.form.outputs, ElementsAre("output"));
  EXPECT_EQ(t.request.attention_maps().mode(), v1::ATTENTION_MAP_MODE_NONE);
}

TEST(InferRequest, TypedFp32StatesBecomeFloatDataAndTheReplyIsTyped) {
  const std::vector<float> states = RandomFloats(24, 2);
  Translated t = Translate(StatesRequest(states, /*raw=*/false));
  ASSERT_THAT(t.status, IsOk());
  EXPECT_THAT(t.request.hidden_states().float_data(), ElementsAreArray(states));
  EXPECT_TRUE(t.request.hidden_states().raw_data().empty());
  EXPECT_FALSE(t.form.raw);
}

TEST(InferRequest, Bf16StatesTravelRawAsBf16) {
  inference::ModelInferRequest r;
  r.set_model_name("m");
  AddInput(r, kHiddenStates, "BF16", {1, 2, 2});
  const std::vector<uint16_t> words = {0x3f80, 0xbf80, 0x4000, 0x0001};
  r.add_raw_input_contents(Bytes(words));
  Translated t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_EQ(t.request.hidden_states().dtype(), v1::DATA_TYPE_BF16);
  EXPECT_EQ(t.request.hidden_states().raw_data(), Bytes(words));
}

TEST(InferRequest, LengthsOffsetsAndMapSelectionsFromInt32AndInt64RawAndTyped) {
  for (bool raw : {true, false}) {
    for (const std::string type : {"INT32", "INT64"}) {
      SCOPED_TRACE(type + (raw ? " raw" : " typed"));
      inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 3), raw);
      const std::vector<std::pair<std::string, std::vector<int64_t>>> ints = {
          {kSequenceLengths, {3, 1}},
          {kContextLengths, {2, 5}},
          {kPositionOffsets, {7, 0}},
          {kAttentionMapHeads, {1, 0}},
          {kAttentionMapRows, {2}}};
      for (const auto& [name, values] : ints) {
        Input* input = AddInput(r, name, type, {static_cast<int64_t>(values.size())});
        if (raw) {
          if (type == "INT32") {
            r.add_raw_input_contents(Bytes(std::vector<int32_t>(values.begin(), values.end())));
          } else {
            r.add_raw_input_contents(Bytes(values));
          }
        } else {
          for (int64_t v : values) {
            if (type == "INT32")
              input->mutable_contents()->add_int_contents(static_cast<int32_t>(v));
            else
              input->mutable_contents()->add_int64_contents(v);
          }
        }
      }
      r.add_outputs()->set_name(kAttentionMaps);
      Translated t = Translate(r);
      ASSERT_THAT(t.status, IsOk());
      EXPECT_THAT(t.request.sequence_lengths(), ElementsAre(3, 1));
      EXPECT_THAT(t.request.context_lengths(), ElementsAre(2, 5));
      EXPECT_THAT(t.request.position_offsets(), ElementsAre(7, 0));
      EXPECT_THAT(t.request.attention_maps().heads(), ElementsAre(1, 0));
      EXPECT_THAT(t.request.attention_maps().query_rows(), ElementsAre(2));
    }
  }
}

TEST(InferRequest, ContextBecomesCrossAttentionStates) {
  for (bool raw : {true, false}) {
    inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 4), raw);
    const std::vector<float> context = RandomFloats(2 * 5 * 4, 5);
    Input* input = AddInput(r, kContext, "FP32", {2, 5, 4});
    if (raw) {
      r.add_raw_input_contents(Bytes(context));
    } else {
      for (float v : context) input->mutable_contents()->add_fp32_contents(v);
    }
    Translated t = Translate(r);
    ASSERT_THAT(t.status, IsOk());
    EXPECT_THAT(t.request.context().shape(), ElementsAre(2, 5, 4));
    if (raw) {
      EXPECT_EQ(t.request.context().raw_data(), Bytes(context));
    } else {
      EXPECT_THAT(t.request.context().float_data(), ElementsAreArray(context));
    }
  }
}

TEST(InferRequest, BoolMaskIsAllowedAndFloatMaskAdditiveUnlessMaskKindSays) {
  // BOOL, typed: one byte per element, KIND_ALLOWED.
  inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 6), /*raw=*/false);
  Input* mask = AddInput(r, kMask, "BOOL", {1, 3, 3});
  const std::vector<bool> allowed = {true, false, false, true, true, false, true, true, true};
  for (bool b : allowed) mask->mutable_contents()->add_bool_contents(b);
  Translated t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_EQ(t.request.mask().kind(), v1::AttentionMask::KIND_ALLOWED);
  EXPECT_EQ(t.request.mask().values().dtype(), v1::DATA_TYPE_BOOL);
  EXPECT_EQ(t.request.mask().values().raw_data(), std::string("\1\0\0\1\1\0\1\1\1", 9));
  EXPECT_THAT(t.request.mask().values().shape(), ElementsAre(1, 3, 3));

  // FP32, raw: KIND_ADDITIVE by default, KIND_ALLOWED with mask_kind.
  for (const char* kind : {"", "allowed"}) {
    inference::ModelInferRequest fr = StatesRequest(RandomFloats(24, 7), /*raw=*/true);
    AddInput(fr, kMask, "FP32", {2, 1, 3});
    const std::vector<float> values = {0, -1, -INFINITY, 0, 0, -2};
    fr.add_raw_input_contents(Bytes(values));
    if (*kind != '\0') (*fr.mutable_parameters())["mask_kind"].set_string_param(kind);
    Translated ft = Translate(fr);
    ASSERT_THAT(ft.status, IsOk());
    EXPECT_EQ(ft.request.mask().kind(),
              *kind == '\0' ? v1::AttentionMask::KIND_ADDITIVE : v1::AttentionMask::KIND_ALLOWED);
    EXPECT_EQ(ft.request.mask().values().raw_data(), Bytes(values));
  }
}

TEST(InferRequest, HeadMaskFromFp32OrBoolRawOrTyped) {
  for (bool raw : {true, false}) {
    inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 8), raw);
    Input* gate = AddInput(r, kHeadMask, "BOOL", {3});
    if (raw) {
      r.add_raw_input_contents(std::string("\1\0\7", 3));
    } else {
      for (bool b : {true, false, true}) gate->mutable_contents()->add_bool_contents(b);
    }
    Translated t = Translate(r);
    ASSERT_THAT(t.status, IsOk());
    EXPECT_THAT(t.request.head_mask(), ElementsAre(1.0f, 0.0f, 1.0f));

    inference::ModelInferRequest fr = StatesRequest(RandomFloats(24, 9), raw);
    Input* fgate = AddInput(fr, kHeadMask, "FP32", {2});
    const std::vector<float> gates = {0.25f, 0.0f};
    if (raw) {
      fr.add_raw_input_contents(Bytes(gates));
    } else {
      for (float g : gates) fgate->mutable_contents()->add_fp32_contents(g);
    }
    Translated ft = Translate(fr);
    ASSERT_THAT(ft.status, IsOk());
    EXPECT_THAT(ft.request.head_mask(), ElementsAre(0.25f, 0.0f));
  }
}

TEST(InferRequest, ParametersSetCausalPrecisionAndOutputDtype) {
  inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 10), /*raw=*/false);
  auto& p = *r.mutable_parameters();
  p["causal"].set_bool_param(true);
  p["precision"].set_string_param("bf16");
  p["output_dtype"].set_string_param("BF16");
  r.set_id("req-7");
  Translated t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_TRUE(t.request.causal());
  EXPECT_EQ(t.request.precision(), v1::PRECISION_BF16);
  EXPECT_EQ(t.request.output_dtype(), v1::DATA_TYPE_BF16);
  EXPECT_EQ(t.form.id, "req-7");
  // BF16 values have no typed field: a typed request gets them raw.
  EXPECT_TRUE(t.form.raw);

  p["precision"].set_string_param("fp32");
  p["output_dtype"].set_string_param("FP32");
  p["causal"].set_bool_param(false);
  t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_FALSE(t.request.causal());
  EXPECT_EQ(t.request.precision(), v1::PRECISION_FP32);
  EXPECT_EQ(t.request.output_dtype(), v1::DATA_TYPE_FP32);
  EXPECT_FALSE(t.form.raw);
}

TEST(InferRequest, OutputsNamedInOrderChooseMapsAndStatistics) {
  inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 11), /*raw=*/true);
  for (const char* name :
       {kHeadEntropy, kAttentionMaps, kOutput, kHeadMaxWeight, kHeadContribution}) {
    r.add_outputs()->set_name(name);
  }
  Translated t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_THAT(t.form.outputs, ElementsAre("head_entropy", "attention_maps", "output",
                                          "head_max_weight", "head_contribution"));
  EXPECT_EQ(t.request.attention_maps().mode(), v1::ATTENTION_MAP_MODE_PER_HEAD);
  EXPECT_TRUE(t.request.attention_maps().head_statistics());

  (*r.mutable_parameters())["attention_maps"].set_string_param("mean");
  t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_EQ(t.request.attention_maps().mode(), v1::ATTENTION_MAP_MODE_MEAN);

  // Only maps named: no output tensor asked for, no statistics computed.
  inference::ModelInferRequest maps_only = StatesRequest(RandomFloats(24, 12), true);
  maps_only.add_outputs()->set_name(kAttentionMaps);
  t = Translate(maps_only);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_THAT(t.form.outputs, ElementsAre("attention_maps"));
  EXPECT_FALSE(t.request.attention_maps().head_statistics());
}

TEST(InferRequest, ModelVersionEmptyOrOneOnly) {
  inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 13), true);
  for (const char* version : {"", "1"}) {
    r.set_model_version(version);
    EXPECT_THAT(Translate(r).status, IsOk()) << version;
  }
  r.set_model_version("2");
  Translated t = Translate(r);
  EXPECT_THAT(t.status, StatusIs(absl::StatusCode::kNotFound, "model_version: "));
  EXPECT_EQ(t.request.model(), "m");  // the call is still labelled with its model
}

// A refusal: how to spoil a good raw request, the code and message expected.
struct Refusal {
  std::string name;
  std::function<void(inference::ModelInferRequest&)> spoil;
  absl::StatusCode code;
  std::string message;
};

TEST(InferRequest, EachMalformedRequestIsRefusedNamingTheProtocolsField) {
  using absl::StatusCode;
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  auto add_raw = [](inference::ModelInferRequest& r, const std::string& name,
                    const std::string& type, std::vector<int64_t> shape, std::string bytes) {
    AddInput(r, name, type, std::move(shape));
    r.add_raw_input_contents(std::move(bytes));
  };
  const std::vector<Refusal> refusals = {
      {"no model", [](auto& r) { r.clear_model_name(); }, kInvalid, "model_name: required"},
      {"wrong datatype", [](auto& r) { r.mutable_inputs(0)->set_datatype("FP16"); }, kInvalid,
       "inputs[0] (hidden_states).datatype: 'FP16' is not accepted; hidden_states takes FP32 or "
       "BF16"},
      {"wrong rank", [](auto& r) { r.mutable_inputs(0)->add_shape(1); }, kInvalid,
       "inputs[0] (hidden_states).shape: has 4 dimensions"},
      {"zero dimension", [](auto& r) { r.mutable_inputs(0)->set_shape(1, 0); }, kInvalid,
       "inputs[0] (hidden_states).shape[1]: is 0"},
      {"raw size", [](auto& r) { r.mutable_raw_input_contents(0)->pop_back(); }, kInvalid,
       "raw_input_contents[0]: has 95 bytes; inputs[0] (hidden_states) (FP32, shape [2, 3, 4]) "
       "needs 96"},
      {"raw and typed together",
       [](auto& r) { r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); }, kInvalid,
       "inputs[0] (hidden_states).contents: set while raw_input_contents is used"},
      {"raw count", [&](auto& r) { AddInput(r, kHeadMask, "FP32", {3}); }, kInvalid,
       "raw_input_contents: has 1 entries for 2 inputs"},
      {"missing hidden_states",
       [&](auto& r) {
         r.clear_inputs();
         r.clear_raw_input_contents();
         add_raw(r, kHeadMask, "FP32", {1}, Bytes(std::vector<float>{1}));
       },
       kInvalid, "inputs: hidden_states is required"},
      {"unknown input", [&](auto& r) { add_raw(r, "query", "FP32", {1}, std::string(4, '\0')); },
       kInvalid, "inputs[1].name: unknown input 'query'"},
      {"input twice",
       [&](auto& r) {
         add_raw(r, kHiddenStates, "FP32", {1, 1, 1}, std::string(4, '\0'));
       },
       kInvalid, "inputs[1].name: 'hidden_states' given twice"},
      {"input parameter",
       [](auto& r) { (*r.mutable_inputs(0)->mutable_parameters())["x"].set_bool_param(true); },
       kInvalid, "inputs[0] (hidden_states).parameters.x: unknown per-tensor parameter"},
      {"input parameters, the first in sorted order named",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         for (const char* key : {"zeta", "beta", "content_type", "gamma"}) p[key].set_bool_param(true);
       },
       kInvalid, "inputs[0] (hidden_states).parameters.beta: unknown per-tensor parameter"},
      {"negative dimension", [](auto& r) { r.mutable_inputs(0)->set_shape(2, -4); }, kInvalid,
       "inputs[0] (hidden_states).shape[2]: is -4; every dimension must be positive"},
      {"INT64_MAX dimension",
       [](auto& r) { r.mutable_inputs(0)->set_shape(0, INT64_MAX); }, kInvalid,
       "inputs[0] (hidden_states).shape: has too many elements"},
      {"element count overflowing int64",
       [](auto& r) {
         r.mutable_inputs(0)->set_shape(0, int64_t{1} << 30);
         r.mutable_inputs(0)->set_shape(1, int64_t{1} << 30);
         r.mutable_inputs(0)->set_shape(2, int64_t{1} << 30);
       },
       kInvalid, "inputs[0] (hidden_states).shape: has too many elements"},
      {"id over 256 bytes", [](auto& r) { r.set_id(std::string(257, 'i')); }, kInvalid,
       "id: has 257 bytes; at most 256"},
      {"lengths as float",
       [&](auto& r) { add_raw(r, kSequenceLengths, "FP32", {2}, std::string(8, 0)); }, kInvalid,
       "inputs[1] (sequence_lengths).datatype: 'FP32' is not accepted"},
      {"head mask of rank 2",
       [&](auto& r) {
         add_raw(r, kHeadMask, "FP32", {1, 2}, std::string(8, 0));
       },
       kInvalid, "inputs[1] (head_mask).shape: has 2 dimensions; head_mask has 1"},
      {"map heads beyond int32",
       [&](auto& r) {
         add_raw(r, kAttentionMapHeads, "INT64", {1}, Bytes(std::vector<int64_t>{1LL << 40}));
       },
       kInvalid, "inputs[1] (attention_map_heads): value 1099511627776 is outside INT32's range"},
      {"unknown parameter",
       [](auto& r) { (*r.mutable_parameters())["temperature"].set_double_param(1); }, kInvalid,
       "parameters.temperature: unknown parameter"},
      {"unknown parameters, the first in sorted order named",
       [](auto& r) {
         auto& p = *r.mutable_parameters();
         for (const char* key : {"top_p", "causal", "seed", "alpha", "temperature"}) {
           p[key].set_bool_param(true);
         }
       },
       kInvalid, "parameters.alpha: unknown parameter"},
      {"causal as string",
       [](auto& r) { (*r.mutable_parameters())["causal"].set_string_param("true"); }, kInvalid,
       "parameters.causal: must be a bool_param"},
      {"precision as bool",
       [](auto& r) { (*r.mutable_parameters())["precision"].set_bool_param(true); }, kInvalid,
       "parameters.precision: must be a string_param"},
      {"unknown precision",
       [](auto& r) { (*r.mutable_parameters())["precision"].set_string_param("fp16"); }, kInvalid,
       "parameters.precision: 'fp16'; takes fp32 or bf16"},
      {"unknown output dtype",
       [](auto& r) { (*r.mutable_parameters())["output_dtype"].set_string_param("fp32"); },
       kInvalid, "parameters.output_dtype: 'fp32'; takes FP32 or BF16"},
      {"unknown map mode",
       [](auto& r) { (*r.mutable_parameters())["attention_maps"].set_string_param("all"); },
       kInvalid, "parameters.attention_maps: 'all'; takes none, per_head or mean"},
      {"map mode without the output named",
       [](auto& r) { (*r.mutable_parameters())["attention_maps"].set_string_param("mean"); },
       kInvalid,
       "parameters.attention_maps: 'mean' asks for maps, but outputs does not name attention_maps"},
      {"maps named with mode none",
       [](auto& r) {
         (*r.mutable_parameters())["attention_maps"].set_string_param("none");
         r.add_outputs()->set_name(kAttentionMaps);
       },
       kInvalid, "parameters.attention_maps: 'none', but outputs names attention_maps"},
      {"mask kind without a mask",
       [](auto& r) { (*r.mutable_parameters())["mask_kind"].set_string_param("allowed"); },
       kInvalid, "parameters.mask_kind: given without a mask input"},
      {"unknown mask kind",
       [&](auto& r) {
         add_raw(r, kMask, "FP32", {1, 1, 1}, std::string(4, 0));
         (*r.mutable_parameters())["mask_kind"].set_string_param("forbidden");
       },
       kInvalid, "parameters.mask_kind: 'forbidden'; takes allowed or additive"},
      {"unknown output", [](auto& r) { r.add_outputs()->set_name("logits"); }, kInvalid,
       "outputs[0].name: unknown output 'logits'"},
      {"output twice",
       [](auto& r) {
         r.add_outputs()->set_name(kOutput);
         r.add_outputs()->set_name(kOutput);
       },
       kInvalid, "outputs[1].name: 'output' named twice"},
      {"output parameter",
       [](auto& r) {
         auto* out = r.add_outputs();
         out->set_name(kOutput);
         (*out->mutable_parameters())["classification"].set_int64_param(3);
       },
       kInvalid, "outputs[0] (output).parameters.classification: unknown per-tensor parameter"},
      {"unknown version", [](auto& r) { r.set_model_version("latest"); }, StatusCode::kNotFound,
       "model_version: model 'm' has no version 'latest'"},
  };
  for (const Refusal& refusal : refusals) {
    SCOPED_TRACE(refusal.name);
    inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 14), /*raw=*/true);
    refusal.spoil(r);
    EXPECT_THAT(Translate(r).status, StatusIs(refusal.code, refusal.message));
  }
}

TEST(InferRequest, ContentTypeOfATensorIsAcceptedAndIgnored) {
  const std::vector<float> states = RandomFloats(24, 19);
  inference::ModelInferRequest r = StatesRequest(states, /*raw=*/true);
  (*r.mutable_inputs(0)->mutable_parameters())[kContentType].set_string_param("np");
  auto* out = r.add_outputs();
  out->set_name(kOutput);
  (*out->mutable_parameters())[kContentType].set_string_param("np");
  const Translated t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_EQ(t.request.hidden_states().raw_data(), Bytes(states));
  EXPECT_THAT(t.form.outputs, ElementsAre(kOutput));
}

TEST(InferRequest, IdOf256BytesIsEchoed) {
  inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 20), /*raw=*/true);
  r.set_id(std::string(256, 'i'));
  const Translated t = Translate(r);
  ASSERT_THAT(t.status, IsOk());
  EXPECT_EQ(t.form.id, std::string(256, 'i'));
}

// Callers' strings are cut in messages: a 1 MB name, datatype, parameter key
// or value, or version makes a short message that still names the field.
TEST(InferRequest, CallersStringsAreAbbreviatedInMessages) {
  const std::string huge(1 << 20, 'q');
  const std::vector<std::pair<std::string, std::function<void(inference::ModelInferRequest&)>>>
      cases = {
          {"inputs[1].name: unknown input 'qqq",
           [&](auto& r) {
             AddInput(r, huge, "FP32", {1});
             r.add_raw_input_contents(std::string(4, '\0'));
           }},
          {"inputs[0] (hidden_states).datatype: 'qqq",
           [&](auto& r) { r.mutable_inputs(0)->set_datatype(huge); }},
          {"parameters.qqq", [&](auto& r) { (*r.mutable_parameters())[huge].set_bool_param(true); }},
          {"parameters.precision: 'qqq",
           [&](auto& r) { (*r.mutable_parameters())["precision"].set_string_param(huge); }},
          {"inputs[0] (hidden_states).parameters.qqq",
           [&](auto& r) {
             (*r.mutable_inputs(0)->mutable_parameters())[huge].set_bool_param(true);
           }},
          {"outputs[0].name: unknown output 'qqq", [&](auto& r) { r.add_outputs()->set_name(huge); }},
          {"model_version: model 'm' has no version 'qqq",
           [&](auto& r) { r.set_model_version(huge); }},
      };
  for (const auto& [message, spoil] : cases) {
    SCOPED_TRACE(message);
    inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 21), /*raw=*/true);
    spoil(r);
    const absl::Status status = Translate(r).status;
    const absl::StatusCode code = absl::StartsWith(message, "model_version")
                                      ? absl::StatusCode::kNotFound
                                      : absl::StatusCode::kInvalidArgument;
    EXPECT_THAT(status, StatusIs(code, message));
    EXPECT_LT(status.message().size(), 400u) << status.message().substr(0, 200);
  }
}

// The raw contents are moved into the attnserve.v1 request, not copied: the
// source entry is empty afterwards.
TEST(InferRequest, RawContentsAreMovedOutOfTheRequest) {
  const std::vector<float> states = RandomFloats(24, 22);
  inference::ModelInferRequest r = StatesRequest(states, /*raw=*/true);
  AddInput(r, kMask, "BOOL", {2, 3, 3});
  std::string mask(18, '\1');
  mask[4] = '\0';
  r.add_raw_input_contents(mask);
  v1::AttendRequest request;
  InferReplyForm form;
  ASSERT_THAT(AttendRequestFromInfer(&r, &request, &form), IsOk());
  EXPECT_EQ(request.hidden_states().raw_data(), Bytes(states));
  EXPECT_EQ(request.mask().values().raw_data(), mask);
  EXPECT_TRUE(r.raw_input_contents(0).empty());
  EXPECT_TRUE(r.raw_input_contents(1).empty());
}

TEST(InferRequest, TypedContentsRefusalsNameTheTypedField) {
  using absl::StatusCode;
  // Too few values in the typed field.
  inference::ModelInferRequest r = StatesRequest(RandomFloats(24, 15), /*raw=*/false);
  r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->RemoveLast();
  EXPECT_THAT(Translate(r).status,
              StatusIs(StatusCode::kInvalidArgument,
                       "inputs[0] (hidden_states).contents.fp32_contents: has 23 values; shape "
                       "[2, 3, 4] needs 24"));
  // Values in another datatype's field.
  r = StatesRequest(RandomFloats(24, 16), /*raw=*/false);
  r.mutable_inputs(0)->mutable_contents()->add_fp64_contents(1.0);
  EXPECT_THAT(Translate(r).status,
              StatusIs(StatusCode::kInvalidArgument,
                       "inputs[0] (hidden_states).contents: has values outside fp32_contents"));
  // BF16 has no typed field.
  r = StatesRequest(RandomFloats(24, 17), /*raw=*/false);
  r.mutable_inputs(0)->set_datatype("BF16");
  EXPECT_THAT(Translate(r).status,
              StatusIs(StatusCode::kInvalidArgument,
                       "inputs[0] (hidden_states).contents: BF16 values travel only in "
                       "raw_input_contents"));
  // INT32 lengths in int64_contents.
  r = StatesRequest(RandomFloats(24, 18), /*raw=*/false);
  Input* lengths = AddInput(r, kSequenceLengths, "INT32", {2});
  lengths->mutable_contents()->add_int64_contents(1);
  lengths->mutable_contents()->add_int64_contents(2);
  EXPECT_THAT(Translate(r).status,
              StatusIs(StatusCode::kInvalidArgument,
                       "inputs[1] (sequence_lengths).contents: has values outside int_contents"));
}

}  // namespace
}  // namespace attnserve::server::open_inference
