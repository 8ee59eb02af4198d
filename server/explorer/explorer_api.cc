#include "server/explorer/explorer_api.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/client_context.h>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "cli/npy.h"
#include "core/attention_inputs.h"
#include "core/head_config.h"
#include "server/explorer/cell_mask.h"
#include "server/explorer/max_pool_grid.h"
#include "server/explorer/seeded_hidden_states.h"
#include "server/http/open_inference_rest.h"

namespace attnserve::server {
namespace {

using Json = nlohmann::json;
using Stub = v1::AttentionService::Stub;

std::string Dump(const Json& json) {
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

HttpResponse Error(int status, absl::string_view message) {
  return HttpResponse{.status = status, .body = JsonErrorBody(message)};
}

HttpResponse BadRequest(const absl::Status& status) { return Error(400, status.message()); }

HttpResponse FromGrpc(const grpc::Status& status) {
  if (status.error_message().empty()) {
    return Error(HttpStatusFor(status.error_code()),
                 absl::StrCat("the call ended with gRPC status ",
                              static_cast<int>(status.error_code())));
  }
  return Error(HttpStatusFor(status.error_code()), status.error_message());
}

// A gRPC error of an ad-hoc layer's call: core names the head configuration's
// fields "layer.head_config.x"; the explorer's JSON has them as "layer.x".
HttpResponse FromLayerGrpc(const grpc::Status& status) {
  constexpr absl::string_view kWire = "layer.head_config.";
  const std::string message = status.error_message();
  if (!absl::StartsWith(message, kWire)) return FromGrpc(status);
  return Error(HttpStatusFor(status.error_code()),
               absl::StrCat("layer.", absl::string_view(message).substr(kWire.size())));
}

void PassCredentials(const HttpRequest& request, grpc::ClientContext& context) {
  if (request.authorization.has_value()) {
    context.AddMetadata("authorization", *request.authorization);
  }
}

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::StatusOr<Json> ParseBody(const HttpRequest& request) {
  Json body = Json::parse(request.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return Invalid("request body", "not valid JSON");
  if (!body.is_object()) return Invalid("request body", "expected a JSON object");
  return body;
}

// An integer field in [min, max], or `fallback` when absent (nullopt: required).
absl::StatusOr<int64_t> IntField(const Json& object, const char* key, absl::string_view field,
                                 int64_t min, int64_t max, std::optional<int64_t> fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) {
    if (fallback) return *fallback;
    return Invalid(field, "required");
  }
  int64_t value;
  if (it->is_number_unsigned()) {
    const uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(max)) {
      return Invalid(field, absl::StrCat(u, " is outside [", min, ", ", max, "]"));
    }
    value = static_cast<int64_t>(u);
  } else if (it->is_number_integer()) {
    value = it->get<int64_t>();
  } else {
    return Invalid(field, "expected an integer");
  }
  if (value < min || value > max) {
    return Invalid(field, absl::StrCat(value, " is outside [", min, ", ", max, "]"));
  }
  return value;
}

absl::StatusOr<uint64_t> SeedField(const Json& object, absl::string_view field) {
  const auto it = object.find("seed");
  if (it == object.end() || it->is_null()) return Invalid(field, "required");
  if (it->is_number_unsigned()) return it->get<uint64_t>();
  if (it->is_number_integer()) return Invalid(field, "expected a non-negative integer");
  return Invalid(field, "expected an integer");
}

absl::StatusOr<bool> BoolField(const Json& object, const char* key, absl::string_view field) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return false;
  if (!it->is_boolean()) return Invalid(field, "expected true or false");
  return it->get<bool>();
}

std::string Base64OfFloats(const std::vector<float>& values) {
  return absl::Base64Escape(absl::string_view(reinterpret_cast<const char*>(values.data()),
                                              values.size() * sizeof(float)));
}

// A response tensor's FP32 values (raw_data or float_data), when it holds
// `expected` of them.
std::optional<std::vector<float>> Floats(const v1::Tensor& tensor, int64_t expected) {
  std::vector<float> values;
  if (!tensor.raw_data().empty()) {
    if (static_cast<int64_t>(tensor.raw_data().size()) != expected * 4) return std::nullopt;
    values.resize(static_cast<size_t>(expected));
    std::memcpy(values.data(), tensor.raw_data().data(), tensor.raw_data().size());
  } else {
    if (tensor.float_data_size() != expected) return std::nullopt;
    values.assign(tensor.float_data().begin(), tensor.float_data().end());
  }
  return values;
}

HttpResponse Internal(absl::string_view what) {
  return Error(500, absl::StrCat("internal: ", what));
}

// What one attend request asks for, validated against its model or ad-hoc
// layer.
struct AttendQuery {
  std::string model;               // empty for an ad-hoc layer
  std::optional<v1::LayerSpec> layer;
  std::string source;              // for messages: "model 'x'" or "the ad-hoc layer"
  int64_t seq_len = 0;
  int64_t d_model = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t max_seq_len = 0;
  int64_t max_map_bytes = 0;
  std::vector<float> hidden_states;  // [seq_len, d_model]
  bool causal = false;               // as asked
  bool model_causal = false;         // the model's own
  bool rotary = false;               // the model has RoPE
  std::vector<uint8_t> key_mask;     // empty: none
  std::vector<float> head_mask;      // empty: none
  int64_t grid = ExplorerApi::kDefaultGrid;
  struct Region {
    std::vector<int64_t> heads;
    int64_t q0, q1, k0, k1;
  };
  std::optional<Region> region;
  std::optional<int64_t> query_row;
};

absl::Status ParseInputs(const Json& body, AttendQuery& query) {
  const int64_t max_seq = query.max_seq_len;
  const auto it = body.find("inputs");
  if (it == body.end() || !it->is_object()) {
    return Invalid("inputs", "required: {\"random\": {\"seed\", \"seq_len\"}} or {\"npy\": base64}");
  }
  const bool random = it->contains("random");
  const bool npy = it->contains("npy");
  if (random == npy) return Invalid("inputs", "expected exactly one of \"random\" and \"npy\"");
  if (random) {
    const Json& spec = (*it)["random"];
    if (!spec.is_object()) return Invalid("inputs.random", "expected {\"seed\", \"seq_len\"}");
    absl::StatusOr<uint64_t> seed = SeedField(spec, "inputs.random.seed");
    if (!seed.ok()) return seed.status();
    absl::StatusOr<int64_t> seq_len =
        IntField(spec, "seq_len", "inputs.random.seq_len", 1, max_seq, std::nullopt);
    if (!seq_len.ok()) return seq_len.status();
    // An ad-hoc layer's d_model is the caller's: its inputs are bounded as
    // /explorer/api/inputs' are (a model's by its configuration).
    if (query.layer && *seq_len > ExplorerApi::kMaxInputValues / query.d_model) {
      return Invalid("inputs.random.seq_len",
                     absl::StrCat(*seq_len, " x d_model ", query.d_model, " values is over the limit of ",
                                  ExplorerApi::kMaxInputValues));
    }
    query.seq_len = *seq_len;
    query.hidden_states = SeededHiddenStates(*seed, query.seq_len, query.d_model);
    return absl::OkStatus();
  }
  const Json& text = (*it)["npy"];
  if (!text.is_string()) return Invalid("inputs.npy", "expected a string (base64 of a .npy file)");
  std::string bytes;
  if (!absl::Base64Unescape(text.get_ref<const std::string&>(), &bytes)) {
    return Invalid("inputs.npy", "not valid base64");
  }
  // (S, d_model) or (1, S, d_model): nothing larger is parsed or allocated.
  cli::NpyLimits limits;
  limits.max_header_bytes = 64 * 1024;
  limits.max_dims = 3;
  limits.max_elements = std::min(max_seq * query.d_model, ExplorerApi::kMaxInputValues);
  absl::StatusOr<cli::NpyArray> array = cli::ParseNpy(bytes, "inputs.npy", limits);
  if (!array.ok()) return array.status();
  std::vector<int64_t> shape = array->shape;
  if (shape.size() == 3 && shape[0] == 1) shape.erase(shape.begin());
  if (shape.size() != 2 || shape[1] != query.d_model || shape[0] < 1) {
    return Invalid("inputs.npy", absl::StrCat("shape: (", absl::StrJoin(array->shape, ", "),
                                              ") is not (seq_len, d_model) or (1, seq_len, "
                                              "d_model) with seq_len >= 1 and d_model ",
                                              query.d_model, " (", query.source, ")"));
  }
  if (shape[0] > max_seq) {
    return Invalid("inputs.npy", absl::StrCat("shape: seq_len ", shape[0],
                                              " is over the model's max_seq_len ", max_seq));
  }
  std::vector<float> values = array->ToFloats();
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return Invalid("inputs.npy",
                     absl::StrCat("data: row ", i / query.d_model, ", column ", i % query.d_model,
                                  " is ", values[i], "; hidden states must be finite"));
    }
  }
  query.seq_len = shape[0];
  query.hidden_states = std::move(values);
  return absl::OkStatus();
}

