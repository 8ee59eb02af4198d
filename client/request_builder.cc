#include "client/request_builder.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/npy.h"

namespace attnserve::client {

using ::attnserve::cli::NpyArray;
using ::attnserve::cli::NpyDtype;
using ::attnserve::cli::NpyDtypeName;
using ::attnserve::cli::ReadNpyFile;

namespace {

constexpr int64_t kDefaultSeq = 16;
// attnctl makes up no dimension larger than this, and no tensor of more
// elements than kMaxElements (its bytes must fit one protobuf bytes field).
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxElements = int64_t{1} << 28;

absl::Status Invalid(absl::string_view flag, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", what));
}

template <typename T, typename Parse>
bool ParseList(absl::string_view text, std::vector<T>* values, std::string* error, Parse parse) {
  values->clear();
  if (absl::StripAsciiWhitespace(text).empty()) return true;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    T value;
    if (!parse(item, &value)) {
      *error = absl::StrCat("'", item, "' is not a number (expected a comma-separated list)");
      return false;
    }
    values->push_back(value);
  }
  return true;
}

int64_t Max(const std::vector<int64_t>& values) {
  return values.empty() ? 0 : *std::max_element(values.begin(), values.end());
}

int64_t Sum(const std::vector<int64_t>& values) {
  return std::accumulate(values.begin(), values.end(), int64_t{0});
}

// Lengths checked against their batch and (padded) the padded length `seq`.
absl::Status CheckLengths(absl::string_view flag, const std::vector<int64_t>& lengths,
                          int64_t batch, absl::string_view batch_source, int64_t seq,
                          absl::string_view seq_source) {
  if (static_cast<int64_t>(lengths.size()) != batch) {
    return Invalid(flag, absl::StrCat(lengths.size(), " lengths for a batch of ", batch, " (",
                                      batch_source, ")"));
  }
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1) {
      return Invalid(flag, absl::StrCat("[", b, "] is ", lengths[b], "; lengths are >= 1"));
    }
    if (lengths[b] > kMaxDim) {
      return Invalid(flag, absl::StrCat("[", b, "] is ", lengths[b], ", more than ", kMaxDim));
    }
    if (seq > 0 && lengths[b] > seq) {
      return Invalid(flag, absl::StrCat("[", b, "] is ", lengths[b], ", more than ", seq, " (",
                                        seq_source, ")"));
    }
  }
  return absl::OkStatus();
}

// Random states, normal with std 1, token by token: sequence b's token i gets
// the next d values of `rng`, whether it is sent padded or packed, so the same
// seed and lengths give the same tokens either way. Padding is 0.
// Returns [batch, seq, d] (padded, seq > 0) or [sum(lengths), d] (seq == 0).
std::vector<float> RandomStates(std::mt19937_64& rng, const std::vector<int64_t>& lengths,
                                int64_t seq, int64_t d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = seq > 0 ? static_cast<int64_t>(lengths.size()) * seq : Sum(lengths);
  std::vector<float> values(rows * d, 0.0f);
  int64_t row = 0;
  for (int64_t length : lengths) {
    for (int64_t i = 0; i < length; ++i) {
      for (int64_t j = 0; j < d; ++j) values[(row + i) * d + j] = normal(rng);
    }
    row += seq > 0 ? seq : length;
  }
  return values;
}

// Random projected heads [batch, heads, seq, head_dim]; rows past a
// sequence's length are 0.
std::vector<float> RandomHeads(std::mt19937_64& rng, const std::vector<int64_t>& lengths,
                               int64_t heads, int64_t seq, int64_t head_dim) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  std::vector<float> values(batch * heads * seq * head_dim, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      float* block = values.data() + (b * heads + h) * seq * head_dim;
      for (int64_t i = 0; i < lengths[b] * head_dim; ++i) block[i] = normal(rng);
    }
  }
  return values;
}

void SetFloatTensor(v1::Tensor* tensor, std::vector<int64_t> shape,
                    const std::vector<float>& values) {
  tensor->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : shape) tensor->add_shape(d);
  tensor->set_raw_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

