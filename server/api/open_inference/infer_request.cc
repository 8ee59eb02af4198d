#include "server/api/open_inference/infer_request.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"
#include "server/common/message_text.h"

namespace attnserve::server::open_inference {
namespace {

using inference::InferParameter;
using inference::InferTensorContents;
using inference::ModelInferRequest;

// Larger element counts are refused before any size is computed from them.
constexpr int64_t kMaxElements = int64_t{1} << 40;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// What an input may be: its datatypes and ranks.
struct InputRule {
  absl::string_view name;
  std::vector<absl::string_view> datatypes;
  std::vector<int> ranks;
};

const InputRule* FindRule(absl::string_view name) {
  static const auto* const kRules = new std::vector<InputRule>{
      {kHiddenStates, {"FP32", "BF16"}, {3, 2}},    {kSequenceLengths, {"INT32", "INT64"}, {1}},
      {kContext, {"FP32", "BF16"}, {3, 2}},         {kContextLengths, {"INT32", "INT64"}, {1}},
      {kMask, {"BOOL", "FP32", "BF16"}, {3}},       {kHeadMask, {"FP32", "BOOL"}, {1}},
      {kPositionOffsets, {"INT32", "INT64"}, {1}},  {kAttentionMapHeads, {"INT32", "INT64"}, {1}},
      {kAttentionMapRows, {"INT32", "INT64"}, {1}},
  };
  for (const InputRule& rule : *kRules) {
    if (rule.name == name) return &rule;
  }
  return nullptr;
}

constexpr absl::string_view kInputNames =
    "hidden_states, sequence_lengths, context, context_lengths, mask, head_mask, position_offsets, "
    "attention_map_heads, attention_map_rows";
constexpr absl::string_view kOutputNames =
    "output, attention_maps, head_entropy, head_max_weight, head_contribution";

int64_t DatatypeSize(absl::string_view datatype) {
  if (datatype == "FP32" || datatype == "INT32") return 4;
  if (datatype == "INT64") return 8;
  if (datatype == "BF16") return 2;
  if (datatype == "BOOL") return 1;
  return 0;
}

// The number of values in the typed field of `datatype`, and of all the
// typed fields together.
int64_t TypedCount(const InferTensorContents& c, absl::string_view datatype) {
  if (datatype == "FP32") return c.fp32_contents_size();
  if (datatype == "INT32") return c.int_contents_size();
  if (datatype == "INT64") return c.int64_contents_size();
  if (datatype == "BOOL") return c.bool_contents_size();
  return 0;
}
int64_t AllTypedCount(const InferTensorContents& c) {
  return int64_t{c.bool_contents_size()} + c.int_contents_size() + c.int64_contents_size() +
         c.uint_contents_size() + c.uint64_contents_size() + c.fp32_contents_size() +
         c.fp64_contents_size() + c.bytes_contents_size();
}
absl::string_view TypedFieldName(absl::string_view datatype) {
  if (datatype == "FP32") return "fp32_contents";
  if (datatype == "INT32") return "int_contents";
  if (datatype == "INT64") return "int64_contents";
  if (datatype == "BOOL") return "bool_contents";
  return "";
}

// One checked input: its field name for messages, its datatype, shape and
// element count, and where its values are (raw bytes, or typed contents).
struct Input {
  std::string field;  // "inputs[i] (name)"
  std::string datatype;
  std::vector<int64_t> shape;
  int64_t elements = 0;
  std::string* raw = nullptr;  // moved out by the conversion that takes the tensor whole
  const InferTensorContents* typed = nullptr;
};

// A map's keys in sorted order, so that the one a message names does not
// depend on the map's order.
std::vector<std::string> SortedKeys(
    const google::protobuf::Map<std::string, InferParameter>& parameters) {
  std::vector<std::string> keys;
  keys.reserve(parameters.size());
  for (const auto& [key, value] : parameters) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// An input's or output's parameters: content_type (how a client's codec
// encoded the tensor; attnserve's datatypes say it all) is accepted and
// ignored, any other is refused, named.
absl::Status CheckTensorParameters(
    absl::string_view field, const google::protobuf::Map<std::string, InferParameter>& parameters) {
  for (const std::string& key : SortedKeys(parameters)) {
    if (key == kContentType) continue;
    return Invalid(absl::StrCat(field, ".parameters.", Abbreviate(key)),
                   "unknown per-tensor parameter (attnserve takes only content_type, and ignores "
                   "it)");
  }
  return absl::OkStatus();
}

absl::StatusOr<Input> CheckInput(ModelInferRequest& infer, int index, const InputRule& rule) {
  const ModelInferRequest::InferInputTensor& tensor = infer.inputs(index);
  Input input;
  input.field = absl::StrCat("inputs[", index, "] (", Abbreviate(tensor.name()), ")");
  input.datatype = tensor.datatype();
  bool known_type = false;
  for (absl::string_view type : rule.datatypes)
    known_type = known_type || type == tensor.datatype();
  if (!known_type) {
    return Invalid(absl::StrCat(input.field, ".datatype"),
                   absl::StrCat("'", Abbreviate(tensor.datatype()), "' is not accepted; ", rule.name,
                                " takes ",
                                absl::StrJoin(rule.datatypes, " or ")));
  }
  bool known_rank = false;
  for (int rank : rule.ranks) known_rank = known_rank || rank == tensor.shape_size();
  if (!known_rank) {
    return Invalid(absl::StrCat(input.field, ".shape"),
                   absl::StrCat("has ", tensor.shape_size(), " dimensions; ", rule.name, " has ",
                                absl::StrJoin(rule.ranks, " or ")));
  }
  input.elements = 1;
  for (int j = 0; j < tensor.shape_size(); ++j) {
    const int64_t dim = tensor.shape(j);
    if (dim <= 0) {
      return Invalid(absl::StrCat(input.field, ".shape[", j, "]"),
                     absl::StrCat("is ", dim, "; every dimension must be positive"));
    }
    if (dim > kMaxElements / input.elements) {
      return Invalid(absl::StrCat(input.field, ".shape"), "has too many elements");
    }
    input.elements *= dim;
    input.shape.push_back(dim);
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckTensorParameters(input.field, tensor.parameters()));
  if (infer.raw_input_contents_size() > 0) {
    if (tensor.has_contents() && AllTypedCount(tensor.contents()) > 0) {
      return Invalid(absl::StrCat(input.field, ".contents"),
                     "set while raw_input_contents is used: send every input's values raw, or "
                     "none");
    }
    input.raw = infer.mutable_raw_input_contents(index);
    const int64_t want = input.elements * DatatypeSize(input.datatype);
    if (static_cast<int64_t>(input.raw->size()) != want) {
      return Invalid(
          absl::StrCat("raw_input_contents[", index, "]"),
          absl::StrCat("has ", input.raw->size(), " bytes; ", input.field, " (", input.datatype,
                       ", shape [", absl::StrJoin(input.shape, ", "), "]) needs ", want));
    }
    return input;
  }
  if (input.datatype == "BF16") {
    return Invalid(absl::StrCat(input.field, ".contents"),
                   "BF16 values travel only in raw_input_contents (the typed contents have no "
                   "16-bit float field)");
  }
  const InferTensorContents& contents = tensor.contents();
  const int64_t typed = TypedCount(contents, input.datatype);
  const absl::string_view typed_field = TypedFieldName(input.datatype);
  if (AllTypedCount(contents) != typed) {
    return Invalid(
        absl::StrCat(input.field, ".contents"),
        absl::StrCat("has values outside ", typed_field, ", the field of ", input.datatype));
  }
  if (typed != input.elements) {
    return Invalid(absl::StrCat(input.field, ".contents.", typed_field),
                   absl::StrCat("has ", typed, " values; shape [", absl::StrJoin(input.shape, ", "),
                                "] needs ", input.elements));
  }
  input.typed = &contents;
  return input;
}

// hidden_states or context: FP32 or BF16, raw or typed FP32.
void ToStates(const Input& input, v1::Tensor* tensor) {
  tensor->set_dtype(input.datatype == "BF16" ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_FP32);
  tensor->mutable_shape()->Assign(input.shape.begin(), input.shape.end());
  if (input.raw != nullptr) {
    tensor->set_raw_data(std::move(*input.raw));  // no copy of the states
  } else {
    tensor->mutable_float_data()->Assign(input.typed->fp32_contents().begin(),
                                         input.typed->fp32_contents().end());
  }
}

// An INT32 or INT64 vector, as int64 values.
std::vector<int64_t> ToInts(const Input& input) {
  std::vector<int64_t> values(static_cast<size_t>(input.elements));
  if (input.raw != nullptr) {
    const char* bytes = input.raw->data();
    for (size_t i = 0; i < values.size(); ++i) {
      if (input.datatype == "INT32") {
        int32_t v;
        std::memcpy(&v, bytes + 4 * i, 4);
        values[i] = v;
      } else {
        std::memcpy(&values[i], bytes + 8 * i, 8);
      }
    }
  } else if (input.datatype == "INT32") {
    for (size_t i = 0; i < values.size(); ++i) values[i] = input.typed->int_contents(i);
  } else {
    for (size_t i = 0; i < values.size(); ++i) values[i] = input.typed->int64_contents(i);
  }
  return values;
}

// attention_map_heads and attention_map_rows: int32 on attnserve.v1's side.
absl::Status ToInt32s(const Input& input, google::protobuf::RepeatedField<int32_t>* out) {
  for (int64_t value : ToInts(input)) {
    if (value < INT32_MIN || value > INT32_MAX) {
      return Invalid(input.field, absl::StrCat("value ", value, " is outside INT32's range"));
    }
    out->Add(static_cast<int32_t>(value));
  }
  return absl::OkStatus();
}

void ToMask(const Input& input, v1::AttentionMask::Kind kind, v1::AttentionMask* mask) {
  mask->set_kind(kind);
  v1::Tensor* values = mask->mutable_values();
  values->mutable_shape()->Assign(input.shape.begin(), input.shape.end());
  if (input.datatype == "BOOL") {
    values->set_dtype(v1::DATA_TYPE_BOOL);
    if (input.raw != nullptr) {
      values->set_raw_data(std::move(*input.raw));
    } else {
      std::string bytes(static_cast<size_t>(input.elements), '\0');
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = input.typed->bool_contents(i) ? 1 : 0;
      values->set_raw_data(std::move(bytes));
    }
    return;
  }
  ToStates(input, values);  // FP32 or BF16, as the states travel
}

void ToHeadMask(const Input& input, google::protobuf::RepeatedField<float>* out) {
  const size_t n = static_cast<size_t>(input.elements);
  if (input.datatype == "BOOL") {
    for (size_t i = 0; i < n; ++i) {
      const bool on = input.raw != nullptr ? (*input.raw)[i] != 0 : input.typed->bool_contents(i);
      out->Add(on ? 1.0f : 0.0f);
    }
  } else if (input.raw != nullptr) {
    out->Resize(static_cast<int>(n), 0.0f);
    std::memcpy(out->mutable_data(), input.raw->data(), 4 * n);
  } else {
    out->Assign(input.typed->fp32_contents().begin(), input.typed->fp32_contents().end());
  }
}

// Request parameters, each checked for its type.
struct Parameters {
  std::optional<bool> causal;
  std::optional<std::string> attention_maps, precision, output_dtype, mask_kind;
};

absl::StatusOr<Parameters> CheckParameters(const ModelInferRequest& infer) {
  Parameters p;
  for (const std::string& name : SortedKeys(infer.parameters())) {
    const InferParameter& value = infer.parameters().at(name);
    const std::string field = absl::StrCat("parameters.", Abbreviate(name));
    if (name == "causal") {
      if (value.parameter_choice_case() != InferParameter::kBoolParam) {
        return Invalid(field, "must be a bool_param");
      }
      p.causal = value.bool_param();
      continue;
    }
    std::optional<std::string>* slot = name == "attention_maps" ? &p.attention_maps
                                       : name == "precision"    ? &p.precision
                                       : name == "output_dtype" ? &p.output_dtype
                                       : name == "mask_kind"    ? &p.mask_kind
                                                                : nullptr;
    if (slot == nullptr) {
      return Invalid(field,
                     "unknown parameter (attnserve takes causal, attention_maps, precision, "
                     "output_dtype, mask_kind)");
    }
    if (value.parameter_choice_case() != InferParameter::kStringParam) {
      return Invalid(field, "must be a string_param");
    }
    *slot = value.string_param();
  }
  return p;
}

}  // namespace

absl::Status CheckModelVersion(absl::string_view field, absl::string_view model,
                               const std::string* version) {
  if (version == nullptr || version->empty() || *version == kModelVersion) return absl::OkStatus();
  return absl::NotFoundError(
      absl::StrCat(field, ": model '", Abbreviate(model), "' has no version '", Abbreviate(*version),
                   "'; attnserve's models have one version, \"1\" (or leave ", field, " empty)"));
}

absl::Status AttendRequestFromInfer(ModelInferRequest* infer_request, v1::AttendRequest* request,
                                    InferReplyForm* form) {
  ModelInferRequest& infer = *infer_request;
  request->Clear();
  *form = InferReplyForm();
  request->set_model(infer.model_name());
  form->id = infer.id();
  if (infer.model_name().empty()) return Invalid("model_name", "required");
  if (infer.id().size() > kMaxInferIdBytes) {
    return Invalid("id", absl::StrCat("has ", infer.id().size(), " bytes; at most ",
                                      kMaxInferIdBytes, " (it is echoed in the response)"));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckModelVersion("model_version", infer.model_name(),
                        infer.has_model_version() ? &infer.model_version() : nullptr));
  if (infer.raw_input_contents_size() > 0 &&
      infer.raw_input_contents_size() != infer.inputs_size()) {
    return Invalid("raw_input_contents",
                   absl::StrCat("has ", infer.raw_input_contents_size(), " entries for ",
                                infer.inputs_size(), " inputs (one per input, in order)"));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(Parameters params, CheckParameters(infer));

  // The inputs, by name.
  absl::flat_hash_set<std::string> seen;
  std::optional<Input> mask;
  for (int i = 0; i < infer.inputs_size(); ++i) {
    const std::string& name = infer.inputs(i).name();
    const InputRule* rule = FindRule(name);
    if (rule == nullptr) {
      return Invalid(
          absl::StrCat("inputs[", i, "].name"),
          absl::StrCat("unknown input '", Abbreviate(name), "' (attnserve's models take ",
                       kInputNames, ")"));
    }
    if (!seen.insert(name).second) {
      return Invalid(absl::StrCat("inputs[", i, "].name"),
                     absl::StrCat("'", Abbreviate(name), "' given twice"));
    }
    ATTNSERVE_ASSIGN_OR_RETURN(Input input, CheckInput(infer, i, *rule));
    if (name == kHiddenStates) {
      ToStates(input, request->mutable_hidden_states());
    } else if (name == kContext) {
      ToStates(input, request->mutable_context());
    } else if (name == kSequenceLengths) {
      for (int64_t v : ToInts(input)) request->add_sequence_lengths(v);
    } else if (name == kContextLengths) {
      for (int64_t v : ToInts(input)) request->add_context_lengths(v);
    } else if (name == kPositionOffsets) {
      for (int64_t v : ToInts(input)) request->add_position_offsets(v);
    } else if (name == kAttentionMapHeads) {
      ATTNSERVE_RETURN_IF_ERROR(
          ToInt32s(input, request->mutable_attention_maps()->mutable_heads()));
    } else if (name == kAttentionMapRows) {
      ATTNSERVE_RETURN_IF_ERROR(
          ToInt32s(input, request->mutable_attention_maps()->mutable_query_rows()));
    } else if (name == kHeadMask) {
      ToHeadMask(input, request->mutable_head_mask());
    } else if (name == kMask) {
      mask = std::move(input);
    }
  }
  if (!seen.contains(kHiddenStates)) {
    return Invalid("inputs", "hidden_states is required ([batch, seq, d_model], FP32 or BF16)");
  }

  // Parameters.
  if (params.causal.has_value()) request->set_causal(*params.causal);
  if (params.precision.has_value()) {
    if (*params.precision == "fp32") {
      request->set_precision(v1::PRECISION_FP32);
    } else if (*params.precision == "bf16") {
      request->set_precision(v1::PRECISION_BF16);
    } else {
      return Invalid("parameters.precision",
                     absl::StrCat("'", Abbreviate(*params.precision), "'; takes fp32 or bf16"));
    }
  }
  if (params.output_dtype.has_value()) {
    if (*params.output_dtype == "FP32") {
      request->set_output_dtype(v1::DATA_TYPE_FP32);
    } else if (*params.output_dtype == "BF16") {
      request->set_output_dtype(v1::DATA_TYPE_BF16);
    } else {
      return Invalid("parameters.output_dtype",
                     absl::StrCat("'", Abbreviate(*params.output_dtype), "'; takes FP32 or BF16"));
    }
  }
  if (mask.has_value()) {
    v1::AttentionMask::Kind kind = mask->datatype == "BOOL" ? v1::AttentionMask::KIND_ALLOWED
                                                            : v1::AttentionMask::KIND_ADDITIVE;
    if (params.mask_kind.has_value()) {
      if (*params.mask_kind == "allowed") {
        kind = v1::AttentionMask::KIND_ALLOWED;
      } else if (*params.mask_kind == "additive") {
        kind = v1::AttentionMask::KIND_ADDITIVE;
      } else {
        return Invalid("parameters.mask_kind",
                       absl::StrCat("'", Abbreviate(*params.mask_kind),
                                    "'; takes allowed or additive"));
      }
    }
    ToMask(*mask, kind, request->mutable_mask());
  } else if (params.mask_kind.has_value()) {
    return Invalid("parameters.mask_kind", "given without a mask input");
  }

  // Outputs: named ones, or the output alone.
  seen.clear();
  for (int i = 0; i < infer.outputs_size(); ++i) {
    const auto& output = infer.outputs(i);
    const std::string field = absl::StrCat("outputs[", i, "]");
    const std::string& name = output.name();
    if (name != kOutput && name != kAttentionMaps && name != kHeadEntropy &&
        name != kHeadMaxWeight && name != kHeadContribution) {
      return Invalid(
          absl::StrCat(field, ".name"),
          absl::StrCat("unknown output '", Abbreviate(name), "' (attnserve's models give ",
                       kOutputNames, ")"));
    }
    if (!seen.insert(name).second) {
      return Invalid(absl::StrCat(field, ".name"),
                     absl::StrCat("'", Abbreviate(name), "' named twice"));
    }
    ATTNSERVE_RETURN_IF_ERROR(
        CheckTensorParameters(absl::StrCat(field, " (", name, ")"), output.parameters()));
    form->outputs.push_back(name);
  }
  if (form->outputs.empty()) form->outputs.push_back(kOutput);
  const bool maps_named = seen.contains(kAttentionMaps);
  v1::AttentionMapMode mode =
      maps_named ? v1::ATTENTION_MAP_MODE_PER_HEAD : v1::ATTENTION_MAP_MODE_NONE;
  if (params.attention_maps.has_value()) {
    const std::string& value = *params.attention_maps;
    if (value == "none") {
      mode = v1::ATTENTION_MAP_MODE_NONE;
    } else if (value == "per_head") {
      mode = v1::ATTENTION_MAP_MODE_PER_HEAD;
    } else if (value == "mean") {
      mode = v1::ATTENTION_MAP_MODE_MEAN;
    } else {
      return Invalid("parameters.attention_maps",
                     absl::StrCat("'", Abbreviate(value), "'; takes none, per_head or mean"));
    }
    if (maps_named && mode == v1::ATTENTION_MAP_MODE_NONE) {
      return Invalid("parameters.attention_maps",
                     "'none', but outputs names attention_maps (per_head or mean, or leave it out "
                     "for per_head)");
    }
    if (!maps_named && mode != v1::ATTENTION_MAP_MODE_NONE) {
      return Invalid("parameters.attention_maps",
                     absl::StrCat("'", Abbreviate(value),
                                  "' asks for maps, but outputs does not name attention_maps "
                                  "(maps are computed only when asked for by name)"));
    }
  }
  if (mode != v1::ATTENTION_MAP_MODE_NONE) request->mutable_attention_maps()->set_mode(mode);
  if (seen.contains(kHeadEntropy) || seen.contains(kHeadMaxWeight) ||
      seen.contains(kHeadContribution)) {
    request->mutable_attention_maps()->set_head_statistics(true);
  }
  form->raw = infer.raw_input_contents_size() > 0 || request->output_dtype() == v1::DATA_TYPE_BF16;
  return absl::OkStatus();
}

}  // namespace attnserve::server::open_inference
