#include "server/api/attend_plan.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/attention_layer.h"
#include "core/checked_math.h"
#include "core/route.h"
#include "core/status_macros.h"
#include "core/validation.h"
#include "server/api/attend_runner.h"

namespace attnserve::server {
namespace {

using core::ExplicitMask;
using core::InvalidField;

constexpr absl::string_view kPaddedDims[] = {"batch", "seq", "d_model"};
constexpr absl::string_view kPackedDims[] = {"tokens", "d_model"};
constexpr absl::string_view kProjectedQDims[] = {"batch", "num_heads", "seq_q", "head_dim"};
constexpr absl::string_view kProjectedKvDims[] = {"batch", "num_kv_heads", "seq_kv", "head_dim"};
constexpr absl::string_view kMaskDims[] = {"batch", "seq_q", "seq_kv"};

// Room for everything in an AttendResponse besides the tensors' values.
constexpr int64_t kResponseFramingBytes = 4096;

// A fixed limit of this server: a request over it can never succeed here,
// however idle the server is, so it is the request's fault (INVALID_ARGUMENT),
// not load (RESOURCE_EXHAUSTED, which says "retry later"). `instead` says what
// to send instead.
absl::Status OverLimit(absl::string_view what, int64_t value, int64_t limit,
                       absl::string_view flag, absl::string_view instead) {
  if (value <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", value,
                                                 " is over this server's limit of ", limit, " (--",
                                                 flag, "); ", instead));
}

constexpr absl::string_view kFewerSequences =
    "send at most that many sequences per request (split the batch)";
constexpr absl::string_view kShorterSequences =
    "send sequences of at most that many tokens (split or truncate them)";

absl::StatusOr<core::AttentionMapMode> ToCoreMapMode(v1::AttentionMapMode mode) {
  switch (mode) {
    case v1::ATTENTION_MAP_MODE_NONE:
      return core::AttentionMapMode::kNone;
    case v1::ATTENTION_MAP_MODE_PER_HEAD:
      return core::AttentionMapMode::kPerHead;
    case v1::ATTENTION_MAP_MODE_MEAN:
      return core::AttentionMapMode::kMeanOverHeads;
    default:
      return InvalidField("attention_maps.mode", absl::StrCat("unknown value ", static_cast<int>(mode)));
  }
}

absl::StatusOr<core::HeadConfig> ToCoreHeadConfig(const v1::HeadConfig& wire) {
  core::HeadConfig config;
  config.d_model = wire.d_model();
  config.num_heads = wire.num_heads();
  config.num_kv_heads = wire.num_kv_heads();
  config.head_dim = wire.head_dim();
  config.scale = wire.scale();
  config.rotary.rotary_dim = wire.rotary().rotary_dim();
  if (wire.rotary().theta() != 0.0f) config.rotary.theta = wire.rotary().theta();
  config.context_dim = wire.context_dim();
  return core::ResolveHeadConfig(config);
}

// Checks the sizes of a layout against the limits, then builds it.
// `lengths_field` names the request's lengths field in messages.
absl::StatusOr<core::SequenceLayout> MakeLayout(const TensorSpec& spec, absl::string_view field,
                                                const google::protobuf::RepeatedField<int64_t>& lengths,
                                                absl::string_view lengths_field,
                                                const RequestLimits& limits) {
  // The lengths are checked where they are, and copied only once their count
  // is known to be small.
  if (spec.shape.size() == 3) {  // padded [batch, seq, d_model]
    const int64_t batch = spec.shape[0], seq = spec.shape[1];
    ATTNSERVE_RETURN_IF_ERROR(OverLimit(absl::StrCat(field, ".shape[0] (batch)"), batch,
                                        limits.max_batch, "max_batch", kFewerSequences));
    ATTNSERVE_RETURN_IF_ERROR(OverLimit(absl::StrCat(field, ".shape[1] (seq)"), seq,
                                        limits.max_seq_len, "max_seq_len", kShorterSequences));
    if (!lengths.empty()) {
      if (lengths.size() != batch) {
        return InvalidField(lengths_field, absl::StrCat(lengths.size(), " lengths for a batch of ", batch));
      }
      for (int b = 0; b < lengths.size(); ++b) {
        if (lengths[b] < 1 || lengths[b] > seq) {
          return InvalidField(lengths_field, absl::StrCat("[", b, "] is ", lengths[b],
                                                          ", outside [1, ", seq, "] (", field, " seq)"));
        }
      }
    }
    return core::SequenceLayout::Padded(batch, seq,
                                        std::vector<int64_t>(lengths.begin(), lengths.end()));
  }
  // packed [tokens, d_model]: first whether the lengths fit the tokens, then
  // the limits (both INVALID_ARGUMENT; the messages differ).
  const int64_t tokens = spec.shape[0];
  if (lengths.empty()) {
    return InvalidField(lengths_field,
                        absl::StrCat("required with packed ", field, " [tokens, d_model]"));
  }
  if (lengths.size() > tokens) {
    return InvalidField(lengths_field, absl::StrCat(lengths.size(), " sequences in ", tokens, " tokens of ",
                                                    field));
  }
  int64_t total = 0;
  for (int b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1 || lengths[b] > tokens) {
      return InvalidField(lengths_field, absl::StrCat("[", b, "] is ", lengths[b], ", outside [1, ",
                                                      tokens, "] (", field, " tokens)"));
    }
    total += lengths[b];  // at most tokens^2, and tokens fit a message: no overflow
  }
  if (total != tokens) {
    return InvalidField(lengths_field,
                        absl::StrCat("sum to ", total, ", but ", field, " has ", tokens, " tokens"));
  }
  ATTNSERVE_RETURN_IF_ERROR(OverLimit(absl::StrCat(lengths_field, " (sequences)"), lengths.size(),
                                      limits.max_batch, "max_batch", kFewerSequences));
  for (int b = 0; b < lengths.size(); ++b) {
    ATTNSERVE_RETURN_IF_ERROR(OverLimit(absl::StrCat(lengths_field, "[", b, "]"), lengths[b],
                                        limits.max_seq_len, "max_seq_len", kShorterSequences));
  }
  return core::SequenceLayout::Packed(std::vector<int64_t>(lengths.begin(), lengths.end()));
}