// The BF16 word nearest to `value` (ties to even); NaN stays a quiet NaN.
// core::FloatToBf16's rounding again: client/ may not include core/ (the
// layering test), and request_builder_test holds this one to an independent
// rounding.
uint16_t Bf16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Rewrites an FP32 raw tensor as BF16 (same shape, half the bytes).
void ConvertToBf16(v1::Tensor* tensor) {
  const std::string& raw = tensor->raw_data();
  const size_t count = raw.size() / sizeof(float);
  std::string words(count * sizeof(uint16_t), '\0');
  for (size_t i = 0; i < count; ++i) {
    float value;
    std::memcpy(&value, raw.data() + i * sizeof(float), sizeof(float));
    const uint16_t word = Bf16Bits(value);
    std::memcpy(words.data() + i * sizeof(uint16_t), &word, sizeof(word));
  }
  tensor->set_dtype(v1::DATA_TYPE_BF16);
  tensor->set_raw_data(std::move(words));
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The head configuration that runs, defaults resolved.
absl::StatusOr<v1::HeadConfig> ResolveConfig(const AttendOptions& o,
                                             const v1::HeadConfig* model_config) {
  if (!o.layer_seed.has_value()) {
    if (model_config == nullptr) return Invalid("model", "no head configuration for the model");
    v1::HeadConfig config = *model_config;
    if (config.d_model() < 1 || config.num_heads() < 1) {
      return Invalid("model", absl::StrCat("'", o.model, "' reports d_model ", config.d_model(),
                                           " and num_heads ", config.num_heads()));
    }
    if (config.num_kv_heads() == 0) config.set_num_kv_heads(config.num_heads());
    if (config.head_dim() == 0) config.set_head_dim(config.d_model() / config.num_heads());
    return config;
  }
  if (o.d_model < 1) return Invalid("d_model", "required (>= 1) with --layer_seed");
  if (o.num_heads < 1) return Invalid("num_heads", "required (>= 1) with --layer_seed");
  if (o.num_kv_heads < 0 || (o.num_kv_heads > 0 && o.num_heads % o.num_kv_heads != 0)) {
    return Invalid("num_kv_heads",
                   absl::StrCat(o.num_kv_heads, " does not divide --num_heads=", o.num_heads));
  }
  if (o.head_dim < 0) return Invalid("head_dim", "must be >= 0 (0: d_model / num_heads)");
  if (o.head_dim == 0 && o.d_model % o.num_heads != 0) {
    return Invalid("head_dim", absl::StrCat("required: --num_heads=", o.num_heads,
                                            " does not divide --d_model=", o.d_model));
  }
  v1::HeadConfig config;
  config.set_d_model(o.d_model);
  config.set_num_heads(o.num_heads);
  config.set_num_kv_heads(o.num_kv_heads > 0 ? o.num_kv_heads : o.num_heads);
  config.set_head_dim(o.head_dim > 0 ? o.head_dim : o.d_model / o.num_heads);
  config.set_scale(static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.head_dim()))));
  if (o.rotary_dim < 0 || o.rotary_dim % 2 != 0 || o.rotary_dim > config.head_dim()) {
    return Invalid("rotary_dim",
                   absl::StrCat(o.rotary_dim,
                                " is not an even number in [0, head_dim=", config.head_dim(), "]"));
  }
  if (o.rope_theta != 0 && !(std::isfinite(o.rope_theta) && o.rope_theta > 1)) {
    return Invalid("rope_theta", absl::StrCat(o.rope_theta, " is not a finite number > 1"));
  }
  if (o.rope_theta != 0 && o.rotary_dim == 0) {
    return Invalid("rope_theta", "needs --rotary_dim (the layer has no RoPE otherwise)");
  }
  config.mutable_rotary()->set_rotary_dim(o.rotary_dim);
  config.mutable_rotary()->set_theta(o.rope_theta != 0 ? o.rope_theta : 10000.0f);
  return config;
}

