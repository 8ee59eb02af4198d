#include "core/checkpoint_layouts.h"

#include <cmath>
#include <cstdint>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace attnserve::core {
namespace {

using Json = nlohmann::json;

absl::Status ConfigError(absl::string_view display_name, absl::string_view field,
                         absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(display_name, ": ", field, ": ", what));
}

// A plain file name: [A-Za-z0-9._-], not starting with '.', at most 255 bytes.
bool IsPlainFileName(absl::string_view name) {
  if (name.empty() || name.size() > 255 || name[0] == '.') return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::StatusOr<int64_t> IntField(const Json& object, const char* field,
                                 absl::string_view display_name, int64_t fallback, bool required) {
  const auto it = object.find(field);
  if (it == object.end()) {
    if (required) return ConfigError(display_name, field, "required");
    return fallback;
  }
  if (!it->is_number_integer()) return ConfigError(display_name, field, "must be an integer");
  const int64_t value = it->get<int64_t>();
  if (it->is_number_unsigned() && it->get<uint64_t>() > (uint64_t{1} << 40)) {
    return ConfigError(display_name, field, "out of range");
  }
  return value;
}

// config.json's "layers" object: {count, prefix} (prefix holding
// kLayerPlaceholder) or {prefixes}; one prefix per layer into *prefixes.
absl::Status ParseLayers(const Json& layers, absl::string_view display_name,
                         std::vector<std::string>* prefixes) {
  const std::string kShape = "must be {\"count\": N, \"prefix\": \"h.{layer}.attn.\"} or "
                             "{\"prefixes\": [\"...\", ...]}";
  if (!layers.is_object()) return ConfigError(display_name, "layers", kShape);
  for (const auto& [key, unused] : layers.items()) {
    if (key != "count" && key != "prefix" && key != "prefixes") {
      return ConfigError(display_name, absl::StrCat("layers.", key.substr(0, 64)),
                         "unknown field (known: count, prefix, prefixes)");
    }
  }
  const bool listed = layers.contains("prefixes");
  if (listed && (layers.contains("count") || layers.contains("prefix"))) {
    return ConfigError(display_name, "layers",
                       "give count and prefix, or prefixes, not both");
  }
  if (listed) {
    const Json& list = layers["prefixes"];
    if (!list.is_array() || list.empty() ||
        list.size() > static_cast<size_t>(kMaxCheckpointLayers)) {
      return ConfigError(display_name, "layers.prefixes",
                         absl::StrCat("must be a list of 1 to ", kMaxCheckpointLayers,
                                      " prefixes (strings), one per layer in order"));
    }
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string field = absl::StrCat("layers.prefixes[", i, "]");
      if (!list[i].is_string()) return ConfigError(display_name, field, "must be a string");
      std::string prefix = list[i].get<std::string>();
      if (prefix.size() > kMaxTensorPrefixBytes) {
        return ConfigError(display_name, field,
                           absl::StrCat("longer than ", kMaxTensorPrefixBytes, " bytes"));
      }
      for (size_t j = 0; j < prefixes->size(); ++j) {
        if ((*prefixes)[j] == prefix) {
          return ConfigError(display_name, field,
                             absl::StrCat("the same as layers.prefixes[", j,
                                          "] (each layer has its own tensors)"));
        }
      }
      prefixes->push_back(std::move(prefix));
    }
    return absl::OkStatus();
  }
  if (!layers.contains("count")) return ConfigError(display_name, "layers.count", "required");
  if (!layers.contains("prefix")) {
    return ConfigError(display_name, "layers.prefix",
                       absl::StrCat("required with layers.count, holding ", kLayerPlaceholder,
                                    " (e.g. \"h.", kLayerPlaceholder, ".attn.\")"));
  }
  const Json& count = layers["count"];
  if (!count.is_number_integer() || count.get<int64_t>() < 1 ||
      (count.is_number_unsigned() && count.get<uint64_t>() > uint64_t{kMaxCheckpointLayers}) ||
      count.get<int64_t>() > kMaxCheckpointLayers) {
    return ConfigError(display_name, "layers.count",
                       absl::StrCat("must be an integer in [1, ", kMaxCheckpointLayers, "], got ",
                                    count.dump().substr(0, 64)));
  }
  const Json& pattern = layers["prefix"];
  if (!pattern.is_string()) return ConfigError(display_name, "layers.prefix", "must be a string");
  const std::string& text = pattern.get_ref<const std::string&>();
  if (!absl::StrContains(text, kLayerPlaceholder)) {
    return ConfigError(display_name, "layers.prefix",
                       absl::StrCat("'", text.substr(0, 64), "' does not hold ", kLayerPlaceholder,
                                    " (where each layer's index goes, e.g. \"h.",
                                    kLayerPlaceholder, ".attn.\")"));
  }
  const int64_t n = count.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    std::string prefix = absl::StrReplaceAll(text, {{kLayerPlaceholder, absl::StrCat(i)}});
    if (prefix.size() > kMaxTensorPrefixBytes) {
      return ConfigError(display_name, "layers.prefix",
                         absl::StrCat("layer ", i, "'s prefix is longer than ",
                                      kMaxTensorPrefixBytes, " bytes"));
    }
    prefixes->push_back(std::move(prefix));
  }
  return absl::OkStatus();
}

