// The Open Inference Protocol's JSON <-> protobuf conversion, checked against
// fixtures transcribed from the specification's text
// (tests/data/open_inference/README.md) and, for FP32's exact round trip,
// against libc's strtof on fresh random values.
#include "server/http/open_inference_json.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/http/http_front.h"
#include "server/http/open_inference_rest.h"

namespace attnserve::server {
namespace {

using Json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string Fixture(const std::string& name) {
  std::ifstream file(std::string(ATTNSERVE_OPEN_INFERENCE_FIXTURES) + "/" + name);
  EXPECT_TRUE(file.good()) << name;
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The JSON type of every key, recursively through objects and the first
// element of arrays: what a schema fixes, values aside.
Json Schema(const Json& json) {
  if (json.is_object()) {
    Json out = Json::object();
    for (auto it = json.begin(); it != json.end(); ++it) out[it.key()] = Schema(it.value());
    return out;
  }
  if (json.is_array()) {
    return json.empty() ? Json::array() : Json::array({Schema(json[0])});
  }
  if (json.is_number()) return "number";
  return json.type_name();
}

TEST(OpenInferenceJson, SpecificationsExampleRequestIsRefusedAtItsInconsistentInput) {
  // The specification's example gives input1 shape [3] and one value.
  absl::StatusOr<inference::ModelInferRequest> request =
      InferRequestFromJson(Fixture("spec_inference_request.json"), "mymodel", "");
  ASSERT_EQ(request.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(request.status().message()),
              StartsWith("inputs[1].data: 1 value(s) for shape [3] (3 elements)"));
}

TEST(OpenInferenceJson, SpecificationsExampleRequestBecomesTheProtobufRequest) {
  absl::StatusOr<inference::ModelInferRequest> request =
      InferRequestFromJson(Fixture("spec_inference_request_consistent.json"), "mymodel", "");
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->model_name(), "mymodel");
  EXPECT_FALSE(request->has_model_version());
  EXPECT_EQ(request->id(), "42");
  ASSERT_EQ(request->inputs_size(), 2);
  const auto& input0 = request->inputs(0);
  EXPECT_EQ(input0.name(), "input0");
  EXPECT_EQ(input0.datatype(), "UINT32");
  EXPECT_THAT(input0.shape(), ElementsAre(2, 2));
  EXPECT_THAT(input0.contents().uint_contents(), ElementsAre(1u, 2u, 3u, 4u));
  const auto& input1 = request->inputs(1);
  EXPECT_EQ(input1.name(), "input1");
  EXPECT_EQ(input1.datatype(), "BOOL");
  EXPECT_THAT(input1.shape(), ElementsAre(3));
  EXPECT_THAT(input1.contents().bool_contents(), ElementsAre(true, false, true));
  ASSERT_EQ(request->outputs_size(), 1);
  EXPECT_EQ(request->outputs(0).name(), "output0");
  EXPECT_EQ(request->raw_input_contents_size(), 0);
}

TEST(OpenInferenceJson, SpecificationsNestedAndFlatDataAreTheSameTensor) {
  absl::StatusOr<inference::ModelInferRequest> nested =
      InferRequestFromJson(Fixture("spec_tensor_data_nested.json"), "m", "2");
  absl::StatusOr<inference::ModelInferRequest> flat =
      InferRequestFromJson(Fixture("spec_tensor_data_flat.json"), "m", "2");
  ASSERT_TRUE(nested.ok()) << nested.status();
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_THAT(nested->inputs(0).contents().int_contents(), ElementsAre(1, 2, 4, 5));
  EXPECT_EQ(nested->model_version(), "2");
  EXPECT_EQ(nested->SerializeAsString(), flat->SerializeAsString());
}

inference::ModelInferResponse SpecificationsResponse() {
  inference::ModelInferResponse response;
  response.set_model_name("mymodel");
  response.set_id("42");
  auto* output = response.add_outputs();
  output->set_name("output0");
  output->set_datatype("FP32");
  output->add_shape(3);
  output->add_shape(2);
  for (float v : {1.0f, 1.1f, 2.0f, 2.1f, 3.0f, 3.1f}) output->mutable_contents()->add_fp32_contents(v);
  return response;
}

TEST(OpenInferenceJson, SpecificationsExampleResponseIsWhatWeWrite) {
  absl::StatusOr<std::string> text = InferResponseToJson(SpecificationsResponse());
  ASSERT_TRUE(text.ok()) << text.status();
  const Json ours = Json::parse(*text);
  const Json spec = Json::parse(Fixture("spec_inference_response.json"));
  // Every field of the specification's example, with its value (its 1.1 is
  // the decimal we print for 1.1f: both read back as the same double).
  for (auto it = spec.begin(); it != spec.end(); ++it) {
    ASSERT_TRUE(ours.contains(it.key())) << it.key() << " in " << *text;
    EXPECT_EQ(ours[it.key()], it.value()) << it.key();
  }
  // And model_name, which the schema requires and the example leaves out.
  EXPECT_EQ(ours["model_name"], "mymodel");
  EXPECT_FALSE(ours.contains("model_version"));  // no versioning: not provided
  EXPECT_THAT(*text, HasSubstr("\"data\":[1,1.1,2,2.1,3,3.1]"));

  // The same outputs as raw_output_contents write the same text.
  inference::ModelInferResponse raw = SpecificationsResponse();
  std::string bytes;
  for (float v : raw.outputs(0).contents().fp32_contents()) {
    bytes.append(reinterpret_cast<const char*>(&v), 4);
  }
  raw.mutable_outputs(0)->clear_contents();
  raw.add_raw_output_contents(bytes);
  absl::StatusOr<std::string> raw_text = InferResponseToJson(raw);
  ASSERT_TRUE(raw_text.ok()) << raw_text.status();
  EXPECT_EQ(*raw_text, *text);
}

TEST(OpenInferenceJson, MetadataHasTheSpecificationsFields) {
  inference::ServerMetadataResponse server;
  server.set_name("attnserve");
  server.set_version("0.1.0");
  server.add_extensions("x");
  EXPECT_EQ(Schema(Json::parse(ServerMetadataToJson(server))),
            Schema(Json::parse(Fixture("spec_server_metadata.json"))));

  inference::ModelMetadataResponse model;
  model.set_name("builtin");
  model.add_versions("1");
  model.set_platform("attnserve");
  for (auto* t : {model.add_inputs(), model.add_outputs()}) {
    t->set_name("hidden_states");
    t->set_datatype("FP32");
    t->add_shape(-1);
    t->add_shape(768);
  }
  const Json ours = Json::parse(ModelMetadataToJson(model));
  EXPECT_EQ(Schema(ours), Schema(Json::parse(Fixture("spec_model_metadata.json"))));
  EXPECT_EQ(ours["inputs"][0]["shape"], Json::parse("[-1, 768]"));
  // "versions" is optional: left out when there are none.
  model.clear_versions();
  EXPECT_FALSE(Json::parse(ModelMetadataToJson(model)).contains("versions"));
}

TEST(OpenInferenceJson, ErrorBodyHasTheSpecificationsShapeAndEscapesTheMessage) {
  const std::string message = "inputs[0].name: \"</script><b>\"\n\\ \x01 \xff";
  const Json ours = Json::parse(JsonErrorBody(message));
  EXPECT_EQ(Schema(ours), Schema(Json::parse(Fixture("spec_error.json"))));
  // Escaped, never pasted: the text reads back (invalid UTF-8 replaced).
  EXPECT_THAT(ours["error"].get<std::string>(), StartsWith("inputs[0].name: \"</script><b>\"\n\\ \x01 "));
  EXPECT_THAT(JsonErrorBody(message), ::testing::Not(HasSubstr("\n")));
}

TEST(OpenInferenceJson, Fp32ValuesRoundTripBitForBitThroughTheText) {
  std::mt19937 rng(std::random_device{}());
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 0.1f, std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::denorm_min(), 3.4028235e38f,
                               1.17549421e-38f};
  while (values.size() < 20000) {
    const float f = FromBits(static_cast<uint32_t>(rng()));
    if (std::isfinite(f)) values.push_back(f);
  }
  inference::ModelInferResponse response;
  auto* output = response.add_outputs();
  output->set_name("output");
  output->set_datatype("FP32");
  output->add_shape(static_cast<int64_t>(values.size()));
  for (float v : values) output->mutable_contents()->add_fp32_contents(v);
  absl::StatusOr<std::string> text = InferResponseToJson(response);
  ASSERT_TRUE(text.ok()) << text.status();
  const Json json = Json::parse(*text);
  const Json& data = json["outputs"][0]["data"];
  ASSERT_EQ(data.size(), values.size());
  // Independent reader: libc's strtof of each printed number.
  const std::string list = text->substr(text->find("\"data\":[") + 8);
  const char* p = list.c_str();
  for (size_t i = 0; i < values.size(); ++i) {
    char* end = nullptr;
    const float read = std::strtof(p, &end);
    ASSERT_NE(end, p);
    ASSERT_EQ(Bits(read), Bits(values[i])) << i << ": " << std::string(p, static_cast<const char*>(end));
    p = end + 1;
  }
  // And our own reader, as a client would send the values back.
  Json request = {{"inputs", Json::array({Json{{"name", "x"},
                                               {"datatype", "FP32"},
                                               {"shape", Json::array({values.size()})},
                                               {"data", data}}})}};
  absl::StatusOr<inference::ModelInferRequest> parsed =
      InferRequestFromJson(request.dump(), "m", "");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const auto& back = parsed->inputs(0).contents().fp32_contents();
  ASSERT_EQ(back.size(), static_cast<int>(values.size()));
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(Bits(back[static_cast<int>(i)]), Bits(values[i])) << i;
  }
}