// Query positions or head numbers as the proto's int32. Their ranges are the
// server's to check; a value int32 cannot hold would arrive as another one.
absl::Status AddIndices(absl::string_view flag, const std::vector<int64_t>& values,
                        google::protobuf::RepeatedField<int32_t>* out) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] < std::numeric_limits<int32_t>::min() ||
        values[i] > std::numeric_limits<int32_t>::max()) {
      return Invalid(flag, absl::StrCat("[", i, "] is ", values[i], ", outside the request's int32"));
    }
    out->Add(static_cast<int32_t>(values[i]));
  }
  return absl::OkStatus();
}

}  // namespace

bool AbslParseFlag(absl::string_view text, Int64List* list, std::string* error) {
  return ParseList(text, &list->values, error,
                   [](absl::string_view s, int64_t* v) { return absl::SimpleAtoi(s, v); });
}

std::string AbslUnparseFlag(const Int64List& list) { return absl::StrJoin(list.values, ","); }

bool AbslParseFlag(absl::string_view text, FloatList* list, std::string* error) {
  return ParseList(text, &list->values, error,
                   [](absl::string_view s, float* v) { return absl::SimpleAtof(s, v); });
}

std::string AbslUnparseFlag(const FloatList& list) { return absl::StrJoin(list.values, ","); }

std::string PrecisionText(v1::Precision precision) {
  switch (precision) {
    case v1::PRECISION_FP32:
      return "fp32";
    case v1::PRECISION_BF16:
      return "bf16";
    default:
      return "unspecified";
  }
}

v1::Tensor RandomStateRows(int64_t n, int64_t d_model, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(n * d_model));
  for (float& v : values) v = normal(rng);
  v1::Tensor tensor;
  SetFloatTensor(&tensor, {n, d_model}, values);
  return tensor;
}