// The stored shape of `tensor` as "[a, b]".
std::string ShapeText(const SafetensorsTensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape, ", "), "]");
}

absl::Status ShapeMismatch(const SafetensorsFile& file, absl::string_view full_name,
                           const SafetensorsTensor& tensor, const std::vector<int64_t>& shape) {
  return absl::InvalidArgumentError(absl::StrCat(
      file.display_name(), ": tensor '", full_name, "' has shape ", ShapeText(tensor),
      "; the head configuration needs [", absl::StrJoin(shape, ", "), "]"));
}

// One tensor a layout reads: its name after the prefix, the shape the head
// configuration needs, and whether it may be absent (a bias, then zeros).
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool optional = false;
};

// The tensors `config`'s layout reads (ReadLayout reads them by index).
std::vector<TensorSpec> LayoutTensors(const CheckpointConfig& config) {
  const HeadConfig& h = config.head_config;
  const int64_t d = h.d_model;
  const int64_t q = h.q_width();
  const int64_t kv = h.kv_width();
  switch (config.layout) {
    case WeightLayout::kTorchMha:
      return {{"in_proj_weight", {3 * d, d}, false},
              {"in_proj_bias", {3 * d}, true},
              {"out_proj.weight", {d, d}, false},
              {"out_proj.bias", {d}, true}};
    case WeightLayout::kBert:
    case WeightLayout::kLlama: {
      const bool bert = config.layout == WeightLayout::kBert;
      const std::string qn = bert ? "self.query." : "q_proj.";
      const std::string kn = bert ? "self.key." : "k_proj.";
      const std::string vn = bert ? "self.value." : "v_proj.";
      const std::string on = bert ? "output.dense." : "o_proj.";
      const bool optional_bias = !bert;
      return {{qn + "weight", {q, d}, false},         {kn + "weight", {kv, d}, false},
              {vn + "weight", {kv, d}, false},        {on + "weight", {d, q}, false},
              {qn + "bias", {q}, optional_bias},      {kn + "bias", {kv}, optional_bias},
              {vn + "bias", {kv}, optional_bias},     {on + "bias", {d}, optional_bias}};
    }
    case WeightLayout::kGpt2:
      return {{"c_attn.weight", {d, 3 * d}, false},
              {"c_attn.bias", {3 * d}, false},
              {"c_proj.weight", {d, d}, false},
              {"c_proj.bias", {d}, false}};
  }
  return {};
}