void QueryFromModel(const v1::ModelInfo& model, AttendQuery& query) {
  query.model = model.name();
  query.source = absl::StrCat("model '", model.name(), "'");
  query.d_model = model.head_config().d_model();
  query.num_heads = model.head_config().num_heads();
  query.num_kv_heads = model.head_config().num_kv_heads();
  query.max_seq_len = model.limits().max_seq_len();
  query.max_map_bytes = model.limits().max_attention_map_bytes();
  query.model_causal = model.causal();
  query.rotary = model.head_config().rotary().rotary_dim() > 0;
}

// The ad-hoc layer of `body["layer"]` as the AttendRequest.layer it runs
// (seeded weights), each size within the server's bounds. What the sizes
// must satisfy together (num_kv_heads divides num_heads, ...) and the weight
// bytes are Attend's to check.
absl::Status ParseLayer(const Json& layer, const ExplorerLayerLimits& limits, AttendQuery& query) {
  if (!layer.is_object()) {
    return Invalid("layer", "expected {\"d_model\", \"num_heads\", \"num_kv_heads\", \"head_dim\", "
                            "\"seed\", \"rotary\"}");
  }
  absl::StatusOr<int64_t> d_model =
      IntField(layer, "d_model", "layer.d_model", 1, core::kMaxDModel, std::nullopt);
  if (!d_model.ok()) return d_model.status();
  absl::StatusOr<int64_t> num_heads =
      IntField(layer, "num_heads", "layer.num_heads", 1, core::kMaxHeads, std::nullopt);
  if (!num_heads.ok()) return num_heads.status();
  absl::StatusOr<int64_t> num_kv_heads =
      IntField(layer, "num_kv_heads", "layer.num_kv_heads", 1, core::kMaxHeads, *num_heads);
  if (!num_kv_heads.ok()) return num_kv_heads.status();
  // 0: d_model / num_heads (Attend refuses when it does not divide).
  absl::StatusOr<int64_t> head_dim =
      IntField(layer, "head_dim", "layer.head_dim", 1, core::kMaxHeadDim, 0);
  if (!head_dim.ok()) return head_dim.status();
  uint64_t seed = 0;
  if (layer.contains("seed") && !layer["seed"].is_null()) {
    absl::StatusOr<uint64_t> given = SeedField(layer, "layer.seed");
    if (!given.ok()) return given.status();
    seed = *given;
  }
  v1::LayerSpec spec;
  v1::HeadConfig& config = *spec.mutable_head_config();
  config.set_d_model(static_cast<int32_t>(*d_model));
  config.set_num_heads(static_cast<int32_t>(*num_heads));
  config.set_num_kv_heads(static_cast<int32_t>(*num_kv_heads));
  config.set_head_dim(static_cast<int32_t>(*head_dim));
  spec.set_seed(seed);
  const auto it = layer.find("rotary");
  const bool off = it == layer.end() || it->is_null() || (it->is_boolean() && !it->get<bool>());
  if (!off) {
    if (!it->is_object() && !it->is_boolean()) {
      return Invalid("layer.rotary", "expected {\"theta\", \"rotary_dim\"} (each optional), true, "
                                     "or null (no RoPE)");
    }
    const Json rotary = it->is_object() ? *it : Json::object();
    const int64_t full = *head_dim > 0 ? *head_dim : *d_model / *num_heads;
    absl::StatusOr<int64_t> rotary_dim =
        IntField(rotary, "rotary_dim", "layer.rotary.rotary_dim", 1, core::kMaxHeadDim, full);
    if (!rotary_dim.ok()) return rotary_dim.status();
    config.mutable_rotary()->set_rotary_dim(static_cast<int32_t>(*rotary_dim));
    if (auto theta = rotary.find("theta"); theta != rotary.end() && !theta->is_null()) {
      const double value = theta->is_number() ? theta->get<double>() : 0.0;
      if (!theta->is_number() || !std::isfinite(value) || value <= 1.0 ||
          value > std::numeric_limits<float>::max()) {
        return Invalid("layer.rotary.theta", "expected a number > 1 (and within float32's range)");
      }
      config.mutable_rotary()->set_theta(static_cast<float>(value));
    }
    query.rotary = *rotary_dim > 0;
  }
  query.layer = std::move(spec);
  query.source = "the ad-hoc layer";
  query.d_model = *d_model;
  query.num_heads = *num_heads;
  query.num_kv_heads = *num_kv_heads;
  query.max_seq_len = limits.max_seq_len;
  query.max_map_bytes = limits.max_attention_map_bytes;
  query.model_causal = false;
  return absl::OkStatus();
}