absl::Status ValidateAttendOptions(const AttendOptions& o) {
  if (o.maps != "none" && o.maps != "per-head" && o.maps != "mean") {
    return Invalid("maps", absl::StrCat("'", o.maps, "' is not one of none, per-head, mean"));
  }
  if (o.precision != "fp32" && o.precision != "bf16") {
    return Invalid("precision", absl::StrCat("'", o.precision, "' is not one of fp32, bf16"));
  }
  if (o.output_dtype != "fp32" && o.output_dtype != "bf16") {
    return Invalid("output_dtype", absl::StrCat("'", o.output_dtype, "' is not one of fp32, bf16"));
  }
  if (o.input_dtype != "fp32" && o.input_dtype != "bf16") {
    return Invalid("input_dtype", absl::StrCat("'", o.input_dtype, "' is not one of fp32, bf16"));
  }
  if (o.input_dtype == "bf16" && o.projected) {
    return Invalid("input_dtype", "bf16 applies to hidden and context states, not --projected");
  }
  if (!o.mask_kind.empty() && o.mask_kind != "allowed" && o.mask_kind != "additive") {
    return Invalid("mask_kind",
                   absl::StrCat("'", o.mask_kind, "' is not one of allowed, additive"));
  }
  if (!o.mask_kind.empty() && o.mask.empty()) return Invalid("mask_kind", "given without --mask");
  if (!o.layer_seed.has_value()) {
    const std::pair<absl::string_view, bool> adhoc_flags[] = {
        {"d_model", o.d_model != 0},           {"num_heads", o.num_heads != 0},
        {"num_kv_heads", o.num_kv_heads != 0}, {"head_dim", o.head_dim != 0},
        {"rotary_dim", o.rotary_dim != 0},     {"rope_theta", o.rope_theta != 0},
    };
    for (const auto& [flag, given] : adhoc_flags) {
      if (given) return Invalid(flag, "describes an ad-hoc layer: only with --layer_seed");
    }
    if (o.model.empty()) return Invalid("model", "required (or --layer_seed for an ad-hoc layer)");
  }
  if (o.batch < 0 || o.batch > kMaxDim) {
    return Invalid("batch",
                   absl::StrCat("must be in [1, ", kMaxDim, "] (0: from --input or --lengths)"));
  }
  if (o.seq < 0 || o.seq > kMaxDim) {
    return Invalid("seq",
                   absl::StrCat("must be in [1, ", kMaxDim, "] (0: from --input or --lengths)"));
  }
  if (o.context_seq < 0 || o.context_seq > kMaxDim) {
    return Invalid("context_seq", absl::StrCat("must be in [1, ", kMaxDim, "]"));
  }
  if (o.packed && o.lengths.empty() && o.input.empty()) {
    return Invalid("packed", "needs --lengths (the sequences' lengths in the packed tokens)");
  }
  if (o.packed && o.seq > 0) {
    return Invalid("seq", "not used with --packed (--lengths give the sequences' sizes)");
  }
  if (o.packed && (o.context_seq > 0 || !o.context_lengths.empty()) && o.context_lengths.empty()) {
    return Invalid("context_lengths", "required for cross-attention with --packed");
  }
  if (o.projected) {
    if (!o.input.empty()) return Invalid("input", "not used with --projected (q, k, v are random)");
    if (o.packed) {
      return Invalid("packed", "projected heads are padded [batch, heads, seq, head_dim]");
    }
    if (!o.position_offsets.empty()) {
      return Invalid("position_offsets", "not used with --projected (no RoPE is applied)");
    }
  }
  if (!o.heads.empty() && o.maps != "per-head") {
    return Invalid("heads", absl::StrCat("only with --maps=per-head (not --maps=", o.maps, ")"));
  }
  if (!o.rows.empty() && o.maps == "none") {
    return Invalid("rows", "needs --maps=per-head or --maps=mean");
  }
  if (!o.save_maps.empty() && o.maps == "none") {
    return Invalid("save_maps", "needs --maps=per-head or --maps=mean");
  }
  if (!o.maps_png.empty() && o.maps == "none") {
    return Invalid("maps_png", "needs --maps=per-head or --maps=mean");
  }
  if (o.png_sequence != 0 && o.maps_png.empty()) {
    return Invalid("png_sequence", "only with --maps_png");
  }
  if (o.png_sequence < 0) return Invalid("png_sequence", "must be >= 0");
  // The values of --head_mask, --position_offsets, --heads and --rows (their
  // counts and ranges) are the server's to check: it names the request field
  // each flag fills, by the rules the attention itself applies.
  return absl::OkStatus();
}