// Reads `spec` (after `prefix`), which must have exactly its shape and finite
// values; an absent optional tensor reads as zeros.
absl::StatusOr<std::vector<float>> ReadSpec(const SafetensorsFile& file, const std::string& prefix,
                                            const TensorSpec& spec) {
  const std::string full = absl::StrCat(prefix, spec.name);
  if (spec.optional && !file.Find(full).ok()) {
    return std::vector<float>(static_cast<size_t>(*CheckedProduct(spec.shape)), 0.0f);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, file.Find(full));
  if (tensor->shape != spec.shape) return ShapeMismatch(file, full, *tensor, spec.shape);
  ATTNSERVE_ASSIGN_OR_RETURN(std::vector<float> values, file.ReadFloat(full));
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(file.display_name(), ": tensor '", full,
                                                     "' element ", i, " is not finite"));
    }
  }
  return values;
}

// Rows [row_begin, row_begin + rows) of row-major `w` [.., columns],
// transposed to [columns, rows]: a Linear weight [out, in] (or a slice of its
// rows) as the x W convention's [in, out].
std::vector<float> TransposeRows(const std::vector<float>& w, int64_t columns, int64_t row_begin,
                                 int64_t rows) {
  std::vector<float> t(static_cast<size_t>(rows * columns));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < columns; ++c) t[c * rows + r] = w[(row_begin + r) * columns + c];
  }
  return t;
}

// A whole Linear weight [rows, columns] read by `read`, transposed; the
// tensor as read is freed on return.
absl::StatusOr<std::vector<float>> Transposed(absl::StatusOr<std::vector<float>> read,
                                              int64_t rows, int64_t columns) {
  if (!read.ok()) return read.status();
  return TransposeRows(*read, columns, 0, rows);
}

// Columns [begin, begin + width) of row-major `w` [rows, columns].
std::vector<float> Columns(const std::vector<float>& w, int64_t rows, int64_t columns,
                           int64_t begin, int64_t width) {
  std::vector<float> out(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) out[r * width + c] = w[r * columns + begin + c];
  }
  return out;
}

std::vector<float> Slice(const std::vector<float>& v, int64_t begin, int64_t size) {
  return std::vector<float>(v.begin() + begin, v.begin() + begin + size);
}

// The fused layouts (torch_mha, gpt2) have one width for q, k, v and output.
absl::Status NeedSquareHeads(const CheckpointConfig& config, absl::string_view display_name) {
  const HeadConfig& h = config.head_config;
  if (h.q_width() != h.d_model || h.kv_width() != h.d_model) {
    return absl::InvalidArgumentError(absl::StrCat(
        display_name, ": layout ", WeightLayoutName(config.layout),
        " needs num_heads x head_dim = num_kv_heads x head_dim = d_model; got ", h.num_heads,
        " x ", h.head_dim, ", ", h.num_kv_heads, " x ", h.head_dim, ", d_model ", h.d_model));
  }
  return absl::OkStatus();
}