// Validates hidden states or context: rank 3 (padded) or 2 (packed), and the
// last dimension `width` (named `width_name`: d_model or context_dim).
absl::StatusOr<TensorSpec> ValidateStates(const v1::Tensor& tensor, absl::string_view field,
                                          int64_t width, absl::string_view width_name) {
  TensorSpec spec;
  if (tensor.shape_size() == 3) {
    ATTNSERVE_ASSIGN_OR_RETURN(spec, ValidateTensor(tensor, field, kPaddedDims));
  } else if (tensor.shape_size() == 2) {
    ATTNSERVE_ASSIGN_OR_RETURN(spec, ValidateTensor(tensor, field, kPackedDims));
  } else {
    return InvalidField(absl::StrCat(field, ".shape"),
                        absl::StrCat("expected rank 3 [batch, seq, d_model] or rank 2 [tokens, d_model], "
                                     "got rank ",
                                     tensor.shape_size()));
  }
  if (spec.dtype == v1::DATA_TYPE_BOOL) {
    return InvalidField(absl::StrCat(field, ".dtype"), "must be FP32 or BF16");
  }
  const size_t d = spec.shape.size() - 1;
  if (spec.shape[d] != width) {
    return InvalidField(absl::StrCat(field, ".shape[", d, "] (", width_name, ")"),
                        absl::StrCat("the layer expects ", width, ", got ", spec.shape[d]));
  }
  return spec;
}

absl::Status CheckDims(const TensorSpec& spec, absl::string_view field, size_t dim,
                       absl::string_view name, int64_t expected, absl::string_view source) {
  if (spec.shape[dim] == expected) return absl::OkStatus();
  return InvalidField(absl::StrCat(field, ".shape[", dim, "] (", name, ")"),
                      absl::StrCat("must be ", expected, " (", source, "), got ", spec.shape[dim]));
}