TEST(OpenInferenceJson, EveryAcceptedDatatypeConvertsAtItsExtremes) {
  const std::string body = R"({"inputs": [
    {"name": "b", "datatype": "BOOL", "shape": [2], "data": [true, false]},
    {"name": "i8", "datatype": "INT8", "shape": [2], "data": [-128, 127]},
    {"name": "i16", "datatype": "INT16", "shape": [2], "data": [-32768, 32767]},
    {"name": "i32", "datatype": "INT32", "shape": [2], "data": [-2147483648, 2147483647]},
    {"name": "i64", "datatype": "INT64", "shape": [2],
     "data": [-9223372036854775808, 9223372036854775807]},
    {"name": "u8", "datatype": "UINT8", "shape": [2], "data": [0, 255]},
    {"name": "u16", "datatype": "UINT16", "shape": [2], "data": [0, 65535]},
    {"name": "u32", "datatype": "UINT32", "shape": [2], "data": [0, 4294967295]},
    {"name": "u64", "datatype": "UINT64", "shape": [2], "data": [0, 18446744073709551615]},
    {"name": "f32", "datatype": "FP32", "shape": [1, 2], "data": [[3, -0.5]]},
    {"name": "f64", "datatype": "FP64", "shape": [2], "data": [0.1, -1e308]}]})";
  absl::StatusOr<inference::ModelInferRequest> r = InferRequestFromJson(body, "m", "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->inputs(0).contents().bool_contents(), ElementsAre(true, false));
  EXPECT_THAT(r->inputs(1).contents().int_contents(), ElementsAre(-128, 127));
  EXPECT_THAT(r->inputs(2).contents().int_contents(), ElementsAre(-32768, 32767));
  EXPECT_THAT(r->inputs(3).contents().int_contents(),
              ElementsAre(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()));
  EXPECT_THAT(r->inputs(4).contents().int64_contents(),
              ElementsAre(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
  EXPECT_THAT(r->inputs(5).contents().uint_contents(), ElementsAre(0u, 255u));
  EXPECT_THAT(r->inputs(6).contents().uint_contents(), ElementsAre(0u, 65535u));
  EXPECT_THAT(r->inputs(7).contents().uint_contents(), ElementsAre(0u, 4294967295u));
  EXPECT_THAT(r->inputs(8).contents().uint64_contents(),
              ElementsAre(0u, std::numeric_limits<uint64_t>::max()));
  EXPECT_THAT(r->inputs(9).contents().fp32_contents(), ElementsAre(3.0f, -0.5f));
  EXPECT_THAT(r->inputs(10).contents().fp64_contents(), ElementsAre(0.1, -1e308));
  EXPECT_EQ(r->raw_input_contents_size(), 0);
}

TEST(OpenInferenceJson, Bf16InputsSendEveryInputAsRawLittleEndianBytes) {
  // 0.1 reads as FP32 0x3dcccccd and rounds to BF16 0x3dcd; 1 and -3.5 are
  // BF16 values and pass unchanged; 1.00390625 (1 + 2^-8) is a tie and goes
  // to the even 0x3f80.
  const std::string body = R"({"inputs": [
    {"name": "x", "datatype": "BF16", "shape": [2, 2], "data": [[1, 0.1], [-3.5, 1.00390625]]},
    {"name": "n", "datatype": "INT32", "shape": [1], "data": [7]}]})";
  absl::StatusOr<inference::ModelInferRequest> r = InferRequestFromJson(body, "m", "");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->raw_input_contents_size(), 2);
  EXPECT_FALSE(r->inputs(0).has_contents());
  EXPECT_FALSE(r->inputs(1).has_contents());
  EXPECT_EQ(r->raw_input_contents(0), std::string("\x80\x3f\xcd\x3d\x60\xc0\x80\x3f", 8));
  EXPECT_EQ(r->raw_input_contents(1), std::string("\x07\x00\x00\x00", 4));
}