// Reads the layer (its tensors' presence, shapes and dtypes already checked by
// CheckpointWeightBytes). Each tensor is converted as soon as it is read and
// the read copy freed, so at most one tensor exists twice at a time.
absl::StatusOr<AttentionWeights> ReadLayout(const SafetensorsFile& file,
                                            const CheckpointConfig& config) {
  const HeadConfig& h = config.head_config;
  const int64_t d = h.d_model;
  const int64_t q = h.q_width();
  const int64_t kv = h.kv_width();
  const std::vector<TensorSpec> specs = LayoutTensors(config);
  auto read = [&](size_t i) { return ReadSpec(file, config.prefix, specs[i]); };
  AttentionWeights w;
  switch (config.layout) {
    case WeightLayout::kTorchMha: {
      {
        ATTNSERVE_ASSIGN_OR_RETURN(const std::vector<float> in_w, read(0));  // [3E, E]
        w.w_q = TransposeRows(in_w, d, 0, d);
        w.w_k = TransposeRows(in_w, d, d, d);
        w.w_v = TransposeRows(in_w, d, 2 * d, d);
      }
      ATTNSERVE_ASSIGN_OR_RETURN(const std::vector<float> in_b, read(1));
      w.b_q = Slice(in_b, 0, d);
      w.b_k = Slice(in_b, d, d);
      w.b_v = Slice(in_b, 2 * d, d);
      ATTNSERVE_ASSIGN_OR_RETURN(w.w_o, Transposed(read(2), d, d));
      ATTNSERVE_ASSIGN_OR_RETURN(w.b_o, read(3));
      break;
    }
    case WeightLayout::kBert:
    case WeightLayout::kLlama: {
      ATTNSERVE_ASSIGN_OR_RETURN(w.w_q, Transposed(read(0), q, d));
      ATTNSERVE_ASSIGN_OR_RETURN(w.w_k, Transposed(read(1), kv, d));
      ATTNSERVE_ASSIGN_OR_RETURN(w.w_v, Transposed(read(2), kv, d));
      ATTNSERVE_ASSIGN_OR_RETURN(w.w_o, Transposed(read(3), d, q));
      ATTNSERVE_ASSIGN_OR_RETURN(w.b_q, read(4));
      ATTNSERVE_ASSIGN_OR_RETURN(w.b_k, read(5));
      ATTNSERVE_ASSIGN_OR_RETURN(w.b_v, read(6));
      ATTNSERVE_ASSIGN_OR_RETURN(w.b_o, read(7));
      break;
    }
    case WeightLayout::kGpt2: {  // Conv1D stores [in, out]: columns, no transpose
      {
        ATTNSERVE_ASSIGN_OR_RETURN(const std::vector<float> attn_w, read(0));  // [E, 3E]
        w.w_q = Columns(attn_w, d, 3 * d, 0, d);
        w.w_k = Columns(attn_w, d, 3 * d, d, d);
        w.w_v = Columns(attn_w, d, 3 * d, 2 * d, d);
      }
      ATTNSERVE_ASSIGN_OR_RETURN(const std::vector<float> attn_b, read(1));
      w.b_q = Slice(attn_b, 0, d);
      w.b_k = Slice(attn_b, d, d);
      w.b_v = Slice(attn_b, 2 * d, d);
      ATTNSERVE_ASSIGN_OR_RETURN(w.w_o, read(2));
      ATTNSERVE_ASSIGN_OR_RETURN(w.b_o, read(3));
      break;
    }
  }
  return w;
}

// `bytes` in GiB for a message ("208.002 GiB", "0.5 GiB").
std::string GibText(int64_t bytes) {
  return absl::StrCat(absl::SixDigits(static_cast<double>(bytes) / (int64_t{1} << 30)), " GiB");
}

}  // namespace

absl::string_view WeightLayoutName(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kTorchMha:
      return "torch_mha";
    case WeightLayout::kBert:
      return "bert";
    case WeightLayout::kGpt2:
      return "gpt2";
    case WeightLayout::kLlama:
      return "llama";
  }
  return "?";
}

