#include "server/http/open_inference_json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/status_macros.h"
#include "server/common/message_text.h"

namespace attnserve::server {
namespace {

using Json = nlohmann::json;

enum class DataType {
  kBool, kInt8, kInt16, kInt32, kInt64, kUint8, kUint16, kUint32, kUint64,
  kFp32, kFp64, kBf16,
};

struct DataTypeInfo {
  const char* name;
  DataType type;
  int bytes;
};

constexpr DataTypeInfo kDataTypes[] = {
    {"BOOL", DataType::kBool, 1},     {"INT8", DataType::kInt8, 1},
    {"INT16", DataType::kInt16, 2},   {"INT32", DataType::kInt32, 4},
    {"INT64", DataType::kInt64, 8},   {"UINT8", DataType::kUint8, 1},
    {"UINT16", DataType::kUint16, 2}, {"UINT32", DataType::kUint32, 4},
    {"UINT64", DataType::kUint64, 8}, {"FP32", DataType::kFp32, 4},
    {"FP64", DataType::kFp64, 8},     {"BF16", DataType::kBf16, 2},
};

absl::StatusOr<DataTypeInfo> LookUpDataType(absl::string_view field, absl::string_view name) {
  for (const DataTypeInfo& info : kDataTypes) {
    if (name == info.name) return info;
  }
  if (name == "FP16" || name == "BYTES") {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", name,
        " is not accepted in JSON by attnserve (no model takes it; send FP32, or BF16 as numbers)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": '", Abbreviate(name),
                                                 "' is not a datatype of the protocol"));
}

// The largest magnitude that rounds to a finite FP32 (FLT_MAX plus half its
// last place; the tie itself rounds to infinity).
constexpr double kFp32Overflow = 0x1.ffffffp+127;

// Round to nearest, ties to even, on the bits of a finite float.
uint16_t FloatToBf16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16BitsToFloat(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// ---- Request: JSON -> ModelInferRequest -------------------------------------

absl::Status CheckKeys(const Json& object, absl::string_view where,
                       std::initializer_list<absl::string_view> known) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    bool found = false;
    for (absl::string_view k : known) found = found || it.key() == k;
    if (!found) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": unknown field '",
                                                     Abbreviate(it.key()), "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StringField(const Json& object, const char* key,
                                        absl::string_view where, bool required) {
  auto it = object.find(key);
  if (it == object.end()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": missing"));
    return std::string();
  }
  if (!it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": not a string"));
  }
  return it->get<std::string>();
}

// $parameters: an object of string, number or boolean values.
absl::Status ParseParameters(const Json& json, absl::string_view where,
                             google::protobuf::Map<std::string, inference::InferParameter>& out) {
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  }
  for (auto it = json.begin(); it != json.end(); ++it) {
    inference::InferParameter parameter;
    const Json& value = it.value();
    if (value.is_boolean()) {
      parameter.set_bool_param(value.get<bool>());
    } else if (value.is_number_unsigned() &&
               value.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()}) {
      parameter.set_uint64_param(value.get<uint64_t>());
    } else if (value.is_number_integer()) {
      parameter.set_int64_param(value.get<int64_t>());
    } else if (value.is_number_float()) {
      parameter.set_double_param(value.get<double>());
    } else if (value.is_string()) {
      parameter.set_string_param(value.get<std::string>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", Abbreviate(it.key()),
                       ": a parameter is a string, a number or a boolean"));
    }
    out[it.key()] = std::move(parameter);
  }
  return absl::OkStatus();
}

// The number of elements of `shape`; INVALID_ARGUMENT for a negative
// dimension or a product past 2^62.
absl::StatusOr<int64_t> ParseShape(const Json& json, absl::string_view where,
                                   google::protobuf::RepeatedField<int64_t>& out) {
  if (!json.is_array()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an array"));
  int64_t elements = 1;
  for (size_t i = 0; i < json.size(); ++i) {
    const Json& dim = json[i];
    if (!dim.is_number_integer() || (dim.is_number_unsigned() &&
                                     dim.get<uint64_t>() > uint64_t{int64_t{1} << 62}) ||
        (!dim.is_number_unsigned() && dim.get<int64_t>() < 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "[", i, "]: not a dimension (an integer from 0 to 2^62)"));
    }
    const int64_t size = dim.get<int64_t>();
    if (size != 0 && elements > (int64_t{1} << 62) / size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": more than 2^62 elements"));
    }
    elements *= size;
    out.Add(size);
  }
  return elements;
}