absl::Status PlanSource(const v1::AttendRequest& request, const ModelRegistry& registry,
                        const RequestLimits& limits, AttendPlan& plan) {
  const bool has_model = !request.model().empty();
  const bool has_layer = request.has_layer();
  if (has_model == has_layer) {
    return InvalidField("model", has_model ? "set model or layer, not both"
                                           : "required (ListModels shows the loaded models), or give "
                                             "an ad-hoc layer");
  }
  if (has_model) {
    absl::StatusOr<std::shared_ptr<const Model>> model = registry.Find(request.model());
    if (!model.ok()) {
      return absl::Status(model.status().code(), absl::StrCat("model: ", model.status().message()));
    }
    plan.model = *std::move(model);
    plan.config = plan.model->layer->config();
    return absl::OkStatus();
  }

  const v1::LayerSpec& layer = request.layer();
  if (!layer.has_head_config()) return InvalidField("layer.head_config", "required");
  v1::HeadConfig head_config = layer.head_config();
  if (request.has_projected() && head_config.d_model() == 0) {
    // The attention core alone has no projections: d_model is not used.
    if (head_config.head_dim() <= 0) {
      return InvalidField("layer.head_config.head_dim", "required for projected heads");
    }
    const int64_t width = int64_t{head_config.num_heads()} * head_config.head_dim();
    if (width < 1 || width > core::kMaxDModel) {
      return InvalidField("layer.head_config", absl::StrCat("num_heads x head_dim is ", width,
                                                            ", outside [1, ", core::kMaxDModel, "]"));
    }
    head_config.set_d_model(static_cast<int32_t>(width));
  }
  absl::StatusOr<core::HeadConfig> config = ToCoreHeadConfig(head_config);
  if (!config.ok()) {  // core names the fields under head_config: "layer." prefixes them
    return absl::Status(config.status().code(), absl::StrCat("layer.", config.status().message()));
  }
  AdHocLayer adhoc;
  adhoc.config = plan.config = *config;

  // Weight bytes as FP32, the form the layer keeps them in.
  const core::HeadConfig& c = *config;
  const int64_t weight_elements = c.d_model * c.q_width() + c.context_dim * 2 * c.kv_width() +
                                  (c.q_width() + 2 * c.kv_width()) + c.q_width() * c.d_model +
                                  c.d_model;  // bounded by kMaxDModel etc.: no overflow
  switch (layer.weights_case()) {
    case v1::LayerSpec::kSeed:
      adhoc.seed = layer.seed();
      break;
    case v1::LayerSpec::kInlineWeights: {
      const v1::LayerWeights& w = layer.inline_weights();
      const struct {
        const v1::Tensor& tensor;
        absl::string_view name;
        int64_t rows, cols;  // cols 0: a vector
      } expected[] = {{w.w_q(), "w_q", c.d_model, c.q_width()}, {w.b_q(), "b_q", c.q_width(), 0},
                      {w.w_k(), "w_k", c.context_dim, c.kv_width()}, {w.b_k(), "b_k", c.kv_width(), 0},
                      {w.w_v(), "w_v", c.context_dim, c.kv_width()}, {w.b_v(), "b_v", c.kv_width(), 0},
                      {w.w_o(), "w_o", c.q_width(), c.d_model},  {w.b_o(), "b_o", c.d_model, 0}};
      constexpr absl::string_view kMatrixDims[] = {"in", "out"};
      constexpr absl::string_view kVectorDims[] = {"out"};
      for (const auto& e : expected) {
        const std::string field = absl::StrCat("layer.inline_weights.", e.name);
        TensorSpec spec;
        if (e.cols > 0) {
          ATTNSERVE_ASSIGN_OR_RETURN(spec, ValidateTensor(e.tensor, field, kMatrixDims));
          ATTNSERVE_RETURN_IF_ERROR(CheckDims(spec, field, 0, "in", e.rows, "the head config"));
          ATTNSERVE_RETURN_IF_ERROR(CheckDims(spec, field, 1, "out", e.cols, "the head config"));
        } else {
          ATTNSERVE_ASSIGN_OR_RETURN(spec, ValidateTensor(e.tensor, field, kVectorDims));
          ATTNSERVE_RETURN_IF_ERROR(CheckDims(spec, field, 0, "out", e.rows, "the head config"));
        }
        if (spec.dtype == v1::DATA_TYPE_BOOL) {
          return InvalidField(absl::StrCat(field, ".dtype"), "must be FP32 or BF16");
        }
        adhoc.inline_weights.push_back(std::move(spec));
      }
      break;
    }
    case v1::LayerSpec::WEIGHTS_NOT_SET:
      if (!request.has_projected()) {
        return InvalidField("layer.weights", "set seed or inline_weights (only projected requests "
                                             "need no weights)");
      }
      break;
  }
  if (layer.weights_case() != v1::LayerSpec::WEIGHTS_NOT_SET) {
    ATTNSERVE_RETURN_IF_ERROR(OverLimit(
        "layer (weight bytes as FP32)", weight_elements * 4, limits.max_adhoc_weight_bytes,
        "max_adhoc_weight_bytes",
        "send a layer with a smaller d_model or fewer or narrower heads, or serve a layer this "
        "large as a model (--model_repository)"));
  }
  plan.adhoc = std::move(adhoc);
  return absl::OkStatus();
}