// The layer that ran, as the answer echoes it: the request's head
// configuration with Attend's defaults resolved.
Json LayerEcho(const v1::LayerSpec& layer) {
  const v1::HeadConfig& c = layer.head_config();
  const int64_t head_dim = c.head_dim() > 0 ? c.head_dim() : c.d_model() / c.num_heads();
  Json rotary = nullptr;
  if (c.rotary().rotary_dim() > 0) {
    rotary = {{"rotary_dim", c.rotary().rotary_dim()},
              {"theta", c.rotary().theta() != 0.0f ? c.rotary().theta() : core::RotaryConfig{}.theta}};
  }
  return {{"d_model", c.d_model()},
          {"num_heads", c.num_heads()},
          {"num_kv_heads", c.num_kv_heads()},
          {"head_dim", head_dim},
          {"scale", 1.0 / std::sqrt(static_cast<double>(head_dim))},
          {"seed", layer.seed()},
          {"rotary", std::move(rotary)}};
}

absl::Status ParseAttend(const Json& body, AttendQuery& query) {
  if (absl::Status status = ParseInputs(body, query); !status.ok()) return status;
  const int64_t s = query.seq_len;
  const int64_t h = query.num_heads;
  absl::StatusOr<bool> causal = BoolField(body, "causal", "causal");
  if (!causal.ok()) return causal.status();
  query.causal = *causal;

  if (auto it = body.find("key_mask"); it != body.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != s) {
      return Invalid("key_mask", absl::StrCat("expected an array of seq_len ", s,
                                              " entries (0 = key masked out, 1 = kept)"));
    }
    query.key_mask.resize(static_cast<size_t>(s));
    bool any = false;
    for (int64_t i = 0; i < s; ++i) {
      const Json& v = (*it)[static_cast<size_t>(i)];
      if (v.is_boolean()) {
        query.key_mask[static_cast<size_t>(i)] = v.get<bool>() ? 1 : 0;
      } else if (v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1)) {
        query.key_mask[static_cast<size_t>(i)] = static_cast<uint8_t>(v.get<int64_t>());
      } else {
        return Invalid(absl::StrCat("key_mask[", i, "]"), "expected 0 or 1");
      }
      any = any || query.key_mask[static_cast<size_t>(i)] != 0;
    }
    if (!any) return Invalid("key_mask", "masks every key; keep at least one");
    if ((query.causal || query.model_causal) && query.key_mask[0] == 0) {
      return Invalid("key_mask", "with causal attention query 0 sees only key 0, which key_mask "
                                 "removes; keep key 0");
    }
  }
  if (auto it = body.find("head_mask"); it != body.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != h) {
      return Invalid("head_mask", absl::StrCat("expected an array of num_heads ", h,
                                               " entries (0 removes a head, 1 keeps it)"));
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const Json& v = (*it)[i];
      if (v.is_boolean()) {
        query.head_mask.push_back(v.get<bool>() ? 1.0f : 0.0f);
      } else if (v.is_number()) {
        query.head_mask.push_back(v.get<float>());
      } else {
        return Invalid(absl::StrCat("head_mask[", i, "]"), "expected a number");
      }
    }
  }
  absl::StatusOr<int64_t> grid =
      IntField(body, "grid", "grid", 0, ExplorerApi::kMaxGrid, ExplorerApi::kDefaultGrid);
  if (!grid.ok()) return grid.status();
  query.grid = *grid;

  if (auto it = body.find("region"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return Invalid("region", "expected {\"head\", \"q0\", \"q1\", \"k0\", \"k1\"}");
    AttendQuery::Region region;
    if (it->contains("head") && !(*it)["head"].is_null()) {
      absl::StatusOr<int64_t> head = IntField(*it, "head", "region.head", 0, h - 1, std::nullopt);
      if (!head.ok()) return head.status();
      region.heads = {*head};
    } else {
      for (int64_t i = 0; i < h; ++i) region.heads.push_back(i);
    }
    absl::StatusOr<int64_t> q0 = IntField(*it, "q0", "region.q0", 0, s - 1, std::nullopt);
    if (!q0.ok()) return q0.status();
    absl::StatusOr<int64_t> q1 = IntField(*it, "q1", "region.q1", *q0 + 1, s, std::nullopt);
    if (!q1.ok()) return q1.status();
    absl::StatusOr<int64_t> k0 = IntField(*it, "k0", "region.k0", 0, s - 1, std::nullopt);
    if (!k0.ok()) return k0.status();
    absl::StatusOr<int64_t> k1 = IntField(*it, "k1", "region.k1", *k0 + 1, s, std::nullopt);
    if (!k1.ok()) return k1.status();
    region.q0 = *q0;
    region.q1 = *q1;
    region.k0 = *k0;
    region.k1 = *k1;
    // Each factor is at most 2^31 (seq_len and num_heads are int32 on the
    // wire): no overflow.
    const int64_t cells = static_cast<int64_t>(region.heads.size()) * (*q1 - *q0) * (*k1 - *k0);
    if (cells > ExplorerApi::kMaxRegionCells) {
      return Invalid("region", absl::StrCat(cells, " cells (", region.heads.size(), " heads x ",
                                            *q1 - *q0, " x ", *k1 - *k0,
                                            ") is over limits.max_region_cells ",
                                            ExplorerApi::kMaxRegionCells,
                                            "; ask for a smaller region or one head"));
    }
    query.region = std::move(region);
  }
  if (body.contains("query_row") && !body["query_row"].is_null()) {
    absl::StatusOr<int64_t> row = IntField(body, "query_row", "query_row", 0, s - 1, std::nullopt);
    if (!row.ok()) return row.status();
    query.query_row = *row;
  }
  return absl::OkStatus();
}