// Collects the leaves of "data" in row-major order: a flat array of
// `elements` values, or arrays nested exactly as `shape`.
absl::Status CollectLeaves(const Json& data, absl::string_view where,
                           absl::Span<const int64_t> shape, int64_t elements,
                           std::vector<const Json*>& leaves) {
  if (!data.is_array()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an array"));
  const bool nested = !data.empty() && data[0].is_array();
  if (!nested) {
    if (static_cast<int64_t>(data.size()) != elements) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", data.size(),
                                                     " value(s) for shape ", ShapeText(shape),
                                                     " (", elements, " elements)"));
    }
    leaves.reserve(static_cast<size_t>(elements));
    for (const Json& value : data) leaves.push_back(&value);
    return absl::OkStatus();
  }
  // Nested: walk with an explicit stack, checking each level's length
  // against its dimension (so the depth is bounded by the shape's rank).
  leaves.reserve(static_cast<size_t>(elements));
  struct Level {
    const Json* array;
    size_t next;
    std::string path;
  };
  std::vector<Level> stack;
  auto enter = [&](const Json* array, std::string path) -> absl::Status {
    const size_t depth = stack.size();
    if (depth >= shape.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": nested deeper than shape ", ShapeText(shape)));
    }
    if (!array->is_array() || static_cast<int64_t>(array->size()) != shape[depth]) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": expected an array of ", shape[depth], " (dimension ", depth, " of shape ",
          ShapeText(shape), ")"));
    }
    stack.push_back({array, 0, std::move(path)});
    return absl::OkStatus();
  };
  ATTNSERVE_RETURN_IF_ERROR(enter(&data, std::string(where)));
  while (!stack.empty()) {
    Level& level = stack.back();
    if (level.next == level.array->size()) {
      stack.pop_back();
      continue;
    }
    const size_t i = level.next++;
    const Json& item = (*level.array)[i];
    if (stack.size() < shape.size()) {
      std::string path = absl::StrCat(level.path, "[", i, "]");
      ATTNSERVE_RETURN_IF_ERROR(enter(&item, std::move(path)));
    } else {
      leaves.push_back(&item);
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<T> IntegerValue(const Json& value, absl::string_view where, size_t index,
                               absl::string_view type_name) {
  auto refuse = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "[", index, "]: not an ", type_name, " (an integer from ",
                     +std::numeric_limits<T>::min(), " to ", +std::numeric_limits<T>::max(), ")"));
  };
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<T>::max())) return refuse();
    return static_cast<T>(v);
  }
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if constexpr (std::is_signed_v<T>) {
      if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) return refuse();
    } else {
      if (v < 0 || static_cast<uint64_t>(v) > std::numeric_limits<T>::max()) return refuse();
    }
    return static_cast<T>(v);
  }
  return refuse();
}

absl::StatusOr<double> NumberValue(const Json& value, absl::string_view where, size_t index) {
  if (value.is_number_float()) return value.get<double>();
  if (value.is_number_unsigned()) return static_cast<double>(value.get<uint64_t>());
  if (value.is_number_integer()) return static_cast<double>(value.get<int64_t>());
  return absl::InvalidArgumentError(absl::StrCat(where, "[", index, "]: not a number"));
}

absl::StatusOr<float> Fp32Value(const Json& value, absl::string_view where, size_t index) {
  ATTNSERVE_ASSIGN_OR_RETURN(double v, NumberValue(value, where, index));
  if (!(std::abs(v) < kFp32Overflow)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "[", index, "]: ", v, " is outside FP32's range"));
  }
  return static_cast<float>(v);
}

template <typename T>
void AppendLittleEndian(T value, std::string& raw) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // x86-64 and aarch64: little-endian
  raw.append(bytes, sizeof(T));
}