absl::Status PlanInputs(const v1::AttendRequest& request, const RequestLimits& limits,
                        AttendPlan& plan) {
  const core::HeadConfig& c = plan.config;
  if (request.has_hidden_states() == request.has_projected()) {
    return InvalidField("hidden_states", request.has_projected()
                                             ? "set hidden_states or projected, not both"
                                             : "required: [batch, seq, d_model] or packed [tokens, "
                                               "d_model] (or projected heads)");
  }
  if (!request.has_projected()) {
    ATTNSERVE_ASSIGN_OR_RETURN(plan.hidden_states,
                               ValidateStates(request.hidden_states(), "hidden_states", c.d_model, "d_model"));
    ATTNSERVE_ASSIGN_OR_RETURN(plan.queries,
                               MakeLayout(plan.hidden_states, "hidden_states",
                                          request.sequence_lengths(), "sequence_lengths", limits));
    plan.float_data_response = plan.hidden_states.uses_float_data;
    if (request.has_context()) {
      ATTNSERVE_ASSIGN_OR_RETURN(TensorSpec context,
                                 ValidateStates(request.context(), "context", c.context_dim, "context_dim"));
      ATTNSERVE_ASSIGN_OR_RETURN(
          plan.keys, MakeLayout(context, "context", request.context_lengths(), "context_lengths", limits));
      if (plan.keys.batch() != plan.queries.batch()) {
        return InvalidField("context", absl::StrCat("has ", plan.keys.batch(), " sequences, hidden_states ",
                                                    plan.queries.batch()));
      }
      plan.context = std::move(context);
    } else {
      if (request.context_lengths_size() > 0) return InvalidField("context_lengths", "given without context");
      if (c.context_dim != c.d_model) {
        return InvalidField("context", absl::StrCat("required: the layer's keys and values come from "
                                                    "context states of width context_dim ",
                                                    c.context_dim, ", not from the hidden states"));
      }
      plan.keys = plan.queries;
    }
    plan.output_shape = plan.hidden_states.shape;
    plan.output_elements = plan.hidden_states.elements;
    return absl::OkStatus();
  }

  // The attention core alone.
  plan.projected = true;
  if (request.has_context()) {
    return InvalidField("context", "not used with projected heads (give k and v)");
  }
  if (request.position_offsets_size() > 0) {
    return InvalidField("position_offsets", "not used with projected heads (no RoPE is applied)");
  }
  const v1::ProjectedHeads& p = request.projected();
  ATTNSERVE_ASSIGN_OR_RETURN(plan.q, ValidateTensor(p.q(), "projected.q", kProjectedQDims));
  ATTNSERVE_ASSIGN_OR_RETURN(plan.k, ValidateTensor(p.k(), "projected.k", kProjectedKvDims));
  ATTNSERVE_ASSIGN_OR_RETURN(plan.v, ValidateTensor(p.v(), "projected.v", kProjectedKvDims));
  for (const auto& [spec, field] : {std::pair<const TensorSpec&, absl::string_view>{plan.q, "projected.q"},
                                    {plan.k, "projected.k"},
                                    {plan.v, "projected.v"}}) {
    if (spec.dtype == v1::DATA_TYPE_BOOL) {
      return InvalidField(absl::StrCat(field, ".dtype"), "must be FP32 or BF16");
    }
    if (spec.uses_float_data != plan.q.uses_float_data) {
      return InvalidField(field, "use raw_data or float_data for all of q, k and v");
    }
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckDims(plan.q, "projected.q", 1, "num_heads", c.num_heads, "the head config"));
  ATTNSERVE_RETURN_IF_ERROR(CheckDims(plan.q, "projected.q", 3, "head_dim", c.head_dim, "the head config"));
  ATTNSERVE_RETURN_IF_ERROR(CheckDims(plan.k, "projected.k", 0, "batch", plan.q.shape[0], "q's batch"));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckDims(plan.k, "projected.k", 1, "num_kv_heads", c.num_kv_heads, "the head config"));
  ATTNSERVE_RETURN_IF_ERROR(CheckDims(plan.k, "projected.k", 3, "head_dim", c.head_dim, "the head config"));
  for (size_t d = 0; d < 4; ++d) {
    ATTNSERVE_RETURN_IF_ERROR(CheckDims(plan.v, "projected.v", d, kProjectedKvDims[d], plan.k.shape[d],
                                        "the same as projected.k"));
  }
  // Layouts in the padded form the core reads: q [batch, heads, seq_q, head_dim].
  const TensorSpec q_rows{.shape = {plan.q.shape[0], plan.q.shape[2], 1}};
  const TensorSpec kv_rows{.shape = {plan.k.shape[0], plan.k.shape[2], 1}};
  ATTNSERVE_ASSIGN_OR_RETURN(
      plan.queries, MakeLayout(q_rows, "projected.q", request.sequence_lengths(), "sequence_lengths", limits));
  ATTNSERVE_ASSIGN_OR_RETURN(
      plan.keys, MakeLayout(kv_rows, "projected.k", request.context_lengths(), "context_lengths", limits));
  plan.float_data_response = plan.q.uses_float_data;
  plan.output_shape = plan.q.shape;
  plan.output_elements = plan.q.elements;
  return absl::OkStatus();
}