// Rows [r0, r1) of states [seq_len, d_model] as an FP32 tensor [1, r1 - r0, d_model].
void SetStates(const std::vector<float>& states, int64_t r0, int64_t r1, int64_t d_model,
               v1::Tensor& tensor) {
  tensor.Clear();
  tensor.set_dtype(v1::DATA_TYPE_FP32);
  tensor.add_shape(1);
  tensor.add_shape(r1 - r0);
  tensor.add_shape(d_model);
  tensor.set_raw_data(std::string(reinterpret_cast<const char*>(states.data() + r0 * d_model),
                                  static_cast<size_t>((r1 - r0) * d_model) * sizeof(float)));
}

// An explicit KIND_ALLOWED mask [1, rows, seq_len] (1 = the query may attend
// to the key).
void SetAllowed(v1::AttentionMask* mask, int64_t rows, int64_t seq_len,
                const std::vector<uint8_t>& allowed) {
  mask->set_kind(v1::AttentionMask::KIND_ALLOWED);
  v1::Tensor* values = mask->mutable_values();
  values->set_dtype(v1::DATA_TYPE_BOOL);
  values->add_shape(1);
  values->add_shape(rows);
  values->add_shape(seq_len);
  values->set_raw_data(std::string(allowed.begin(), allowed.end()));
}

double Norm(const std::vector<float>& values) {
  double sum = 0;
  for (float v : values) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

}  // namespace

ExplorerApi::ExplorerApi(std::shared_ptr<grpc::Channel> channel, int64_t max_body_bytes,
                         const ExplorerLayerLimits& layer_limits)
    : channel_(std::move(channel)), max_body_bytes_(max_body_bytes), layer_limits_(layer_limits) {}

