#include "server/api/extend_runner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/bf16.h"
#include "core/route.h"
#include "core/status_macros.h"
#include "core/validation.h"
#include "server/api/attend_plan.h"

namespace attnserve::server {
namespace {

constexpr absl::string_view kStatesDims[] = {"tokens", "d_model"};
// Room for everything in a result besides the tensors' values.
constexpr int64_t kResultFramingBytes = 256;

// `status` with the step's field path in front: "steps[i].<field>: ..." for
// a message that starts with a field name, "steps[i]: ..." otherwise.
absl::Status ForStep(int i, const absl::Status& status) {
  const absl::string_view message = status.message();
  const bool names_field =
      absl::StartsWith(message, "layer:") || absl::StartsWith(message, "hidden_states:");
  return absl::Status(status.code(), absl::StrCat("steps[", i, "]", names_field ? "." : ": ",
                                                  message));
}

float AsFloat(float value) { return value; }
float AsFloat(core::Bf16 value) { return core::Bfloat16ToFloat(value); }

// Checks what needs the session's layer: the width of the hidden states, the
// head mask, the values.
absl::Status CheckStepForLayer(const v1::ExtendStep& step, const TensorSpec& spec,
                               const Model& model, absl::string_view field) {
  const core::HeadConfig& config = model.layer->config();
  if (spec.shape[1] != config.d_model) {
    return core::InvalidField(absl::StrCat(field, ".hidden_states"),
                              absl::StrCat("d_model is ", spec.shape[1], ", model '", model.name,
                                           "' has ", config.d_model));
  }
  if (absl::Status mask = core::ValidateHeadMask(
          absl::MakeConstSpan(step.head_mask().data(), step.head_mask_size()), config.num_heads,
          absl::StrCat(field, ".head_mask"));
      !mask.ok()) {
    return mask;
  }
  // Read as sent (BF16 without converting): RunExtend converts once.
  ATTNSERVE_ASSIGN_OR_RETURN(const core::SequenceLayout layout,
                             core::SequenceLayout::Packed({spec.shape[0]}));
  const std::string states_field = absl::StrCat(field, ".hidden_states");
  return OnWireValues(step.hidden_states(), spec, [&](auto values) {
    absl::Status finite = core::ValidateFinite(values, layout, 1, config.d_model, states_field);
    if (finite.ok()) return finite;
    // Where, in the session's terms (looked for on a hit only).
    for (size_t i = 0; i < values.size(); ++i) {
      const float value = AsFloat(values[i]);
      if (std::isfinite(value)) continue;
      const int64_t row = static_cast<int64_t>(i) / config.d_model;
      return core::InvalidField(
          states_field, absl::StrCat("row ", row, " (the session's token ", step.expected_length() + row,
                                     ") holds ", value, "; states must be finite"));
    }
    return finite;
  });
}

// A step that passed CheckStep.
struct CheckedStep {
  TensorSpec hidden_states;
  std::shared_ptr<const Model> model;  // its session's layer
};

// Everything that can refuse step `i` before it is admitted (admission may
// evict other sessions for its memory): its hidden states' shape and values,
// its expected length, its session and layer.
absl::StatusOr<CheckedStep> CheckStep(const v1::ExtendStep& step, int i, SessionManager& sessions,
                                      absl::string_view owner, const RequestLimits& limits,
                                      int64_t chunk_tokens) {
  const std::string field = absl::StrCat("steps[", i, "]");
  ATTNSERVE_ASSIGN_OR_RETURN(
      TensorSpec spec,
      ValidateTensor(step.hidden_states(), absl::StrCat(field, ".hidden_states"), kStatesDims));
  const int64_t n = spec.shape[0];
  // With chunking a step may hold up to its session's token limit (BeginStep
  // refuses more); the message and response limits bound its memory.
  if (chunk_tokens == 0 && n > limits.max_seq_len) {
    return core::InvalidField(
        absl::StrCat(field, ".hidden_states"),
        absl::StrCat(n, " tokens is over this server's limit of ", limits.max_seq_len,
                     " a step (--max_seq_len, with --prefill_chunk_tokens=0); send the "
                     "prefill in chunks"));
  }
  if (step.expected_length() < 0 || step.expected_length() > core::kMaxPositionOffset) {
    return core::InvalidField(
        absl::StrCat(field, ".expected_length"),
        absl::StrCat(step.expected_length(), " is outside [0, ", core::kMaxPositionOffset, "]"));
  }
  absl::StatusOr<std::shared_ptr<const Model>> model =
      sessions.LayerModel(step.session_id(), owner, step.layer());
  if (!model.ok()) return ForStep(i, model.status());
  ATTNSERVE_RETURN_IF_ERROR(CheckStepForLayer(step, spec, **model, field));
  return CheckedStep{std::move(spec), *std::move(model)};
}

// What a step's inputs and options hash to: a retry carries the same.
uint64_t StepFingerprint(const v1::ExtendRequest& request, const v1::ExtendStep& step) {
  const v1::Tensor& states = step.hidden_states();
  const absl::string_view values =
      !states.raw_data().empty()
          ? absl::string_view(states.raw_data())
          : absl::string_view(reinterpret_cast<const char*>(states.float_data().data()),
                              static_cast<size_t>(states.float_data_size()) * sizeof(float));
  const absl::string_view mask(reinterpret_cast<const char*>(step.head_mask().data()),
                               static_cast<size_t>(step.head_mask_size()) * sizeof(float));
  return absl::Hash<std::tuple<absl::string_view, int, absl::string_view, bool, bool, int, int>>{}(
      std::make_tuple(values, static_cast<int>(states.dtype()), mask, step.attention_maps(),
                      step.head_statistics(), static_cast<int>(request.precision()),
                      static_cast<int>(request.output_dtype())));
}

}  // namespace

absl::StatusOr<ExtendPlan> PlanExtend(const v1::ExtendRequest& request, SessionManager& sessions,
                                      absl::string_view owner, const RequestLimits& limits,
                                      int64_t max_response_bytes, int64_t chunk_tokens) {
  if (request.steps_size() == 0 || request.steps_size() > kMaxExtendSteps) {
    return core::InvalidField("steps", absl::StrCat("between 1 and ", kMaxExtendSteps,
                                                    " steps, got ", request.steps_size()));
  }
  ExtendPlan plan;
  plan.chunk_tokens = std::max<int64_t>(0, chunk_tokens);
  ATTNSERVE_ASSIGN_OR_RETURN(plan.precision, PrecisionFromWire(request.precision()));
  ATTNSERVE_ASSIGN_OR_RETURN(plan.output_dtype, OutputDtypeFromWire(request.output_dtype()));
  const int64_t value_bytes = DataTypeSize(plan.output_dtype);
  plan.steps.resize(static_cast<size_t>(request.steps_size()));
  int64_t map_bytes = 0, response_bytes = 0;
  std::map<const Model*, int64_t> tokens_per_model;  // a round's
  int64_t input_floats = 0, chunk_map_floats = 0;
  int64_t scratch_bytes = 0;  // the statistics' scratch maps of the steps that compute
  for (int i = 0; i < request.steps_size(); ++i) {
    const v1::ExtendStep& step = request.steps(i);
    ExtendStepPlan& planned = plan.steps[static_cast<size_t>(i)];
    const std::string field = absl::StrCat("steps[", i, "]");
    absl::StatusOr<CheckedStep> checked =
        CheckStep(step, i, sessions, owner, limits, plan.chunk_tokens);
    if (!checked.ok()) {
      planned.status = checked.status();
      continue;
    }
    const int64_t n = checked->hidden_states.shape[0];
    const core::HeadConfig& config = checked->model->layer->config();
    const int64_t maps =
        step.attention_maps() ? config.num_heads * n * (step.expected_length() + n) : 0;
    // Statistics travel as FP32 [num_heads, n] twice; without maps they are
    // computed from FP32 maps in scratch (a chunk's rows at a time), held to
    // the same map limit.
    const int64_t statistics = step.head_statistics() ? 2 * config.num_heads * n : 0;
    const int64_t scratch_rows = plan.chunk_tokens > 0 ? std::min(n, plan.chunk_tokens) : n;
    const int64_t scratch_map_bytes =
        step.head_statistics() && !step.attention_maps()
            ? config.num_heads * scratch_rows * (step.expected_length() + n) *
                  int64_t{sizeof(float)}
            : 0;
    const int64_t bytes = (n * config.d_model + maps) * value_bytes +
                          statistics * int64_t{sizeof(float)} + kResultFramingBytes;
    if (map_bytes + maps * value_bytes + scratch_map_bytes > limits.max_attention_map_bytes ||
        response_bytes + bytes > max_response_bytes) {
      planned.status = core::InvalidField(
          absl::StrCat(field, step.attention_maps() || !step.head_statistics()
                                  ? ".attention_maps"
                                  : ".head_statistics"),
          absl::StrCat("the response's maps or bytes would pass this server's limits "
                       "(--max_attention_map_bytes ",
                       limits.max_attention_map_bytes, ", --max_send_message_bytes ",
                       max_response_bytes, "); send fewer steps or ask for fewer maps"));
      continue;
    }
    absl::StatusOr<StepLease> lease =
        sessions.BeginStep(step.session_id(), owner, step.layer(), step.expected_length(), n,
                           StepFingerprint(request, step));
    if (!lease.ok()) {
      planned.status = ForStep(i, lease.status());
      continue;
    }
    const Model& model_ref = lease->model();
    map_bytes += maps * value_bytes + scratch_map_bytes;
    response_bytes += bytes;
    const int64_t map_elements = lease->replay() ? 0 : maps;
    planned.hidden_states = std::move(checked->hidden_states);
    planned.tokens = n;
    planned.map_elements = map_elements;
    planned.head_statistics = step.head_statistics() && !lease->replay();
    planned.head_mask.assign(step.head_mask().begin(), step.head_mask().end());
    if (!lease->replay()) {
      scratch_bytes += scratch_map_bytes;
      plan.tokens += n;
      // A round computes at most a chunk of it.
      tokens_per_model[&model_ref] += plan.chunk_tokens > 0 ? std::min(n, plan.chunk_tokens) : n;
      input_floats += n * config.d_model;
      if (maps > 0 && plan.chunk_tokens > 0 && n > plan.chunk_tokens) {
        // Every chunked step's chunk maps are alive at once in a round.
        chunk_map_floats += config.num_heads * plan.chunk_tokens * (step.expected_length() + n);
      }
    }
    planned.lease = *std::move(lease);
  }
  // Memory while it runs: the inputs as FP32, outputs and maps (BF16 ones
  // computed in FP32 first), and each model's route scratch for its tokens.
  double memory = static_cast<double>(response_bytes) * (value_bytes == 2 ? 3.0 : 1.0) +
                  static_cast<double>(scratch_bytes);
  for (const auto& [model, tokens] : tokens_per_model) {
    absl::StatusOr<core::Route> route =
        core::MakeExtendRoute(model->layer->config(), tokens, plan.precision);
    if (!route.ok()) return route.status();
    memory += static_cast<double>(route->scratch_bytes());
  }
  memory += 4.0 * static_cast<double>(input_floats);
  // A chunked step's maps: one chunk's rows computed apart, then placed.
  memory += 4.0 * static_cast<double>(chunk_map_floats);
  plan.memory_bytes = static_cast<int64_t>(std::min(memory, 9.0e18));
  return plan;
}

namespace {

void SetStatus(const absl::Status& status, v1::ExtendResult* result) {
  result->set_code(static_cast<int32_t>(status.code()));
  result->set_message(std::string(status.message()));
}

// A step of a member in a round: its next chunk.
struct Chunk {
  ExtendMember* member = nullptr;
  int step = 0;          // request index
  int64_t tokens = 0;    // new tokens this round
  std::vector<float> maps;  // this chunk's maps when they go to the step's in parts
  // This chunk's head statistics [num_heads, tokens] when they go in parts.
  std::vector<float> entropy, max_weight;
};

// The chunks of one AttentionLayer::Extend: one model, head mask, precision.
struct ChunkGroup {
  const Model* model = nullptr;
  std::vector<float> head_mask;
  core::Precision precision = core::Precision::kFp32;
  std::vector<Chunk> chunks;
};

int64_t NextChunk(const ExtendPlan& plan, const ExtendStepPlan& step) {
  const int64_t left = step.tokens - step.done;
  if (plan.chunk_tokens == 0 || step.tokens <= plan.chunk_tokens) return left;
  const core::HeadConfig& config = step.lease->model().layer->config();
  return std::min(left, PrefillChunkTokens(plan.chunk_tokens, step.lease->cache()->length(),
                                           config.d_model, config.q_width(), config.kv_width()));
}

// A step that computes and has not ended.
bool Pending(const ExtendStepPlan& step) {
  return step.lease.has_value() && !step.lease->replay();
}

// Groups the next chunks of the members still running, in order.
std::vector<ChunkGroup> GroupChunks(absl::Span<ExtendMember> members) {
  std::vector<ChunkGroup> groups;
  for (ExtendMember& member : members) {
    if (member.finished) continue;
    const ExtendPlan& plan = *member.plan;
    for (int i = 0; i < static_cast<int>(plan.steps.size()); ++i) {
      const ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
      if (!Pending(step)) continue;
      const Model* model = &step.lease->model();
      auto group = std::find_if(groups.begin(), groups.end(), [&](const ChunkGroup& g) {
        return g.model == model && g.head_mask == step.head_mask &&
               g.precision == plan.precision;
      });
      if (group == groups.end()) {
        groups.push_back({model, step.head_mask, plan.precision, {}});
        group = groups.end() - 1;
      }
      group->chunks.push_back({&member, i, NextChunk(plan, step), {}, {}, {}});
    }
  }
  return groups;
}

// The step's response tensors and FP32 inputs, made on its first round.
void PrepareStep(const ExtendMember& member, int i) {
  ExtendStepPlan& step = member.plan->steps[static_cast<size_t>(i)];
  if (step.input != nullptr) return;
  const v1::ExtendStep& wire = member.request->steps(i);
  const core::HeadConfig& config = step.lease->model().layer->config();
  v1::ExtendResult* result = member.response->mutable_results(i);
  step.input = std::make_unique<FloatValues>(wire.hidden_states(), step.hidden_states);
  const absl::Span<const float> query = step.lease->cache()->latest_query();
  step.query_before.assign(query.begin(), query.end());
  step.output = std::make_unique<OutputTensor>(std::vector<int64_t>{step.tokens, config.d_model},
                                               member.plan->output_dtype,
                                               /*use_float_data=*/false,
                                               result->mutable_output(), nullptr);
  if (step.map_elements > 0) {
    step.maps = std::make_unique<OutputTensor>(
        std::vector<int64_t>{config.num_heads, step.tokens, wire.expected_length() + step.tokens},
        member.plan->output_dtype, false, result->mutable_attention_maps(), nullptr);
    // Chunks write their rows' first columns only: the rest are 0.
    if (NextChunk(*member.plan, step) < step.tokens) {
      std::fill(step.maps->values().begin(), step.maps->values().end(), 0.0f);
    }
  }
  if (step.head_statistics) {
    v1::HeadStatistics* stats = result->mutable_head_statistics();
    const std::vector<int64_t> shape = {config.num_heads, step.tokens};
    step.entropy = std::make_unique<OutputTensor>(shape, v1::DATA_TYPE_FP32, false,
                                                  stats->mutable_entropy(), nullptr);
    step.max_weight = std::make_unique<OutputTensor>(shape, v1::DATA_TYPE_FP32, false,
                                                     stats->mutable_max_weight(), nullptr);
  }
}

// Rows [first, first + rows) of each head's [tokens] row of `to`
// ([num_heads, tokens]) from `from` ([num_heads, rows]).
void PlaceRows(absl::Span<const float> from, int64_t heads, int64_t rows, int64_t first,
               int64_t tokens, absl::Span<float> to) {
  for (int64_t h = 0; h < heads; ++h) {
    std::copy(from.begin() + h * rows, from.begin() + (h + 1) * rows,
              to.begin() + h * tokens + first);
  }
}

// Lets go of what a step held while it ran.
void ReleaseStep(ExtendStepPlan& step) {
  step.lease.reset();
  step.input.reset();
  step.output.reset();
  step.maps.reset();
  step.entropy.reset();
  step.max_weight.reset();
  step.query_before = {};
}

// Ends step `i` of `plan` as failed: its layer truncated back to where the
// step began, its result the error.
void FailStep(ExtendPlan& plan, int i, const absl::Status& status, int64_t expected_length,
              SessionManager& sessions, v1::ExtendResult* result) {
  ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
  if (!step.lease.has_value()) return;
  core::LayerKvCache* cache = step.lease->cache();
  if (cache != nullptr && cache->length() > expected_length) {
    // Cannot fail: 0 <= expected_length < length().
    cache->Truncate(expected_length).IgnoreError();
    cache->SetLatestQuery(step.query_before);  // a no-op when there was none
  }
  if (result != nullptr) {
    if (cache != nullptr) result->set_length(cache->length());
    result->clear_output();
    result->clear_attention_maps();
    result->clear_head_statistics();
    SetStatus(ForStep(i, status), result);
  }
  sessions.EndStep(*std::move(step.lease), status, "");
  ReleaseStep(step);
}

// Runs one group's Extend; ends the steps whose last chunk ran and those
// that failed.
void RunGroup(ChunkGroup& group, SessionManager& sessions, const ComputeContext& compute,
              std::vector<ExtendComputed>* computed) {
  const core::HeadConfig& config = group.model->layer->config();
  const int64_t d_model = config.d_model;
  std::vector<core::ExtendItem> items(group.chunks.size());
  for (size_t k = 0; k < group.chunks.size(); ++k) {
    Chunk& chunk = group.chunks[k];
    const ExtendMember& member = *chunk.member;
    PrepareStep(member, chunk.step);
    ExtendStepPlan& step = member.plan->steps[static_cast<size_t>(chunk.step)];
    core::ExtendItem& item = items[k];
    item.cache = step.lease->cache();
    item.blocks_ahead = step.lease->blocks_ahead();
    item.hidden_states = step.input->values().subspan(
        static_cast<size_t>(step.done * d_model), static_cast<size_t>(chunk.tokens * d_model));
    item.first_position = step.lease->first_position() + step.done;
    item.output = step.output->values().subspan(static_cast<size_t>(step.done * d_model),
                                                static_cast<size_t>(chunk.tokens * d_model));
    if (step.maps != nullptr) {
      if (chunk.tokens == step.tokens) {  // the whole step: its maps in place
        item.attention_map = step.maps->values();
      } else {
        const int64_t length = item.cache->length() + chunk.tokens;
        chunk.maps.resize(static_cast<size_t>(config.num_heads * chunk.tokens * length));
        item.attention_map = absl::MakeSpan(chunk.maps);
      }
    }
    if (step.entropy != nullptr) {
      if (chunk.tokens == step.tokens) {  // the whole step: in place
        item.head_entropy = step.entropy->values();
        item.head_max_weight = step.max_weight->values();
      } else {
        chunk.entropy.resize(static_cast<size_t>(config.num_heads * chunk.tokens));
        chunk.max_weight.resize(chunk.entropy.size());
        item.head_entropy = absl::MakeSpan(chunk.entropy);
        item.head_max_weight = absl::MakeSpan(chunk.max_weight);
      }
    }
  }
  core::ExtendOptions options;
  options.head_mask = group.head_mask;
  options.precision = group.precision;
  // Stops only when no member with a chunk here still wants it.
  options.should_stop = [&group] {
    for (const Chunk& chunk : group.chunks) {
      if (!chunk.member->should_stop || !chunk.member->should_stop()) return false;
    }
    return true;
  };
  const absl::Time start = absl::Now();
  absl::StatusOr<core::ForwardInfo> ran =
      group.model->layer->Extend(absl::MakeSpan(items), options, compute.workspace);
  if (ran.ok()) {
    int64_t tokens = 0, kv_read_bytes = 0;
    for (size_t k = 0; k < items.size(); ++k) {
      if (!items[k].status.ok()) continue;
      tokens += group.chunks[k].tokens;
      group.chunks[k].member->tokens += group.chunks[k].tokens;
      kv_read_bytes += items[k].cache->length() * items[k].cache->layout().token_bytes();
    }
    if (computed != nullptr) {
      computed->push_back({group.model->name, ran->kernel_path, tokens, kv_read_bytes,
                           absl::Now() - start});
    }
  }
  for (size_t k = 0; k < group.chunks.size(); ++k) {
    Chunk& chunk = group.chunks[k];
    ExtendMember& member = *chunk.member;
    ExtendPlan& plan = *member.plan;
    const int i = chunk.step;
    ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
    v1::ExtendResult* result = member.response->mutable_results(i);
    const int64_t expected = member.request->steps(i).expected_length();
    const absl::Status status = ran.ok() ? items[k].status : ran.status();
    if (!status.ok()) {
      if (!ran.ok() && member.status.ok()) member.status = ran.status();
      FailStep(plan, i, status, expected, sessions, result);
      continue;
    }
    plan.info = *ran;
    if (!chunk.maps.empty()) {  // this chunk's rows into the step's maps
      const int64_t length = expected + step.tokens;
      const int64_t chunk_length = items[k].cache->length();
      for (int64_t h = 0; h < config.num_heads; ++h) {
        for (int64_t r = 0; r < chunk.tokens; ++r) {
          const float* from = chunk.maps.data() + (h * chunk.tokens + r) * chunk_length;
          float* to = step.maps->values().data() + (h * step.tokens + step.done + r) * length;
          std::copy(from, from + chunk_length, to);
        }
      }
    }
    if (!chunk.entropy.empty()) {  // and its statistics
      PlaceRows(chunk.entropy, config.num_heads, chunk.tokens, step.done, step.tokens,
                step.entropy->values());
      PlaceRows(chunk.max_weight, config.num_heads, chunk.tokens, step.done, step.tokens,
                step.max_weight->values());
    }
    step.done += chunk.tokens;
    if (step.done < step.tokens) {
      // The pool counts the blocks this chunk took: their reservation goes.
      sessions.NoteAppended(*step.lease);
      continue;
    }
    step.output->Commit();
    if (step.maps != nullptr) step.maps->Commit();
    if (step.entropy != nullptr) {
      step.entropy->Commit();
      step.max_weight->Commit();
    }
    result->set_length(step.lease->cache()->length());
    std::string stored = result->output().SerializeAsString();
    sessions.EndStep(*std::move(step.lease), absl::OkStatus(), std::move(stored));
    ReleaseStep(step);
  }
}

// A member whose steps have all ended (or that failed): the rest of its
// response.
void FinishMember(ExtendMember& member, SessionManager& sessions) {
  ExtendPlan& plan = *member.plan;
  const v1::ExtendRequest& request = *member.request;
  v1::ExtendResponse* response = member.response;
  if (!member.status.ok()) EndExtend(plan, member.status, sessions);
  for (int i = 0; i < static_cast<int>(plan.steps.size()); ++i) {
    ExtendStepPlan& step = plan.steps[static_cast<size_t>(i)];
    v1::ExtendResult* result = response->mutable_results(i);
    if (!step.lease.has_value()) {  // refused, or run
      if (!step.status.ok()) SetStatus(step.status, result);
      continue;
    }
    // A replay: the first answer's output, nothing computed.
    result->set_replayed(true);
    result->set_length(request.steps(i).expected_length() + step.tokens);
    if (!result->mutable_output()->ParseFromString(step.lease->stored_output())) {
      SetStatus(absl::InternalError(absl::StrCat("steps[", i, "]: the stored output is corrupt")),
                result);
    }
    sessions.EndStep(*std::move(step.lease), absl::OkStatus(), "");
    step.lease.reset();
  }
  response->set_kernel_path(plan.info.kernel_path);
  response->set_precision(plan.info.precision == core::Precision::kBf16 ? v1::PRECISION_BF16
                                                                        : v1::PRECISION_FP32);
  member.finished = true;
}

}  // namespace

int64_t PrefillChunkTokens(int64_t chunk_tokens, int64_t keys_before, int64_t d_model,
                           int64_t q_width, int64_t kv_width) {
  // A token's projections (Q, K, V and output: 2 d_model (2 q_width +
  // 2 kv_width) flops) cost as much as attending to this many keys (QK^T and
  // PV: 4 q_width flops a key).
  const double projection_keys = static_cast<double>(d_model) *
                                 static_cast<double>(q_width + kv_width) /
                                 static_cast<double>(std::max<int64_t>(q_width, 1));
  // The work of a chunk of chunk_tokens at the start of a sequence (keys:
  // its own tokens), in (token, key) pairs.
  const auto chunk = static_cast<double>(chunk_tokens);
  const double work = chunk * (chunk + projection_keys);
  // The largest t with t (keys_before + t + projection_keys) <= work: the
  // root of the quadratic, then settled to the integer exactly (the root's
  // rounding may be one off).
  auto fits = [&](int64_t t) {
    return static_cast<double>(t) * (static_cast<double>(keys_before + t) + projection_keys) <=
           work;
  };
  const double b = static_cast<double>(keys_before) + projection_keys;
  auto tokens = static_cast<int64_t>((std::sqrt(b * b + 4 * work) - b) / 2);
  tokens = std::clamp<int64_t>(tokens, 0, chunk_tokens);
  while (tokens < chunk_tokens && fits(tokens + 1)) ++tokens;
  while (tokens > 0 && !fits(tokens)) --tokens;
  return std::max(tokens, std::max<int64_t>(1, chunk_tokens / kMinChunkFraction));
}

int64_t RoundTokens(const ExtendPlan& plan) {
  int64_t tokens = 0;
  for (const ExtendStepPlan& step : plan.steps) {
    if (Pending(step)) tokens += NextChunk(plan, step);
  }
  return tokens;
}

void EndExtend(ExtendPlan& plan, const absl::Status& status, SessionManager& sessions) {
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    ExtendStepPlan& step = plan.steps[i];
    if (!Pending(step)) continue;
    // Where the step began: its first position less the session's, as the
    // lease's cache held it then, is the tokens computed before it.
    FailStep(plan, static_cast<int>(i), status,
             step.lease->cache()->length() - step.done, sessions, nullptr);
  }
  // Replays and refusals hold nothing to undo.
  plan.steps.clear();
}