absl::Status PlanMask(const v1::AttendRequest& request, AttendPlan& plan) {
  if (!request.has_mask()) return absl::OkStatus();
  const v1::AttentionMask& mask = request.mask();
  switch (mask.kind()) {
    case v1::AttentionMask::KIND_ALLOWED:
      plan.mask.kind = ExplicitMask::Kind::kAllowed;
      break;
    case v1::AttentionMask::KIND_ADDITIVE:
      plan.mask.kind = ExplicitMask::Kind::kAdditive;
      break;
    case v1::AttentionMask::KIND_UNSPECIFIED:
      return InvalidField("mask.kind", "required: KIND_ALLOWED or KIND_ADDITIVE");
    default:
      return InvalidField("mask.kind", absl::StrCat("unknown value ", static_cast<int>(mask.kind())));
  }
  if (!mask.has_values()) return InvalidField("mask.values", "required with mask.kind");
  ATTNSERVE_ASSIGN_OR_RETURN(plan.mask.values, ValidateTensor(mask.values(), "mask.values", kMaskDims));
  const TensorSpec& v = plan.mask.values;
  if (plan.mask.kind == ExplicitMask::Kind::kAdditive && v.dtype == v1::DATA_TYPE_BOOL) {
    return InvalidField("mask.values.dtype", "an additive mask is FP32 or BF16 (BOOL is for KIND_ALLOWED)");
  }
  return core::ValidateMaskDims(
      {v.shape[0], v.shape[1], v.shape[2]}, plan.queries.batch(), plan.queries.max_length(),
      plan.keys.max_length(),
      {"mask.values.shape[0] (batch)", "mask.values.shape[1] (seq_q)", "mask.values.shape[2] (seq_kv)"});
}