HttpResponse ExplorerApi::Models(const HttpRequest& request) const {
  std::unique_ptr<Stub> stub = v1::AttentionService::NewStub(channel_);
  grpc::ClientContext context;
  PassCredentials(request, context);
  v1::ListModelsResponse list;
  grpc::Status status = stub->ListModels(&context, v1::ListModelsRequest(), &list);
  if (!status.ok()) return FromGrpc(status);
  Json models = Json::array();
  for (const v1::ModelInfo& model : list.models()) {
    if (model.state() != v1::MODEL_STATE_READY) continue;
    const v1::HeadConfig& config = model.head_config();
    models.push_back({{"name", model.name()},
                      {"d_model", config.d_model()},
                      {"num_heads", config.num_heads()},
                      {"num_kv_heads", config.num_kv_heads()},
                      {"head_dim", config.head_dim()},
                      {"max_seq_len", model.limits().max_seq_len()},
                      {"max_attention_map_bytes", model.limits().max_attention_map_bytes()},
                      {"causal", model.causal()},
                      {"description", model.description()}});
  }
  Json body = {{"models", std::move(models)},
               {"limits",
                {{"max_body_bytes", max_body_bytes_},
                 {"max_grid", kMaxGrid},
                 {"max_region_cells", kMaxRegionCells},
                 {"layer",
                  {{"max_d_model", core::kMaxDModel},
                   {"max_heads", core::kMaxHeads},
                   {"max_head_dim", core::kMaxHeadDim},
                   {"max_weight_bytes", layer_limits_.max_weight_bytes},
                   {"max_seq_len", layer_limits_.max_seq_len},
                   {"max_attention_map_bytes", layer_limits_.max_attention_map_bytes},
                   {"max_input_values", kMaxInputValues}}}}}};
  return HttpResponse{.body = Dump(body)};
}

HttpResponse ExplorerApi::Inputs(const HttpRequest& request) const {
  absl::StatusOr<Json> body = ParseBody(request);
  if (!body.ok()) return BadRequest(body.status());
  absl::StatusOr<uint64_t> seed = SeedField(*body, "seed");
  if (!seed.ok()) return BadRequest(seed.status());
  absl::StatusOr<int64_t> seq_len =
      IntField(*body, "seq_len", "seq_len", 1, kMaxInputValues, std::nullopt);
  if (!seq_len.ok()) return BadRequest(seq_len.status());
  absl::StatusOr<int64_t> d_model =
      IntField(*body, "d_model", "d_model", 1, kMaxInputValues, std::nullopt);
  if (!d_model.ok()) return BadRequest(d_model.status());
  if (*seq_len * *d_model > kMaxInputValues) {  // each factor <= 2^24: no overflow
    return BadRequest(Invalid("seq_len", absl::StrCat(*seq_len, " x d_model ", *d_model,
                                                      " values is over the limit of ",
                                                      kMaxInputValues)));
  }
  const std::vector<float> states = SeededHiddenStates(*seed, *seq_len, *d_model);
  const std::vector<int64_t> shape = {*seq_len, *d_model};
  return HttpResponse{.body = Dump(Json{{"npy", absl::Base64Escape(cli::EncodeNpyFloat32(shape, states))}})};
}