// Fills one input's typed contents and its raw bytes (used when the request
// goes raw) from its leaves.
absl::Status ConvertData(const DataTypeInfo& type, const std::vector<const Json*>& leaves,
                         absl::string_view where, inference::InferTensorContents& contents,
                         std::string& raw) {
  raw.reserve(leaves.size() * static_cast<size_t>(type.bytes));
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Json& v = *leaves[i];
    switch (type.type) {
      case DataType::kBool:
        if (!v.is_boolean()) {
          return absl::InvalidArgumentError(absl::StrCat(where, "[", i, "]: not a boolean"));
        }
        contents.add_bool_contents(v.get<bool>());
        raw.push_back(v.get<bool>() ? 1 : 0);
        break;
      case DataType::kInt8: {
        ATTNSERVE_ASSIGN_OR_RETURN(int8_t x, IntegerValue<int8_t>(v, where, i, "INT8"));
        contents.add_int_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kInt16: {
        ATTNSERVE_ASSIGN_OR_RETURN(int16_t x, IntegerValue<int16_t>(v, where, i, "INT16"));
        contents.add_int_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kInt32: {
        ATTNSERVE_ASSIGN_OR_RETURN(int32_t x, IntegerValue<int32_t>(v, where, i, "INT32"));
        contents.add_int_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kInt64: {
        ATTNSERVE_ASSIGN_OR_RETURN(int64_t x, IntegerValue<int64_t>(v, where, i, "INT64"));
        contents.add_int64_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kUint8: {
        ATTNSERVE_ASSIGN_OR_RETURN(uint8_t x, IntegerValue<uint8_t>(v, where, i, "UINT8"));
        contents.add_uint_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kUint16: {
        ATTNSERVE_ASSIGN_OR_RETURN(uint16_t x, IntegerValue<uint16_t>(v, where, i, "UINT16"));
        contents.add_uint_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kUint32: {
        ATTNSERVE_ASSIGN_OR_RETURN(uint32_t x, IntegerValue<uint32_t>(v, where, i, "UINT32"));
        contents.add_uint_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kUint64: {
        ATTNSERVE_ASSIGN_OR_RETURN(uint64_t x, IntegerValue<uint64_t>(v, where, i, "UINT64"));
        contents.add_uint64_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kFp32: {
        ATTNSERVE_ASSIGN_OR_RETURN(float x, Fp32Value(v, where, i));
        contents.add_fp32_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kFp64: {
        ATTNSERVE_ASSIGN_OR_RETURN(double x, NumberValue(v, where, i));
        contents.add_fp64_contents(x);
        AppendLittleEndian(x, raw);
        break;
      }
      case DataType::kBf16: {
        ATTNSERVE_ASSIGN_OR_RETURN(float x, Fp32Value(v, where, i));
        AppendLittleEndian(FloatToBf16Bits(x), raw);
        break;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ParseInput(const Json& json, absl::string_view where,
                        inference::ModelInferRequest::InferInputTensor& input, std::string& raw,
                        bool& needs_raw) {
  if (!json.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckKeys(json, where, {"name", "shape", "datatype", "parameters", "data"}));
  ATTNSERVE_ASSIGN_OR_RETURN(*input.mutable_name(), StringField(json, "name", where, true));
  ATTNSERVE_ASSIGN_OR_RETURN(*input.mutable_datatype(),
                             StringField(json, "datatype", where, true));
  const std::string datatype_field = absl::StrCat(where, ".datatype");
  ATTNSERVE_ASSIGN_OR_RETURN(DataTypeInfo type, LookUpDataType(datatype_field, input.datatype()));
  auto shape = json.find("shape");
  if (shape == json.end()) return absl::InvalidArgumentError(absl::StrCat(where, ".shape: missing"));
  ATTNSERVE_ASSIGN_OR_RETURN(
      int64_t elements, ParseShape(*shape, absl::StrCat(where, ".shape"), *input.mutable_shape()));
  if (auto parameters = json.find("parameters"); parameters != json.end()) {
    ATTNSERVE_RETURN_IF_ERROR(ParseParameters(*parameters, absl::StrCat(where, ".parameters"),
                                              *input.mutable_parameters()));
  }
  auto data = json.find("data");
  if (data == json.end()) return absl::InvalidArgumentError(absl::StrCat(where, ".data: missing"));
  const std::string data_field = absl::StrCat(where, ".data");
  std::vector<const Json*> leaves;
  ATTNSERVE_RETURN_IF_ERROR(CollectLeaves(*data, data_field,
                                          absl::MakeConstSpan(input.shape().data(),
                                                              input.shape().size()),
                                          elements, leaves));
  ATTNSERVE_RETURN_IF_ERROR(ConvertData(type, leaves, data_field, *input.mutable_contents(), raw));
  if (type.type == DataType::kBf16) needs_raw = true;
  return absl::OkStatus();
}

// ---- Response: ModelInferResponse -> JSON -----------------------------------

// Appends a JSON string (escaped by the JSON library; invalid UTF-8 replaced).
void AppendString(absl::string_view text, std::string& out) {
  out += Json(std::string(text)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

template <typename T>
void AppendNumber(T value, std::string& out) {
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(value)) {
      out += "null";
      return;
    }
    // "-0" would read back as the integer 0: keep the sign.
    if (value == 0 && std::signbit(value)) {
      out += "-0.0";
      return;
    }
  }
  char buffer[64];
  // Shortest form that reads back to the same value of T.
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, result.ptr);
}

void AppendParameters(const google::protobuf::Map<std::string, inference::InferParameter>& params,
                      std::string& out) {
  // Sorted by name, so the text does not depend on the map's order.
  std::vector<const std::string*> names;
  for (const auto& [name, value] : params) names.push_back(&name);
  std::sort(names.begin(), names.end(), [](auto* a, auto* b) { return *a < *b; });
  out += '{';
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += ',';
    AppendString(*names[i], out);
    out += ':';
    const inference::InferParameter& p = params.at(*names[i]);
    switch (p.parameter_choice_case()) {
      case inference::InferParameter::kBoolParam: out += p.bool_param() ? "true" : "false"; break;
      case inference::InferParameter::kInt64Param: AppendNumber(p.int64_param(), out); break;
      case inference::InferParameter::kUint64Param: AppendNumber(p.uint64_param(), out); break;
      case inference::InferParameter::kDoubleParam: AppendNumber(p.double_param(), out); break;
      case inference::InferParameter::kStringParam: AppendString(p.string_param(), out); break;
      case inference::InferParameter::PARAMETER_CHOICE_NOT_SET: out += "null"; break;
    }
  }
  out += '}';
}

template <typename T, typename Values>
void AppendValues(const Values& values, std::string& out) {
  for (int i = 0; i < values.size(); ++i) {
    if (i > 0) out += ',';
    AppendNumber(static_cast<T>(values[i]), out);
  }
}

template <typename T>
void AppendRaw(absl::string_view raw, std::string& out) {
  for (size_t i = 0; i * sizeof(T) < raw.size(); ++i) {
    if (i > 0) out += ',';
    T value;
    std::memcpy(&value, raw.data() + i * sizeof(T), sizeof(T));
    if constexpr (std::is_same_v<T, bool>) {
      out += value ? "true" : "false";
    } else {
      AppendNumber(value, out);
    }
  }
}

absl::Status AppendOutputData(const inference::ModelInferResponse::InferOutputTensor& output,
                              const DataTypeInfo& type, int64_t elements,
                              const std::string* raw, absl::string_view where, std::string& out) {
  out += '[';
  if (raw != nullptr) {
    if (static_cast<int64_t>(raw->size()) != elements * type.bytes) {
      return absl::InternalError(absl::StrCat(where, ": ", raw->size(),
                                              " raw bytes for ", elements, " ",
                                              type.name, " elements"));
    }
    switch (type.type) {
      case DataType::kBool: {
        for (int64_t i = 0; i < elements; ++i) {
          if (i > 0) out += ',';
          out += (*raw)[static_cast<size_t>(i)] != 0 ? "true" : "false";
        }
        break;
      }
      case DataType::kInt8: AppendRaw<int8_t>(*raw, out); break;
      case DataType::kInt16: AppendRaw<int16_t>(*raw, out); break;
      case DataType::kInt32: AppendRaw<int32_t>(*raw, out); break;
      case DataType::kInt64: AppendRaw<int64_t>(*raw, out); break;
      case DataType::kUint8: AppendRaw<uint8_t>(*raw, out); break;
      case DataType::kUint16: AppendRaw<uint16_t>(*raw, out); break;
      case DataType::kUint32: AppendRaw<uint32_t>(*raw, out); break;
      case DataType::kUint64: AppendRaw<uint64_t>(*raw, out); break;
      case DataType::kFp32: AppendRaw<float>(*raw, out); break;
      case DataType::kFp64: AppendRaw<double>(*raw, out); break;
      case DataType::kBf16: {
        for (int64_t i = 0; i < elements; ++i) {
          if (i > 0) out += ',';
          uint16_t half;
          std::memcpy(&half, raw->data() + 2 * i, 2);
          AppendNumber(Bf16BitsToFloat(half), out);
        }
        break;
      }
    }
    out += ']';
    return absl::OkStatus();
  }
  const inference::InferTensorContents& c = output.contents();
  auto check = [&](int count) -> absl::Status {
    if (count != elements) {
      return absl::InternalError(absl::StrCat(where, ": ", count, " value(s) for ", elements,
                                              " ", type.name, " elements"));
    }
    return absl::OkStatus();
  };
  switch (type.type) {
    case DataType::kBool:
      ATTNSERVE_RETURN_IF_ERROR(check(c.bool_contents_size()));
      for (int i = 0; i < c.bool_contents_size(); ++i) {
        if (i > 0) out += ',';
        out += c.bool_contents(i) ? "true" : "false";
      }
      break;
    case DataType::kInt8:
    case DataType::kInt16:
    case DataType::kInt32:
      ATTNSERVE_RETURN_IF_ERROR(check(c.int_contents_size()));
      AppendValues<int32_t>(c.int_contents(), out);
      break;
    case DataType::kInt64:
      ATTNSERVE_RETURN_IF_ERROR(check(c.int64_contents_size()));
      AppendValues<int64_t>(c.int64_contents(), out);
      break;
    case DataType::kUint8:
    case DataType::kUint16:
    case DataType::kUint32:
      ATTNSERVE_RETURN_IF_ERROR(check(c.uint_contents_size()));
      AppendValues<uint32_t>(c.uint_contents(), out);
      break;
    case DataType::kUint64:
      ATTNSERVE_RETURN_IF_ERROR(check(c.uint64_contents_size()));
      AppendValues<uint64_t>(c.uint64_contents(), out);
      break;
    case DataType::kFp32:
      ATTNSERVE_RETURN_IF_ERROR(check(c.fp32_contents_size()));
      AppendValues<float>(c.fp32_contents(), out);
      break;
    case DataType::kFp64:
      ATTNSERVE_RETURN_IF_ERROR(check(c.fp64_contents_size()));
      AppendValues<double>(c.fp64_contents(), out);
      break;
    case DataType::kBf16:
      return absl::InternalError(
          absl::StrCat(where, ": BF16 output without raw_output_contents"));
  }
  out += ']';
  return absl::OkStatus();
}

Json TensorMetadataJson(const inference::ModelMetadataResponse::TensorMetadata& tensor) {
  Json shape = Json::array();
  for (int64_t d : tensor.shape()) shape.push_back(d);
  return Json{{"name", tensor.name()}, {"datatype", tensor.datatype()}, {"shape", shape}};
}

std::string Dump(const Json& json) {
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace

absl::StatusOr<inference::ModelInferRequest> InferRequestFromJson(absl::string_view body,
                                                                  absl::string_view model_name,
                                                                  absl::string_view model_version) {
  Json json;
  try {
    json = Json::parse(body.begin(), body.end());
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("request body: not valid JSON (at byte ", e.byte, ")"));
  }
  if (!json.is_object()) {
    return absl::InvalidArgumentError("request body: not a JSON object ($inference_request)");
  }
  constexpr absl::string_view kWhere = "request body";
  ATTNSERVE_RETURN_IF_ERROR(CheckKeys(json, kWhere, {"id", "parameters", "inputs", "outputs"}));
  inference::ModelInferRequest request;
  request.set_model_name(std::string(model_name));
  if (!model_version.empty()) request.set_model_version(std::string(model_version));
  if (auto id = json.find("id"); id != json.end()) {
    if (!id->is_string()) return absl::InvalidArgumentError("id: not a string");
    request.set_id(id->get<std::string>());
  }
  if (auto parameters = json.find("parameters"); parameters != json.end()) {
    ATTNSERVE_RETURN_IF_ERROR(
        ParseParameters(*parameters, "parameters", *request.mutable_parameters()));
  }
  auto inputs = json.find("inputs");
  if (inputs == json.end()) return absl::InvalidArgumentError("inputs: missing");
  if (!inputs->is_array()) return absl::InvalidArgumentError("inputs: not an array");
  std::vector<std::string> raw(inputs->size());
  bool needs_raw = false;
  for (size_t i = 0; i < inputs->size(); ++i) {
    ATTNSERVE_RETURN_IF_ERROR(ParseInput((*inputs)[i], absl::StrCat("inputs[", i, "]"),
                                         *request.add_inputs(), raw[i], needs_raw));
  }
  if (needs_raw) {
    for (size_t i = 0; i < raw.size(); ++i) {
      request.mutable_inputs(static_cast<int>(i))->clear_contents();
      request.add_raw_input_contents(std::move(raw[i]));
    }
  }
  if (auto outputs = json.find("outputs"); outputs != json.end()) {
    if (!outputs->is_array()) return absl::InvalidArgumentError("outputs: not an array");
    for (size_t i = 0; i < outputs->size(); ++i) {
      const Json& o = (*outputs)[i];
      const std::string where = absl::StrCat("outputs[", i, "]");
      if (!o.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
      ATTNSERVE_RETURN_IF_ERROR(CheckKeys(o, where, {"name", "parameters"}));
      inference::ModelInferRequest::InferRequestedOutputTensor* output = request.add_outputs();
      ATTNSERVE_ASSIGN_OR_RETURN(*output->mutable_name(), StringField(o, "name", where, true));
      if (auto parameters = o.find("parameters"); parameters != o.end()) {
        ATTNSERVE_RETURN_IF_ERROR(ParseParameters(*parameters, absl::StrCat(where, ".parameters"),
                                                  *output->mutable_parameters()));
      }
    }
  }
  return request;
}

absl::StatusOr<std::string> InferResponseToJson(const inference::ModelInferResponse& response) {
  const bool raw = response.raw_output_contents_size() > 0;
  if (raw && response.raw_output_contents_size() != response.outputs_size()) {
    return absl::InternalError(absl::StrCat("response: ", response.raw_output_contents_size(),
                                            " raw_output_contents for ", response.outputs_size(),
                                            " outputs"));
  }
  std::string out = "{\"model_name\":";
  AppendString(response.model_name(), out);
  if (!response.model_version().empty()) {
    out += ",\"model_version\":";
    AppendString(response.model_version(), out);
  }
  if (!response.id().empty()) {
    out += ",\"id\":";
    AppendString(response.id(), out);
  }
  if (!response.parameters().empty()) {
    out += ",\"parameters\":";
    AppendParameters(response.parameters(), out);
  }
  out += ",\"outputs\":[";
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& output = response.outputs(i);
    const std::string where = absl::StrCat("outputs[", i, "]");
    absl::StatusOr<DataTypeInfo> type = LookUpDataType(where, output.datatype());
    if (!type.ok()) {
      return absl::UnimplementedError(
          absl::StrCat(where, ": datatype '", Abbreviate(output.datatype()),
                       "' cannot be written as JSON by attnserve"));
    }
    int64_t elements = 1;
    for (int64_t d : output.shape()) {
      if (d < 0 || (d != 0 && elements > (int64_t{1} << 62) / d)) {
        return absl::InternalError(absl::StrCat(where, ".shape: not a tensor's shape"));
      }
      elements *= d;
    }
    if (i > 0) out += ',';
    out += "{\"name\":";
    AppendString(output.name(), out);
    out += ",\"datatype\":";
    AppendString(output.datatype(), out);
    out += ",\"shape\":[";
    AppendValues<int64_t>(output.shape(), out);
    out += ']';
    if (!output.parameters().empty()) {
      out += ",\"parameters\":";
      AppendParameters(output.parameters(), out);
    }
    out += ",\"data\":";
    ATTNSERVE_RETURN_IF_ERROR(AppendOutputData(output, *type, elements,
                                               raw ? &response.raw_output_contents(i) : nullptr,
                                               absl::StrCat(where, ".data"), out));
    out += '}';
  }
  out += "]}";
  return out;
}

std::string ServerMetadataToJson(const inference::ServerMetadataResponse& response) {
  Json extensions = Json::array();
  for (const std::string& e : response.extensions()) extensions.push_back(e);
  return Dump(Json{{"name", response.name()},
                   {"version", response.version()},
                   {"extensions", extensions}});
}

std::string ModelMetadataToJson(const inference::ModelMetadataResponse& response) {
  Json json = {{"name", response.name()}, {"platform", response.platform()}};
  if (response.versions_size() > 0) {
    Json versions = Json::array();
    for (const std::string& v : response.versions()) versions.push_back(v);
    json["versions"] = versions;
  }
  Json inputs = Json::array(), outputs = Json::array();
  for (const auto& t : response.inputs()) inputs.push_back(TensorMetadataJson(t));
  for (const auto& t : response.outputs()) outputs.push_back(TensorMetadataJson(t));
  json["inputs"] = inputs;
  json["outputs"] = outputs;
  return Dump(json);
}

}  // namespace attnserve::server