TEST(OpenInferenceJson, Bf16AndNonFiniteOutputsAreWritten) {
  inference::ModelInferResponse response;
  auto* bf16 = response.add_outputs();
  bf16->set_name("maps");
  bf16->set_datatype("BF16");
  bf16->add_shape(3);
  response.add_raw_output_contents(std::string("\xcd\x3d\x80\x7f\x60\xc0", 6));  // 0x3dcd, +inf, -3.5
  absl::StatusOr<std::string> text = InferResponseToJson(response);
  ASSERT_TRUE(text.ok()) << text.status();
  // 0x3dcd is exactly 0.10009765625 and prints as the shortest FP32 that
  // reads back to it.
  const Json data = Json::parse(*text)["outputs"][0]["data"];
  EXPECT_EQ(Bits(data[0].get<float>()), 0x3dcd0000u);
  EXPECT_TRUE(data[1].is_null());
  EXPECT_EQ(data[2].get<double>(), -3.5);
}

TEST(OpenInferenceJson, ParametersKeepTheirJsonTypes) {
  const std::string body = R"({"parameters": {"causal": true, "n": -3, "big": 18446744073709551615,
    "x": 0.5, "maps": "mean"}, "inputs": [],
    "outputs": [{"name": "output", "parameters": {"rows": 4}}]})";
  absl::StatusOr<inference::ModelInferRequest> r = InferRequestFromJson(body, "m", "");
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& p = r->parameters();
  EXPECT_TRUE(p.at("causal").bool_param());
  EXPECT_EQ(p.at("n").int64_param(), -3);
  EXPECT_EQ(p.at("big").uint64_param(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(p.at("x").double_param(), 0.5);
  EXPECT_EQ(p.at("maps").string_param(), "mean");
  EXPECT_EQ(r->outputs(0).parameters().at("rows").int64_param(), 4);

  inference::ModelInferResponse response;
  (*response.mutable_parameters())["b"].set_bool_param(false);
  (*response.mutable_parameters())["a"].set_string_param("x\"y");
  (*response.mutable_parameters())["c"].set_double_param(0.25);
  absl::StatusOr<std::string> text = InferResponseToJson(response);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(Json::parse(*text)["parameters"], Json::parse(R"({"a":"x\"y","b":false,"c":0.25})"));
}

struct Refusal {
  const char* body;
  const char* message;  // the start of the message
};

TEST(OpenInferenceJson, BadRequestsAreRefusedNamingTheField) {
  const Refusal refusals[] = {
      {"not json", "request body: not valid JSON (at byte "},
      {"[]", "request body: not a JSON object"},
      {R"({"inputs": 3})", "inputs: not an array"},
      {R"({})", "inputs: missing"},
      {R"({"inputs": [], "input": 1})", "request body: unknown field 'input'"},
      {R"({"id": 5, "inputs": []})", "id: not a string"},
      {R"({"inputs": [7]})", "inputs[0]: not an object"},
      {R"({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]})", "inputs[0].name: missing"},
      {R"({"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]})", "inputs[0].shape: missing"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]})", "inputs[0].data: missing"},
      {R"({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, "a"]}]})",
       "inputs[0].data[1]: not a number"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1e39]}]})",
       "inputs[0].data[0]: 1e+39 is outside FP32's range"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]})",
       "inputs[0].data[0]: not an INT8 (an integer from -128 to 127)"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "UINT8", "data": [-1]}]})",
       "inputs[0].data[0]: not an UINT8"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}]})",
       "inputs[0].data[0]: not an INT32"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]})",
       "inputs[0].data[0]: not a boolean"},
      {R"({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": []}]})",
       "inputs[0].shape[0]: not a dimension"},
      {R"({"inputs": [{"name": "x", "shape": [2147483648, 2147483648, 4], "datatype": "FP32", "data": []}]})",
       "inputs[0].shape: more than 2^62 elements"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "FP99", "data": [1]}]})",
       "inputs[0].datatype: 'FP99' is not a datatype of the protocol"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "FP16", "data": [1]}]})",
       "inputs[0].datatype: FP16 is not accepted in JSON"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["a"]}]})",
       "inputs[0].datatype: BYTES is not accepted in JSON"},
      {R"({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}]})",
       "inputs[0].data[1]: expected an array of 2 (dimension 1 of shape [2, 2])"},
      {R"({"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2, 3, 4]]}]})",
       "inputs[0].data: expected an array of 2 (dimension 0 of shape [2, 2])"},
      {R"({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [[1], [2]]}]})",
       "inputs[0].data[0]: not a number"},
      {R"({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": 1}]})",
       "inputs[0].data: not an array"},
      {R"({"inputs": [], "parameters": {"p": {"q": 1}}})",
       "parameters.p: a parameter is a string, a number or a boolean"},
      {R"({"inputs": [], "parameters": []})", "parameters: not an object"},
      {R"({"inputs": [], "outputs": [{}]})", "outputs[0].name: missing"},
      {R"({"inputs": [], "outputs": [{"name": "o", "binary_data": true}]})",
       "outputs[0]: unknown field 'binary_data'"},
  };
  for (const Refusal& refusal : refusals) {
    absl::StatusOr<inference::ModelInferRequest> r = InferRequestFromJson(refusal.body, "m", "");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << refusal.body;
    EXPECT_THAT(std::string(r.status().message()), StartsWith(refusal.message)) << refusal.body;
  }
}