HttpResponse ExplorerApi::Attend(const HttpRequest& request) const {
  const absl::Time start = absl::Now();
  absl::StatusOr<Json> body = ParseBody(request);
  if (!body.ok()) return BadRequest(body.status());
  const auto model_it = body->find("model");
  const auto layer_it = body->find("layer");
  const bool has_model = model_it != body->end() && !model_it->is_null();
  const bool has_layer = layer_it != body->end() && !layer_it->is_null();
  if (has_model && has_layer) {
    return BadRequest(Invalid("model", "give a model or an ad-hoc layer, not both"));
  }
  if (!has_layer && (!has_model || !model_it->is_string() ||
                     model_it->get_ref<const std::string&>().empty())) {
    return BadRequest(Invalid("model", "required: a model's name (see /explorer/api/models), or "
                                       "an ad-hoc \"layer\""));
  }
  std::unique_ptr<Stub> stub = v1::AttentionService::NewStub(channel_);
  AttendQuery query;
  if (has_model) {
    v1::ModelInfo model;
    grpc::ClientContext context;
    PassCredentials(request, context);
    v1::GetModelRequest get;
    get.set_name(model_it->get<std::string>());
    grpc::Status status = stub->GetModel(&context, get, &model);
    if (!status.ok()) return FromGrpc(status);
    if (model.state() != v1::MODEL_STATE_READY) {
      return Error(503, absl::StrCat("model: '", model.name(), "' is not ready (",
                                     v1::ModelState_Name(model.state()), ")"));
    }
    QueryFromModel(model, query);
  } else if (absl::Status status = ParseLayer(*layer_it, layer_limits_, query); !status.ok()) {
    return BadRequest(status);
  }
  if (absl::Status status = ParseAttend(*body, query); !status.ok()) {
    return BadRequest(status);
  }
  const auto from_grpc = [&query](const grpc::Status& status) {
    return query.layer ? FromLayerGrpc(status) : FromGrpc(status);
  };
  const int64_t s = query.seq_len;
  const int64_t h = query.num_heads;

  const int64_t d = query.d_model;
  auto call = [&](const v1::AttendRequest& attend, v1::AttendResponse& response) {
    grpc::ClientContext context;
    PassCredentials(request, context);
    return stub->Attend(&context, attend, &response);
  };

  // The request as asked (self-attention over the whole sequence), without
  // maps: its output is the one Attend gives, on the kernel path such a
  // request runs.
  v1::AttendRequest attend;
  if (query.layer) {
    *attend.mutable_layer() = *query.layer;
  } else {
    attend.set_model(query.model);
  }
  SetStates(query.hidden_states, 0, s, d, *attend.mutable_hidden_states());
  attend.set_causal(query.causal);
  if (!query.key_mask.empty()) {
    SetAllowed(attend.mutable_mask(), 1, s, query.key_mask);
  }
  for (float gate : query.head_mask) attend.add_head_mask(gate);
  v1::AttendResponse plain;
  if (grpc::Status status = call(attend, plain); !status.ok()) return from_grpc(status);
  std::optional<std::vector<float>> output = Floats(plain.output(), s * d);
  if (!output) return Internal("Attend's output does not have the size asked for");
  Json output_json = {{"norm", Norm(*output)}};

  // Maps and statistics, chunk by chunk of query rows. Attend computes the
  // scores of every head for all the query rows of a self-attention request
  // (AttentionMapRequest.query_rows only selects the rows it returns), so a
  // chunk is asked as cross-attention of its rows over the same states (the
  // same keys and values; RoPE positions from position_offsets, as the
  // context's keys are at 0, 1, ...), with the causal and key masks as an
  // explicit mask: Attend then holds num_heads x rows x seq_len scores. A
  // causal model (causal for every request, aligned at the chunk's first
  // row) is asked as self-attention with query_rows instead.
  const bool cross = !query.model_causal;
  const CellMask mask(query.causal || query.model_causal, query.key_mask);
  auto needed = [&query](int64_t q) {
    return query.grid > 0 || (query.query_row && q == *query.query_row) ||
           (query.region && q >= query.region->q0 && q < query.region->q1);
  };
  std::vector<int64_t> heads;  // the heads whose maps each chunk asks for
  if (query.grid > 0 || query.query_row || !query.region) {
    for (int64_t i = 0; i < h; ++i) heads.push_back(i);
  } else {
    heads = query.region->heads;
  }
  const int64_t nh = static_cast<int64_t>(heads.size());
  // A chunk's rows hold the scores of every head, and the maps asked for.
  const int64_t row_bytes = h * s * 4;
  const int64_t chunk_budget = std::min(query.max_map_bytes, kMaxChunkMapBytes);
  const int64_t rows_per_chunk = chunk_budget / row_bytes;
  if (rows_per_chunk < 1) {
    return Error(400, absl::StrCat(query.grid > 0 ? "grid" : (query.region ? "region" : "query_row"),
                                   ": one query row of ", h, " heads at seq_len ", s, " is ",
                                   row_bytes, " bytes of maps, over ", query.source,
                                   "'s max_attention_map_bytes ", query.max_map_bytes,
                                   " (--max_attention_map_bytes)"));
  }

  std::optional<MaxPoolGrid> grid;
  if (query.grid > 0) grid.emplace(h, s, query.grid);
  std::vector<float> region;
  if (query.region) {
    region.assign(query.region->heads.size() *
                      static_cast<size_t>(query.region->q1 - query.region->q0) *
                      static_cast<size_t>(query.region->k1 - query.region->k0),
                  -1.0f);
  }
  std::vector<float> row;
  if (query.query_row) row.assign(static_cast<size_t>(h * s), -1.0f);
  // Statistics over all query rows: entropy and max_weight are means over
  // rows (summed weighted by each chunk's rows), contribution a Frobenius
  // norm over tokens (squares summed).
  std::vector<double> entropy(static_cast<size_t>(h)), max_weight(static_cast<size_t>(h)),
      contribution(static_cast<size_t>(h));
  bool have_statistics = false;

  v1::AttendRequest chunk_request;
  if (cross) {
    if (query.layer) {
      *chunk_request.mutable_layer() = *query.layer;
    } else {
      chunk_request.set_model(query.model);
    }
    *chunk_request.mutable_context() = attend.hidden_states();
    for (float gate : query.head_mask) chunk_request.add_head_mask(gate);
  }
  for (int64_t r0 = 0; r0 < s; r0 += rows_per_chunk) {
    const int64_t r1 = std::min(s, r0 + rows_per_chunk);
    const int64_t n = r1 - r0;
    std::vector<int64_t> wanted;
    for (int64_t q = r0; q < r1; ++q) {
      if (needed(q)) wanted.push_back(q);
    }
    if (!cross && wanted.empty() && have_statistics) continue;
    v1::AttendRequest& chunk = cross ? chunk_request : attend;
    if (cross) {
      SetStates(query.hidden_states, r0, r1, d, *chunk.mutable_hidden_states());
      chunk.clear_position_offsets();
      if (query.rotary) chunk.add_position_offsets(r0);
      chunk.clear_mask();
      if (query.causal) {
        std::vector<uint8_t> allowed(static_cast<size_t>(n * s));
        for (int64_t q = r0; q < r1; ++q) {
          for (int64_t k = 0; k < s; ++k) {
            allowed[static_cast<size_t>((q - r0) * s + k)] = mask.masked(q, k) ? 0 : 1;
          }
        }
        SetAllowed(chunk.mutable_mask(), n, s, allowed);
      } else if (!query.key_mask.empty()) {
        SetAllowed(chunk.mutable_mask(), 1, s, query.key_mask);
      }
    }
    v1::AttentionMapRequest* maps = chunk.mutable_attention_maps();
    maps->Clear();
    maps->set_head_statistics(cross || !have_statistics);
    if (!wanted.empty()) {
      maps->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
      if (nh != h) {
        for (int64_t head : heads) maps->add_heads(static_cast<int32_t>(head));
      }
      if (!cross || static_cast<int64_t>(wanted.size()) != n) {
        for (int64_t q : wanted) maps->add_query_rows(static_cast<int32_t>(cross ? q - r0 : q));
      }
    }
    v1::AttendResponse response;
    if (grpc::Status status = call(chunk, response); !status.ok()) return from_grpc(status);

    if (cross || !have_statistics) {
      const v1::HeadStatistics& statistics = response.head_statistics();
      std::optional<std::vector<float>> e = Floats(statistics.entropy(), h);
      std::optional<std::vector<float>> m = Floats(statistics.max_weight(), h);
      std::optional<std::vector<float>> c = Floats(statistics.contribution(), h);
      if (!e || !m || !c) return Internal("Attend's head_statistics do not have num_heads values");
      // Self-attention: the statistics of every row at once.
      const double rows = cross ? static_cast<double>(n) : static_cast<double>(s);
      for (size_t i = 0; i < static_cast<size_t>(h); ++i) {
        entropy[i] += (*e)[i] * rows;
        max_weight[i] += (*m)[i] * rows;
        contribution[i] += static_cast<double>((*c)[i]) * (*c)[i];
      }
      have_statistics = true;
    }
    if (wanted.empty()) continue;
    const int64_t w = static_cast<int64_t>(wanted.size());
    std::optional<std::vector<float>> values = Floats(response.attention_maps(), nh * w * s);
    if (!values) return Internal("Attend's maps do not have the size asked for");
    const float* base = values->data();
    if (grid) grid->AddRows(wanted, *values, mask);
    for (int64_t r = 0; r < w; ++r) {
      const int64_t q = wanted[static_cast<size_t>(r)];
      if (query.query_row && q == *query.query_row) {
        for (int64_t head = 0; head < h; ++head) {
          for (int64_t k = 0; k < s; ++k) {
            row[static_cast<size_t>(head * s + k)] =
                mask.masked(q, k) ? -1.0f : base[(head * w + r) * s + k];
          }
        }
      }
      if (query.region && q >= query.region->q0 && q < query.region->q1) {
        const AttendQuery::Region& g = *query.region;
        const int64_t width = g.k1 - g.k0;
        for (size_t i = 0; i < g.heads.size(); ++i) {
          // The head's index among those the chunk asked for.
          const int64_t at = static_cast<int64_t>(
              std::find(heads.begin(), heads.end(), g.heads[i]) - heads.begin());
          float* out =
              region.data() + (static_cast<int64_t>(i) * (g.q1 - g.q0) + (q - g.q0)) * width;
          for (int64_t k = g.k0; k < g.k1; ++k) {
            out[k - g.k0] = mask.masked(q, k) ? -1.0f : base[(at * w + r) * s + k];
          }
        }
      }
    }
  }
  Json stats = Json::object();
  std::vector<double> mean_entropy(static_cast<size_t>(h)), mean_max(static_cast<size_t>(h)),
      norm_contribution(static_cast<size_t>(h));
  for (size_t i = 0; i < static_cast<size_t>(h); ++i) {
    mean_entropy[i] = entropy[i] / static_cast<double>(s);
    mean_max[i] = max_weight[i] / static_cast<double>(s);
    norm_contribution[i] = std::sqrt(contribution[i]);
  }
  stats["entropy"] = mean_entropy;
  stats["max_weight"] = mean_max;
  stats["contribution"] = norm_contribution;

  const bool head_off = std::any_of(query.head_mask.begin(), query.head_mask.end(),
                                    [](float gate) { return gate != 1.0f; });
  if (head_off) {
    attend.clear_head_mask();
    attend.clear_attention_maps();
    v1::AttendResponse full;
    if (grpc::Status status = call(attend, full); !status.ok()) return from_grpc(status);
    std::optional<std::vector<float>> full_output = Floats(full.output(), s * d);
    if (!full_output) return Internal("Attend's output does not have the size asked for");
    double difference = 0;
    for (size_t i = 0; i < output->size(); ++i) {
      const double delta = static_cast<double>((*output)[i]) - (*full_output)[i];
      difference += delta * delta;
    }
    const double full_norm = Norm(*full_output);
    output_json["relative_change"] =
        full_norm > 0 ? Json(std::sqrt(difference) / full_norm) : Json(nullptr);
  }
  const v1::AttendResponse& first = plain;

  Json answer = {{"seq_len", s},
                 {"num_heads", h},
                 {"num_kv_heads", query.num_kv_heads},
                 {"d_model", query.d_model},
                 {"causal", query.causal || query.model_causal},
                 {"kernel_path", first.kernel_path()},
                 {"stats", std::move(stats)},
                 {"output", std::move(output_json)}};
  if (query.layer) {
    answer["layer"] = LayerEcho(*query.layer);
  } else {
    answer["model"] = query.model;
  }
  if (grid) {
    answer["grid"] = {{"pool", grid->pool()},
                      {"rows", grid->rows()},
                      {"cols", grid->cols()},
                      {"data", Base64OfFloats(grid->cells())}};
  }
  if (query.region) {
    answer["region"] = {{"heads", query.region->heads},
                        {"q0", query.region->q0},
                        {"q1", query.region->q1},
                        {"k0", query.region->k0},
                        {"k1", query.region->k1},
                        {"data", Base64OfFloats(region)}};
  }
  if (query.query_row) {
    answer["row"] = {{"query", *query.query_row}, {"data", Base64OfFloats(row)}};
  }
  answer["seconds"] = absl::ToDoubleSeconds(absl::Now() - start);
  return HttpResponse{.body = Dump(answer)};
}