absl::Status PlanOptions(const v1::AttendRequest& request, AttendPlan& plan) {
  const core::HeadConfig& c = plan.config;
  // A causal model (a decoder's layer) is causal for every request.
  plan.causal = request.causal() || (plan.model != nullptr && plan.model->causal);
  ATTNSERVE_RETURN_IF_ERROR(PlanMask(request, plan));

  ATTNSERVE_RETURN_IF_ERROR(core::ValidateHeadMask(
      absl::MakeConstSpan(request.head_mask().data(), request.head_mask_size()), c.num_heads,
      "head_mask"));
  plan.head_mask.assign(request.head_mask().begin(), request.head_mask().end());

  ATTNSERVE_RETURN_IF_ERROR(core::ValidatePositionOffsets(
      absl::MakeConstSpan(request.position_offsets().data(), request.position_offsets_size()),
      plan.queries.batch(), c.rotary.rotary_dim, "position_offsets"));
  plan.position_offsets.assign(request.position_offsets().begin(), request.position_offsets().end());

  ATTNSERVE_ASSIGN_OR_RETURN(plan.precision, PrecisionFromWire(request.precision()));
  ATTNSERVE_ASSIGN_OR_RETURN(plan.output_dtype, OutputDtypeFromWire(request.output_dtype()));
  if (plan.output_dtype == v1::DATA_TYPE_BF16) {
    plan.float_data_response = false;  // BF16 travels as raw_data only
  }
  return absl::OkStatus();
}

absl::Status PlanMaps(const v1::AttendRequest& request, const RequestLimits& limits,
                      AttendPlan& plan) {
  const v1::AttentionMapRequest& maps = request.attention_maps();
  ATTNSERVE_ASSIGN_OR_RETURN(plan.maps.mode, ToCoreMapMode(maps.mode()));
  plan.head_statistics = maps.head_statistics();
  plan.maps.heads.assign(maps.heads().begin(), maps.heads().end());
  plan.maps.query_rows.assign(maps.query_rows().begin(), maps.query_rows().end());
  ATTNSERVE_RETURN_IF_ERROR(core::ValidateMapSelection(plan.maps, plan.config.num_heads,
                                                       plan.queries.max_length(), "attention_maps"));

  std::optional<int64_t> elements =
      core::AttentionMapElements(plan.config, plan.queries, plan.keys, plan.maps);
  std::optional<int64_t> bytes = elements ? core::CheckedMul(*elements, sizeof(float)) : std::nullopt;
  if (!bytes || *bytes > limits.max_attention_map_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention_maps: ", bytes ? absl::StrCat(*bytes, " bytes") : "more bytes than int64",
        " is over this server's limit of ", limits.max_attention_map_bytes,
        " (--max_attention_map_bytes); ask for mean maps, some heads (attention_maps.heads) or "
        "query rows (attention_maps.query_rows), or head_statistics instead"));
  }
  plan.map_elements = *elements;
  if (plan.maps.mode != core::AttentionMapMode::kNone) {
    const auto chosen = [](const std::vector<int64_t>& some, int64_t all) {
      return some.empty() ? all : static_cast<int64_t>(some.size());
    };
    plan.map_shape = {plan.queries.batch(), chosen(plan.maps.heads, plan.config.num_heads),
                      chosen(plan.maps.query_rows, plan.queries.max_length()), plan.keys.max_length()};
    // [batch, heads, rows, keys]; mean maps have no heads dim
    if (plan.maps.mode != core::AttentionMapMode::kPerHead) plan.map_shape.erase(plan.map_shape.begin() + 1);
  }
  return absl::OkStatus();
}