absl::StatusOr<CheckpointConfig> ParseCheckpointConfig(absl::string_view json,
                                                       absl::string_view display_name) {
  if (static_cast<int64_t>(json.size()) > kMaxCheckpointConfigBytes) {
    return absl::InvalidArgumentError(absl::StrCat(display_name, ": larger than ",
                                                   kMaxCheckpointConfigBytes, " bytes"));
  }
  const Json root = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(display_name, ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(display_name, ": not a JSON object"));
  }
  static const char* const kFields[] = {"layout",  "weights",      "prefix",   "layers",
                                        "d_model", "num_heads",    "num_kv_heads", "head_dim",
                                        "scale",   "rotary",       "causal",   "description"};
  for (const auto& [key, unused] : root.items()) {
    bool known = false;
    for (const char* field : kFields) known = known || key == field;
    if (!known) {
      return ConfigError(display_name, key.substr(0, 64),
                         absl::StrCat("unknown field (known: ", absl::StrJoin(kFields, ", "), ")"));
    }
  }
  CheckpointConfig config;
  const auto layout = root.find("layout");
  if (layout == root.end() || !layout->is_string()) {
    return ConfigError(display_name, "layout", "required: torch_mha, bert, gpt2 or llama");
  }
  const std::string& layout_name = layout->get_ref<const std::string&>();
  bool layout_known = false;
  for (WeightLayout l : {WeightLayout::kTorchMha, WeightLayout::kBert, WeightLayout::kGpt2,
                         WeightLayout::kLlama}) {
    if (layout_name == WeightLayoutName(l)) {
      config.layout = l;
      layout_known = true;
    }
  }
  if (!layout_known) {
    return ConfigError(display_name, "layout",
                       absl::StrCat("'", layout_name.substr(0, 64),
                                    "' is not one of torch_mha, bert, gpt2, llama"));
  }
  auto string_field = [&](const char* field, std::string* out) -> absl::Status {
    const auto it = root.find(field);
    if (it == root.end()) return absl::OkStatus();
    if (!it->is_string()) return ConfigError(display_name, field, "must be a string");
    *out = it->get<std::string>();
    if (out->size() > kMaxTensorPrefixBytes) {
      return ConfigError(display_name, field,
                         absl::StrCat("longer than ", kMaxTensorPrefixBytes, " bytes"));
    }
    return absl::OkStatus();
  };
  ATTNSERVE_RETURN_IF_ERROR(string_field("weights", &config.weights));
  ATTNSERVE_RETURN_IF_ERROR(string_field("prefix", &config.prefix));
  ATTNSERVE_RETURN_IF_ERROR(string_field("description", &config.description));
  if (const auto it = root.find("layers"); it != root.end()) {
    if (root.contains("prefix")) {
      return ConfigError(display_name, "prefix",
                         "not with layers: each layer's prefix comes from layers.prefix (or "
                         "layers.prefixes)");
    }
    ATTNSERVE_RETURN_IF_ERROR(ParseLayers(*it, display_name, &config.layer_prefixes));
  }
  if (!IsPlainFileName(config.weights)) {
    return ConfigError(display_name, "weights",
                       "must be a plain file name in the model's folder ([A-Za-z0-9._-], not "
                       "starting with '.')");
  }

  HeadConfig& head = config.head_config;
  ATTNSERVE_ASSIGN_OR_RETURN(head.d_model, IntField(root, "d_model", display_name, 0, true));
  ATTNSERVE_ASSIGN_OR_RETURN(head.num_heads, IntField(root, "num_heads", display_name, 0, true));
  ATTNSERVE_ASSIGN_OR_RETURN(head.num_kv_heads,
                             IntField(root, "num_kv_heads", display_name, 0, false));
  ATTNSERVE_ASSIGN_OR_RETURN(head.head_dim, IntField(root, "head_dim", display_name, 0, false));
  if (const auto it = root.find("scale"); it != root.end()) {
    if (!it->is_number()) return ConfigError(display_name, "scale", "must be a number");
    head.scale = it->get<float>();
  }
  if (const auto it = root.find("rotary"); it != root.end()) {
    if (!it->is_object()) return ConfigError(display_name, "rotary", "must be {dim, theta}");
    for (const auto& [key, unused] : it->items()) {
      if (key != "dim" && key != "theta") {
        return ConfigError(display_name, "rotary", "unknown field (known: dim, theta)");
      }
    }
    ATTNSERVE_ASSIGN_OR_RETURN(head.rotary.rotary_dim,
                               IntField(*it, "dim", display_name, 0, true));
    if (const auto theta = it->find("theta"); theta != it->end()) {
      if (!theta->is_number()) return ConfigError(display_name, "rotary.theta", "must be a number");
      head.rotary.theta = theta->get<float>();
    }
  }
  config.causal = config.layout == WeightLayout::kGpt2 || config.layout == WeightLayout::kLlama;
  if (const auto it = root.find("causal"); it != root.end()) {
    if (!it->is_boolean()) return ConfigError(display_name, "causal", "must be true or false");
    config.causal = it->get<bool>();
  }
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(head);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(display_name, ": ", resolved.status().message()));
  }
  head = *resolved;
  if (config.layout == WeightLayout::kTorchMha || config.layout == WeightLayout::kGpt2) {
    ATTNSERVE_RETURN_IF_ERROR(NeedSquareHeads(config, display_name));
  }
  return config;
}