HttpResponse ExplorerApi::Session(const HttpRequest& request) const {
  const absl::Time start = absl::Now();
  absl::StatusOr<Json> body = ParseBody(request);
  if (!body.ok()) return BadRequest(body.status());
  const auto id = body->find("session_id");
  if (id == body->end() || !id->is_string() || id->get_ref<const std::string&>().empty()) {
    return BadRequest(Invalid("session_id", "required: the id OpenSession returned"));
  }
  absl::StatusOr<int64_t> layer =
      IntField(*body, "layer", "layer", 0, std::numeric_limits<int32_t>::max(), 0);
  if (!layer.ok()) return BadRequest(layer.status());
  absl::StatusOr<int64_t> cols = IntField(*body, "cols", "cols", 1, kMaxSessionCols, kDefaultSessionCols);
  if (!cols.ok()) return BadRequest(cols.status());
  // A range of keys at full resolution: {"k0", "k1"}, checked against the
  // layer's length once it is known.
  std::optional<std::pair<int64_t, int64_t>> keys;
  if (const auto it = body->find("keys"); it != body->end() && !it->is_null()) {
    if (!it->is_object()) return BadRequest(Invalid("keys", "expected {\"k0\", \"k1\"}"));
    absl::StatusOr<int64_t> k0 =
        IntField(*it, "k0", "keys.k0", 0, std::numeric_limits<int64_t>::max() - 1, std::nullopt);
    if (!k0.ok()) return BadRequest(k0.status());
    absl::StatusOr<int64_t> k1 =
        IntField(*it, "k1", "keys.k1", *k0 + 1, std::numeric_limits<int64_t>::max(), std::nullopt);
    if (!k1.ok()) return BadRequest(k1.status());
    keys.emplace(*k0, *k1);
  }

  std::unique_ptr<Stub> stub = v1::AttentionService::NewStub(channel_);
  grpc::ClientContext context;
  PassCredentials(request, context);
  v1::LatestAttentionRequest read;
  read.set_session_id(id->get<std::string>());
  read.set_layer(static_cast<int32_t>(*layer));
  v1::LatestAttention latest;
  if (grpc::Status status = stub->GetLatestAttention(&context, read, &latest); !status.ok()) {
    return FromGrpc(status);
  }
  const v1::Tensor& maps = latest.maps();
  if (maps.shape_size() != 2 || latest.length() < 1 || maps.shape(1) != latest.length() ||
      maps.shape(0) < 1) {
    return Internal("GetLatestAttention's maps are not [num_heads, length >= 1]");
  }
  const int64_t h = maps.shape(0);
  const int64_t length = latest.length();
  // Read in place (the answer may be up to --max_attention_map_bytes).
  if (static_cast<int64_t>(maps.raw_data().size()) != h * length * 4) {
    return Internal("GetLatestAttention's maps are not FP32 raw_data of their shape's size");
  }
  const char* const raw = maps.raw_data().data();
  auto weight = [raw, length](int64_t head, int64_t k) {
    float v;
    std::memcpy(&v, raw + 4 * (head * length + k), sizeof v);
    return v;
  };
  if (keys && keys->second > length) {
    return BadRequest(Invalid("keys.k1", absl::StrCat(keys->second, " is past the layer's length ", length)));
  }
  if (keys && h * (keys->second - keys->first) > kMaxRegionCells) {
    return BadRequest(Invalid("keys", absl::StrCat(h, " heads x ", keys->second - keys->first,
                                                   " keys is over the limit of ", kMaxRegionCells,
                                                   " cells (limits.max_region_cells)")));
  }

  // Max-pooled over keys (no peak disappears): column c holds keys
  // [c pool, (c + 1) pool).
  const int64_t pool = (length + *cols - 1) / *cols;
  const int64_t pooled_cols = (length + pool - 1) / pool;
  std::vector<float> pooled(static_cast<size_t>(h * pooled_cols), 0.0f);
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t k = 0; k < length; ++k) {
      float& cell = pooled[head * pooled_cols + k / pool];
      cell = std::max(cell, weight(head, k));
    }
  }
  std::optional<std::vector<float>> entropy = Floats(latest.head_statistics().entropy(), h);
  std::optional<std::vector<float>> max_weight = Floats(latest.head_statistics().max_weight(), h);
  if (!entropy || !max_weight) return Internal("GetLatestAttention's statistics are not [num_heads]");
  Json stats = {{"entropy", *entropy}, {"max_weight", *max_weight}};
  Json answer = {{"session_id", latest.session_id()},
                 {"layer", latest.layer()},
                 {"length", length},
                 {"position", latest.position()},
                 {"num_heads", h},
                 {"pool", pool},
                 {"cols", pooled_cols},
                 {"data", Base64OfFloats(pooled)},
                 {"stats", std::move(stats)}};
  if (keys) {
    std::vector<float> range;
    range.reserve(static_cast<size_t>(h * (keys->second - keys->first)));
    for (int64_t head = 0; head < h; ++head) {
      for (int64_t k = keys->first; k < keys->second; ++k) range.push_back(weight(head, k));
    }
    answer["keys"] = {{"k0", keys->first}, {"k1", keys->second}, {"data", Base64OfFloats(range)}};
  }
  answer["seconds"] = absl::ToDoubleSeconds(absl::Now() - start);
  return HttpResponse{.body = Dump(answer)};
}

}  // namespace attnserve::server