// Core's value rules under the wire's field names, once every size is within
// the limits: one read of each value a forward reads, on the gRPC thread, so
// a bad request never reaches the queue or a batch.
absl::Status CheckValues(const v1::AttendRequest& request, const AttendPlan& plan) {
  const core::HeadConfig& c = plan.config;
  const v1::ProjectedHeads& p = request.projected();
  const struct {
    const v1::Tensor& tensor;
    const TensorSpec* spec;  // null: absent
    const core::SequenceLayout& layout;
    int64_t blocks, width;
    absl::string_view field;
  } inputs[] = {
      {request.hidden_states(), plan.projected ? nullptr : &plan.hidden_states, plan.queries, 1,
       c.d_model, "hidden_states"},
      {request.context(), plan.context ? &*plan.context : nullptr, plan.keys, 1, c.context_dim,
       "context"},
      {p.q(), plan.projected ? &plan.q : nullptr, plan.queries, c.num_heads, c.head_dim, "projected.q"},
      {p.k(), plan.projected ? &plan.k : nullptr, plan.keys, c.num_kv_heads, c.head_dim, "projected.k"},
      {p.v(), plan.projected ? &plan.v : nullptr, plan.keys, c.num_kv_heads, c.head_dim, "projected.v"}};
  for (const auto& in : inputs) {
    if (in.spec == nullptr) continue;
    ATTNSERVE_RETURN_IF_ERROR(OnWireValues(in.tensor, *in.spec, [&](auto values) {
      return core::ValidateFinite(values, in.layout, in.blocks, in.width, in.field);
    }));
  }
  if (plan.mask.kind == ExplicitMask::Kind::kNone || plan.mask.values.dtype == v1::DATA_TYPE_BOOL) {
    return absl::OkStatus();  // a BOOL mask holds 0 or 1 only
  }
  return OnWireValues(request.mask().values(), plan.mask.values, [&](auto values) {
    return core::ValidateMaskValues(values, plan.mask.kind, "mask.values");
  });
}

// The compute scratch, in bytes: the route's the core will take (blocked
// without maps and statistics: O(S * block), not O(S^2)); infinity when it
// overflows int64.
double EstimateScratchBytes(const AttendPlan& plan, core::BlockKernels block_kernels) {
  core::RouteRequest route_request;
  route_request.queries = plan.queries;
  route_request.keys = plan.keys;
  route_request.cross_attention = plan.context.has_value();
  route_request.projected_inputs = plan.projected;
  route_request.causal = plan.causal;
  route_request.mask = plan.mask.kind;
  const absl::StatusOr<core::Route> route =
      core::MakeRoute(plan.config, route_request, ForwardOptionsFor(plan, block_kernels));
  return route.ok() ? static_cast<double>(route->scratch_bytes())
                    : std::numeric_limits<double>::infinity();
}

}  // namespace

absl::StatusOr<core::Precision> PrecisionFromWire(v1::Precision precision) {
  switch (precision) {
    case v1::PRECISION_UNSPECIFIED:
    case v1::PRECISION_FP32:
      return core::Precision::kFp32;
    case v1::PRECISION_BF16:
      return core::Precision::kBf16;
    default:
      return InvalidField("precision", absl::StrCat("unknown value ", static_cast<int>(precision)));
  }
}

absl::StatusOr<v1::DataType> OutputDtypeFromWire(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_UNSPECIFIED:
    case v1::DATA_TYPE_FP32:
      return v1::DATA_TYPE_FP32;
    case v1::DATA_TYPE_BF16:
      return v1::DATA_TYPE_BF16;
    default:
      return InvalidField("output_dtype",
                          absl::StrCat("must be FP32 or BF16, got ", DataTypeName(dtype)));
  }
}

core::ForwardOptions ForwardOptionsFor(const AttendPlan& plan, core::BlockKernels block_kernels) {
  core::ForwardOptions options;
  options.maps = plan.maps;
  options.head_statistics = plan.head_statistics;
  options.precision = plan.precision;
  options.block_kernels = block_kernels;
  return options;
}