absl::StatusOr<AttendCall> BuildAttendRequest(const AttendOptions& o,
                                              const v1::HeadConfig* model_config) {
  if (absl::Status status = ValidateAttendOptions(o); !status.ok()) return status;
  AttendCall call;
  absl::StatusOr<v1::HeadConfig> config = ResolveConfig(o, model_config);
  if (!config.ok()) return config.status();
  call.config = *config;
  v1::AttendRequest& request = call.request;
  if (o.layer_seed.has_value()) {
    v1::LayerSpec* layer = request.mutable_layer();
    v1::HeadConfig* head_config = layer->mutable_head_config();
    // As given: the server resolves the zeros to its defaults.
    head_config->set_d_model(o.d_model);
    head_config->set_num_heads(o.num_heads);
    head_config->set_num_kv_heads(o.num_kv_heads);
    head_config->set_head_dim(o.head_dim);
    if (o.rotary_dim != 0 || o.rope_theta != 0) {
      head_config->mutable_rotary()->set_rotary_dim(o.rotary_dim);
      head_config->mutable_rotary()->set_theta(o.rope_theta);
    }
    layer->set_seed(*o.layer_seed);
  } else {
    request.set_model(o.model);
  }
  const int64_t d_model = call.config.d_model();
  std::mt19937_64 rng(o.seed);

  // The queries: batch, padded length (0 when packed) and lengths.
  std::optional<NpyArray> input;
  call.packed = o.packed;
  int64_t batch = o.batch, seq = o.seq;
  if (!o.input.empty()) {
    absl::StatusOr<NpyArray> array = ReadNpyFile(o.input);
    if (!array.ok()) return array.status();
    if (array->dtype != NpyDtype::kFloat32) {
      return Invalid("input", absl::StrCat(o.input, ": dtype ", NpyDtypeName(array->dtype),
                                           "; hidden states are '<f4'"));
    }
    const std::vector<int64_t>& shape = array->shape;
    if (shape.size() != 2 && shape.size() != 3) {
      return Invalid("input", absl::StrCat(o.input, ": shape ", ShapeText(shape),
                                           "; expected [batch, seq, d_model] or packed "
                                           "[tokens, d_model]"));
    }
    if (shape.back() != d_model) {
      return Invalid("input", absl::StrCat(o.input, ": shape ", ShapeText(shape), " has d_model ",
                                           shape.back(), "; the layer's is ", d_model));
    }
    if (shape.size() == 3) {
      if (o.packed) {
        return Invalid("packed", absl::StrCat(o.input, " is padded ", ShapeText(shape),
                                              "; packed input is [tokens, d_model]"));
      }
      if (o.batch > 0 && o.batch != shape[0]) {
        return Invalid("batch",
                       absl::StrCat(o.batch, ", but ", o.input, " has ", shape[0], " sequences"));
      }
      if (o.seq > 0 && o.seq != shape[1]) {
        return Invalid("seq", absl::StrCat(o.seq, ", but ", o.input, " has ", shape[1],
                                           " tokens per sequence"));
      }
      batch = shape[0];
      seq = shape[1];
    } else {
      call.packed = true;
      if (o.lengths.empty()) {
        return Invalid("lengths",
                       absl::StrCat("required: ", o.input, " is packed ", ShapeText(shape)));
      }
      if (Sum(o.lengths) != shape[0]) {
        return Invalid("lengths", absl::StrCat("sum to ", Sum(o.lengths), ", but ", o.input,
                                               " has ", shape[0], " tokens"));
      }
    }
    call.input_source = o.input;
    input = *std::move(array);
  } else {
    call.input_source = absl::StrCat("random (seed ", o.seed, ")");
  }
  if (call.packed) {
    if (o.batch > 0 && o.batch != static_cast<int64_t>(o.lengths.size())) {
      return Invalid("batch",
                     absl::StrCat(o.batch, ", but --lengths has ", o.lengths.size(), " sequences"));
    }
    batch = static_cast<int64_t>(o.lengths.size());
    seq = 0;
  } else {
    if (batch == 0) batch = o.lengths.empty() ? 1 : static_cast<int64_t>(o.lengths.size());
    if (seq == 0) seq = o.lengths.empty() ? kDefaultSeq : Max(o.lengths);
  }
  const std::string batch_source = o.batch > 0        ? "--batch"
                                   : !o.input.empty() ? absl::StrCat("--input ", o.input)
                                                      : "the default batch";
  const std::string seq_source = !o.input.empty() ? absl::StrCat("the seq of ", o.input) : "--seq";
  if (!o.lengths.empty()) {
    if (absl::Status s = CheckLengths("lengths", o.lengths, batch, batch_source, seq, seq_source);
        !s.ok()) {
      return s;
    }
  }
  call.batch = batch;
  call.query_lengths = o.lengths.empty() ? std::vector<int64_t>(batch, seq) : o.lengths;
  const int64_t query_max = seq > 0 ? seq : Max(call.query_lengths);
  for (int64_t length : o.lengths) request.add_sequence_lengths(length);

  // The keys: the context's (cross-attention), or the queries'.
  call.cross_attention = o.context_seq > 0 || !o.context_lengths.empty();
  int64_t context_seq = 0;  // padded length; 0 when packed
  if (call.cross_attention) {
    if (!call.packed) {
      context_seq = o.context_seq > 0 ? o.context_seq : Max(o.context_lengths);
    }
    if (!o.context_lengths.empty()) {
      if (absl::Status s = CheckLengths("context_lengths", o.context_lengths, batch,
                                        "the queries' batch", o.context_seq, "--context_seq");
          !s.ok()) {
        return s;
      }
    }
    call.key_lengths =
        o.context_lengths.empty() ? std::vector<int64_t>(batch, context_seq) : o.context_lengths;
    for (int64_t length : o.context_lengths) request.add_context_lengths(length);
  } else {
    call.key_lengths = call.query_lengths;
  }
  const int64_t key_max = call.cross_attention ? Max(call.key_lengths) : query_max;
  const int64_t key_padded =
      call.cross_attention ? (context_seq > 0 ? context_seq : key_max) : query_max;

  // The sizes of the tensors about to be made up, before any is allocated.
  auto check_size = [](absl::string_view flag, const std::vector<int64_t>& shape) {
    int64_t elements = 1;
    for (int64_t d : shape) {
      // Each d <= kMaxDim (2^24), so the product only overflows after passing kMaxElements.
      elements *= d;
      if (elements > kMaxElements) {
        return Invalid(
            flag, absl::StrCat("a tensor of shape ", ShapeText(shape),
                               " is more than attnctl makes up (", kMaxElements, " elements)"));
      }
    }
    return absl::OkStatus();
  };
  const int64_t heads = call.config.num_heads(), kv_heads = call.config.num_kv_heads();
  const int64_t head_dim = call.config.head_dim();
  std::vector<std::pair<absl::string_view, std::vector<int64_t>>> planned;
  if (o.projected) {
    planned.push_back({"seq", {batch, heads, seq, head_dim}});
    planned.push_back({"context_seq", {batch, kv_heads, key_padded, head_dim}});
  } else {
    if (!input.has_value()) {
      planned.push_back({call.packed ? "lengths" : "seq",
                         call.packed ? std::vector<int64_t>{Sum(call.query_lengths), d_model}
                                     : std::vector<int64_t>{batch, seq, d_model}});
    }
    if (call.cross_attention) {
      planned.push_back({call.packed ? "context_lengths" : "context_seq",
                         call.packed ? std::vector<int64_t>{Sum(call.key_lengths), d_model}
                                     : std::vector<int64_t>{batch, context_seq, d_model}});
    }
  }
  for (const auto& [flag, shape] : planned) {
    if (absl::Status s = check_size(flag, shape); !s.ok()) return s;
  }

  if (o.projected) {
    // q [batch, num_heads, seq_q, head_dim], k/v [batch, num_kv_heads, seq_kv, head_dim].
    v1::ProjectedHeads* projected = request.mutable_projected();
    SetFloatTensor(projected->mutable_q(), {batch, heads, seq, head_dim},
                   RandomHeads(rng, call.query_lengths, heads, seq, head_dim));
    SetFloatTensor(projected->mutable_k(), {batch, kv_heads, key_padded, head_dim},
                   RandomHeads(rng, call.key_lengths, kv_heads, key_padded, head_dim));
    SetFloatTensor(projected->mutable_v(), {batch, kv_heads, key_padded, head_dim},
                   RandomHeads(rng, call.key_lengths, kv_heads, key_padded, head_dim));
  } else {
    v1::Tensor* hidden = request.mutable_hidden_states();
    if (input.has_value()) {
      hidden->set_dtype(v1::DATA_TYPE_FP32);
      for (int64_t d : input->shape) hidden->add_shape(d);
      hidden->set_raw_data(std::move(input->data));
    } else if (call.packed) {
      SetFloatTensor(hidden, {Sum(call.query_lengths), d_model},
                     RandomStates(rng, call.query_lengths, 0, d_model));
    } else {
      SetFloatTensor(hidden, {batch, seq, d_model},
                     RandomStates(rng, call.query_lengths, seq, d_model));
    }
    if (call.cross_attention) {
      v1::Tensor* context = request.mutable_context();
      if (call.packed) {
        SetFloatTensor(context, {Sum(call.key_lengths), d_model},
                       RandomStates(rng, call.key_lengths, 0, d_model));
      } else {
        SetFloatTensor(context, {batch, context_seq, d_model},
                       RandomStates(rng, call.key_lengths, context_seq, d_model));
      }
    }
  }

  if (o.input_dtype == "bf16") {
    ConvertToBf16(request.mutable_hidden_states());
    if (request.has_context()) ConvertToBf16(request.mutable_context());
  }

  request.set_causal(o.causal);

  if (!o.mask.empty()) {
    absl::StatusOr<NpyArray> mask = ReadNpyFile(o.mask);
    if (!mask.ok()) return mask.status();
    const bool additive = o.mask_kind == "additive";
    if (additive && mask->dtype != NpyDtype::kFloat32) {
      return Invalid("mask_kind", absl::StrCat("additive needs '<f4' values (0 or -inf); ", o.mask,
                                               " holds '", NpyDtypeName(mask->dtype), "'"));
    }
    const std::vector<int64_t>& shape = mask->shape;
    if (shape.size() != 3) {
      return Invalid("mask", absl::StrCat(o.mask, ": shape ", ShapeText(shape),
                                          "; expected [batch or 1, seq_q or 1, seq_kv or 1]"));
    }
    const std::pair<int64_t, absl::string_view> dims[] = {
        {batch, "batch"}, {query_max, "seq_q"}, {key_max, "seq_kv"}};
    for (int d = 0; d < 3; ++d) {
      if (shape[d] != 1 && shape[d] != dims[d].first) {
        return Invalid(
            "mask", absl::StrCat(o.mask, ": shape ", ShapeText(shape), " dimension ", d, " is ",
                                 shape[d], "; expected 1 or ", dims[d].second, "=", dims[d].first));
      }
    }
    v1::AttentionMask* m = request.mutable_mask();
    m->set_kind(additive ? v1::AttentionMask::KIND_ADDITIVE : v1::AttentionMask::KIND_ALLOWED);
    v1::Tensor* values = m->mutable_values();
    values->set_dtype(mask->dtype == NpyDtype::kFloat32 ? v1::DATA_TYPE_FP32 : v1::DATA_TYPE_BOOL);
    for (int64_t d : shape) values->add_shape(d);
    values->set_raw_data(std::move(mask->data));
  }

  for (float gate : o.head_mask) request.add_head_mask(gate);

  if (!o.position_offsets.empty()) {
    if (o.layer_seed.has_value() && o.rotary_dim == 0) {
      return Invalid("position_offsets", "needs --rotary_dim (the layer has no RoPE)");
    }
    for (int64_t offset : o.position_offsets) request.add_position_offsets(offset);
  }

  request.set_precision(o.precision == "bf16" ? v1::PRECISION_BF16 : v1::PRECISION_FP32);
  request.set_output_dtype(o.output_dtype == "bf16" ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_FP32);

  const v1::AttentionMapMode mode = o.maps == "per-head" ? v1::ATTENTION_MAP_MODE_PER_HEAD
                                    : o.maps == "mean"   ? v1::ATTENTION_MAP_MODE_MEAN
                                                         : v1::ATTENTION_MAP_MODE_NONE;
  if (mode != v1::ATTENTION_MAP_MODE_NONE || o.stats) {
    v1::AttentionMapRequest* maps = request.mutable_attention_maps();
    maps->set_mode(mode);
    if (absl::Status s = AddIndices("heads", o.heads, maps->mutable_heads()); !s.ok()) return s;
    if (absl::Status s = AddIndices("rows", o.rows, maps->mutable_query_rows()); !s.ok()) return s;
    maps->set_head_statistics(o.stats);
  }
  if (o.png_sequence >= batch) {
    return Invalid("png_sequence",
                   absl::StrCat(o.png_sequence, " is outside [0, ", batch, ") (the batch)"));
  }
  return call;
}

}  // namespace attnserve::client