TEST(OpenInferenceJson, ResponsesThatDoNotMatchTheirShapeAreInternalErrors) {
  inference::ModelInferResponse response = SpecificationsResponse();
  response.mutable_outputs(0)->mutable_contents()->add_fp32_contents(4.0f);
  absl::StatusOr<std::string> text = InferResponseToJson(response);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(text.status().message()), StartsWith("outputs[0].data: 7 value(s) for 6 FP32"));

  inference::ModelInferResponse raw = SpecificationsResponse();
  raw.mutable_outputs(0)->clear_contents();
  raw.add_raw_output_contents(std::string(23, '\0'));
  EXPECT_EQ(InferResponseToJson(raw).status().code(), absl::StatusCode::kInternal);

  inference::ModelInferResponse bytes = SpecificationsResponse();
  bytes.mutable_outputs(0)->set_datatype("BYTES");
  EXPECT_EQ(InferResponseToJson(bytes).status().code(), absl::StatusCode::kUnimplemented);
}

TEST(OpenInferenceRest, GrpcCodesMapToTheirHttpStatus) {
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::OK), 200);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::INVALID_ARGUMENT), 400);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::UNAUTHENTICATED), 401);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::PERMISSION_DENIED), 403);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::NOT_FOUND), 404);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::RESOURCE_EXHAUSTED), 429);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::UNAVAILABLE), 503);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::DEADLINE_EXCEEDED), 504);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::INTERNAL), 500);
  EXPECT_EQ(HttpStatusFor(grpc::StatusCode::UNIMPLEMENTED), 501);
}

}  // namespace
}  // namespace attnserve::server