absl::StatusOr<AttendPlan> PlanAttend(const v1::AttendRequest& request,
                                      const ModelRegistry& registry, const RequestLimits& limits,
                                      int64_t max_response_bytes,
                                      core::BlockKernels block_kernels,
                                      MapDelivery map_delivery) {
  AttendPlan plan;
  ATTNSERVE_RETURN_IF_ERROR(PlanSource(request, registry, limits, plan));
  ATTNSERVE_RETURN_IF_ERROR(PlanInputs(request, limits, plan));
  ATTNSERVE_RETURN_IF_ERROR(PlanOptions(request, plan));
  ATTNSERVE_RETURN_IF_ERROR(PlanMaps(request, limits, plan));
  const double scratch = EstimateScratchBytes(plan, block_kernels);
  // Every check from here on is of a fixed limit, like OverLimit's.
  if (scratch > static_cast<double>(limits.max_scratch_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: needs about ", static_cast<int64_t>(scratch / (1 << 20)),
        " MiB of compute scratch, over this server's limit of ", limits.max_scratch_bytes >> 20,
        " MiB (--max_scratch_bytes); send fewer or shorter sequences, or a layer with fewer or "
        "narrower heads"));
  }

  // Output and maps in the output dtype, statistics in FP32. Each term is
  // bounded by a limit or the received message size: no overflow.
  const int64_t value_bytes = DataTypeSize(plan.output_dtype);
  const int64_t statistics = plan.head_statistics ? 3 * plan.queries.batch() * plan.config.num_heads : 0;
  // Protobuf framing (tags, lengths, shapes, timing, kernel path) stays far
  // below kResponseFramingBytes.
  const int64_t response_bytes = (plan.output_elements + plan.map_elements) * value_bytes +
                                 statistics * int64_t{sizeof(float)} + kResponseFramingBytes;
  const bool streamed = map_delivery == MapDelivery::kStreamed;
  // The largest message: the whole response, or, streamed, the response
  // without the maps or a chunk (of at least one row).
  const int64_t largest_message =
      streamed ? std::max(response_bytes - plan.map_elements * value_bytes,
                          plan.keys.max_length() * value_bytes + kResponseFramingBytes)
               : response_bytes;
  if (largest_message > max_response_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "response: ", largest_message, " bytes of output", streamed ? "" : " and maps",
        " is over this server's limit of ", max_response_bytes,
        " (--max_send_message_bytes); send fewer sequences, ask for fewer maps, or ask for BF16 "
        "output", streamed ? "" : " (or the maps streamed: AttendStream)"));
  }
  if (plan.float_data_response &&
      std::max(plan.output_elements, plan.map_elements) > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        "response: too many values for float_data; send the input as raw_data");
  }

  // The memory the request holds while it runs: FP32 copies of its inputs,
  // the compute scratch, output and maps as FP32, the serialized response,
  // and the packed copies a batch makes of its rows (BatchCopyBytes). In
  // double, like the scratch: the terms are bounded, not small.
  double input_elements = static_cast<double>(plan.hidden_states.elements) +
                          static_cast<double>(plan.q.elements + plan.k.elements + plan.v.elements) +
                          static_cast<double>(plan.mask.values.elements);
  if (plan.context) input_elements += static_cast<double>(plan.context->elements);
  const double memory =
      4.0 * (input_elements + static_cast<double>(plan.output_elements + plan.map_elements)) +
      scratch + static_cast<double>(response_bytes) + static_cast<double>(BatchCopyBytes(plan));
  if (memory > static_cast<double>(limits.max_request_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: needs about ", static_cast<int64_t>(memory / (1 << 20)),
        " MiB (inputs, activations, scores, maps and response), over this server's limit of ",
        limits.max_request_bytes >> 20,
        " MiB per request (--max_request_bytes); ask for fewer maps (attention_maps.heads, or "
        "ATTENTION_MAP_MODE_MEAN), a subset of rows (attention_maps.query_rows), or "
        "attention_maps.head_statistics instead of maps, or send fewer or shorter sequences"));
  }
  plan.memory_bytes = static_cast<int64_t>(memory);
  ATTNSERVE_RETURN_IF_ERROR(CheckValues(request, plan));
  return plan;
}

}  // namespace attnserve::server