void RunExtendRound(absl::Span<ExtendMember> members, SessionManager& sessions,
                    const ComputeContext& compute, std::vector<ExtendComputed>* computed) {
  for (ExtendMember& member : members) {
    member.tokens = 0;
    ExtendPlan& plan = *member.plan;
    if (member.finished || plan.started) continue;
    plan.started = true;
    member.response->clear_results();
    for (size_t i = 0; i < plan.steps.size(); ++i) member.response->add_results();
  }
  for (ChunkGroup& group : GroupChunks(members)) RunGroup(group, sessions, compute, computed);
  for (ExtendMember& member : members) {
    if (member.finished) continue;
    if (member.status.ok() && RoundTokens(*member.plan) > 0) continue;  // more chunks
    FinishMember(member, sessions);
  }
}

absl::Status RunExtend(const v1::ExtendRequest& request, ExtendPlan& plan,
                       SessionManager& sessions, const ComputeContext& compute,
                       v1::ExtendResponse* response, std::vector<ExtendComputed>* computed) {
  ExtendMember member;
  member.request = &request;
  member.plan = &plan;
  member.response = response;
  member.should_stop = compute.should_stop;
  while (!member.finished) {
    RunExtendRound(absl::MakeSpan(&member, 1), sessions, compute, computed);
  }
  return member.status;
}

}  // namespace attnserve::server