absl::StatusOr<CheckpointConfig> LayerOfCheckpoint(const CheckpointConfig& config,
                                                   size_t layer) {
  if (layer >= config.layer_prefixes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": the config describes ",
                                                   config.layer_prefixes.size(),
                                                   " layers (layers)"));
  }
  CheckpointConfig one = config;
  one.layer_prefixes.clear();
  one.prefix = config.layer_prefixes[layer];
  return one;
}

absl::StatusOr<int64_t> CheckpointWeightBytes(const SafetensorsFile& file,
                                              const CheckpointConfig& config) {
  if (!config.layer_prefixes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.display_name(), ": the config describes ", config.layer_prefixes.size(),
        " layers; each is read on its own (LayerOfCheckpoint)"));
  }
  if (config.layout == WeightLayout::kTorchMha || config.layout == WeightLayout::kGpt2) {
    ATTNSERVE_RETURN_IF_ERROR(NeedSquareHeads(config, file.display_name()));
  }
  int64_t total = 0;
  for (const TensorSpec& spec : LayoutTensors(config)) {
    const std::string full = absl::StrCat(config.prefix, spec.name);
    const auto it = file.tensors().find(full);
    if (it == file.tensors().end()) {
      if (!spec.optional) return file.Find(full).status();
    } else if (it->second.shape != spec.shape) {
      return ShapeMismatch(file, full, it->second, spec.shape);
    } else {
      ATTNSERVE_RETURN_IF_ERROR(file.CheckFloat(full));
    }
    // The shapes come from a resolved head configuration, whose bounds keep
    // these far from overflowing; checked all the same.
    const std::optional<int64_t> elements = CheckedProduct(spec.shape);
    const std::optional<int64_t> bytes =
        elements ? CheckedMul(*elements, int64_t{sizeof(float)}) : std::nullopt;
    const std::optional<int64_t> sum = bytes ? CheckedAdd(total, *bytes) : std::nullopt;
    if (!sum) {
      return absl::InvalidArgumentError(
          absl::StrCat(file.display_name(), ": the layer's weights overflow a 64-bit size"));
    }
    total = *sum;
  }
  return total;
}

absl::StatusOr<int64_t> CheckCheckpointBudget(const SafetensorsFile& file,
                                              const CheckpointConfig& config,
                                              const CheckpointLoadOptions& options) {
  ATTNSERVE_ASSIGN_OR_RETURN(const int64_t bytes, CheckpointWeightBytes(file, config));
  if (bytes > options.max_weight_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.display_name(), ": the layer's weights take ", bytes, " bytes as FP32 (",
        GibText(bytes), ", as the header declares them), over ", options.budget_name, " (",
        options.max_weight_bytes, " bytes, ", GibText(options.max_weight_bytes),
        "); no tensor was read"));
  }
  return bytes;
}

absl::StatusOr<AttentionWeights> LoadCheckpointWeights(const SafetensorsFile& file,
                                                       const CheckpointConfig& config,
                                                       const CheckpointLoadOptions& options) {
  ATTNSERVE_ASSIGN_OR_RETURN(const int64_t bytes, CheckCheckpointBudget(file, config, options));
  // The sizes are checked; what is left is the machine's memory. No
  // exception leaves core: running out fails this load alone.
  auto out_of_memory = [&] {
    return absl::ResourceExhaustedError(
        absl::StrCat(file.display_name(), ": out of memory reading the layer's weights (", bytes,
                     " bytes as FP32, ", GibText(bytes), ")"));
  };
  try {
    return ReadLayout(file, config);
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  } catch (const std::length_error&) {
    return out_of_memory();
  }
}

}  // namespace attnserve::core
