#include "server/api/attend_runner.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/status_macros.h"
#include "server/api/tensor_codec.h"

namespace attnserve::server {
namespace {

std::vector<int64_t> Lengths(const core::SequenceLayout& layout) {
  std::vector<int64_t> lengths(layout.batch());
  for (int64_t b = 0; b < layout.batch(); ++b) lengths[b] = layout.length(b);
  return lengths;
}

// The ad-hoc layer's weights from the request's inline tensors.
core::AttentionWeights InlineWeights(const v1::LayerWeights& wire, const AdHocLayer& adhoc) {
  const v1::Tensor* tensors[] = {&wire.w_q(), &wire.b_q(), &wire.w_k(), &wire.b_k(),
                                 &wire.w_v(), &wire.b_v(), &wire.w_o(), &wire.b_o()};
  core::AttentionWeights weights;
  std::vector<float>* fields[] = {&weights.w_q, &weights.b_q, &weights.w_k, &weights.b_k,
                                  &weights.w_v, &weights.b_v, &weights.w_o, &weights.b_o};
  for (size_t i = 0; i < 8; ++i) {
    FloatValues values(*tensors[i], adhoc.inline_weights[i]);
    fields[i]->assign(values.values().begin(), values.values().end());
  }
  return weights;
}

absl::StatusOr<std::shared_ptr<core::AttentionLayer>> LayerFor(const v1::AttendRequest& request,
                                                               const AttendPlan& plan,
                                                               LayerCache& cache) {
  if (plan.model != nullptr) {
    // Shares the model's lifetime: the plan holds the model.
    return std::shared_ptr<core::AttentionLayer>(plan.model, plan.model->layer.get());
  }
  if (plan.adhoc->seed.has_value()) return cache.SeededLayer(plan.config, *plan.adhoc->seed);
  ATTNSERVE_ASSIGN_OR_RETURN(
      std::unique_ptr<core::AttentionLayer> layer,
      core::AttentionLayer::Create(plan.config, InlineWeights(request.layer().inline_weights(), *plan.adhoc)));
  return std::shared_ptr<core::AttentionLayer>(std::move(layer));
}

// The response's record of what ran: the model, the precision and the path.
void SetHowItRan(const core::ForwardInfo& info, const AttendPlan& plan,
                 v1::AttendResponse* response) {
  response->set_kernel_path(info.kernel_path);
  response->set_precision(info.precision == core::Precision::kBf16 ? v1::PRECISION_BF16
                                                                    : v1::PRECISION_FP32);
  response->set_model(plan.model != nullptr ? plan.model->name : "");
}

}  // namespace

absl::StatusOr<core::ForwardInfo> RunAttendPlan(const v1::AttendRequest& request,
                                                const AttendPlan& plan, LayerCache& cache,
                                                const ComputeContext& compute,
                                                WireResponse* wire) {
  v1::AttendResponse* response = &wire->message;
  core::ForwardOptions options = ForwardOptionsFor(plan, compute.block_kernels);
  options.should_stop = compute.should_stop;

  // Outputs go straight into the response's buffers.
  OutputTensor output(plan.output_shape, plan.output_dtype, plan.float_data_response,
                      response->mutable_output(), &wire->output_raw);
  std::optional<OutputTensor> maps;
  if (!plan.map_shape.empty()) {
    maps.emplace(plan.map_shape, plan.output_dtype, plan.float_data_response,
                 response->mutable_attention_maps(), &wire->maps_raw);
  }
  // Statistics are a few values per head: their bytes travel in the message.
  std::optional<OutputTensor> entropy, max_weight, contribution;
  if (plan.head_statistics) {
    const int64_t shape[] = {plan.queries.batch(), plan.config.num_heads};
    v1::HeadStatistics* stats = response->mutable_head_statistics();
    entropy.emplace(shape, v1::DATA_TYPE_FP32, false, stats->mutable_entropy(), nullptr);
    max_weight.emplace(shape, v1::DATA_TYPE_FP32, false, stats->mutable_max_weight(), nullptr);
    if (!plan.projected) {
      contribution.emplace(shape, v1::DATA_TYPE_FP32, false, stats->mutable_contribution(),
                           nullptr);
    }
  }
  core::ForwardOutputs outputs;
  outputs.output = output.values();
  if (maps) outputs.attention_maps = maps->values();
  if (entropy) outputs.head_entropy = entropy->values();
  if (max_weight) outputs.head_max_weight = max_weight->values();
  if (contribution) outputs.head_contribution = contribution->values();

  // Inputs: views of the request's bytes where possible.
  std::optional<FloatValues> mask_values;
  core::ExplicitMask mask;
  if (plan.mask.kind != core::ExplicitMask::Kind::kNone) {
    mask_values.emplace(request.mask().values(), plan.mask.values);
    mask.kind = plan.mask.kind;
    mask.values = mask_values->values();
    mask.batch_dim = plan.mask.values.shape[0];
    mask.q_dim = plan.mask.values.shape[1];
    mask.kv_dim = plan.mask.values.shape[2];
  }

  absl::StatusOr<core::ForwardInfo> info;
  if (plan.projected) {
    FloatValues q(request.projected().q(), plan.q), k(request.projected().k(), plan.k),
        v(request.projected().v(), plan.v);
    const std::vector<int64_t> q_lengths = Lengths(plan.queries), kv_lengths = Lengths(plan.keys);
    core::CoreInputs inputs;
    inputs.q = q.values();
    inputs.k = k.values();
    inputs.v = v.values();
    inputs.batch = plan.queries.batch();
    inputs.q_len = plan.queries.max_length();
    inputs.kv_len = plan.keys.max_length();
    inputs.q_lengths = q_lengths;
    inputs.kv_lengths = kv_lengths;
    inputs.causal = plan.causal;
    inputs.mask = mask;
    inputs.head_mask = plan.head_mask;
    ATTNSERVE_ASSIGN_OR_RETURN(std::shared_ptr<core::AttentionCore> attention, cache.Core(plan.config));
    info = attention->Run(inputs, options, outputs, compute.workspace);
  } else {
    FloatValues hidden(request.hidden_states(), plan.hidden_states);
    std::optional<FloatValues> context;
    core::LayerInputs inputs;
    inputs.hidden_states = hidden.values();
    inputs.layout = plan.queries;
    if (plan.context) {
      context.emplace(request.context(), *plan.context);
      inputs.context = context->values();
      inputs.context_layout = plan.keys;
    }
    inputs.causal = plan.causal;
    inputs.mask = mask;
    inputs.head_mask = plan.head_mask;
    inputs.position_offsets = plan.position_offsets;
    ATTNSERVE_ASSIGN_OR_RETURN(std::shared_ptr<core::AttentionLayer> layer,
                               LayerFor(request, plan, cache));
    info = layer->Forward(inputs, options, outputs, compute.workspace);
  }
  if (!info.ok()) return info.status();

  output.Commit();
  if (maps) maps->Commit();
  SetHowItRan(*info, plan, response);
  return info;
}

uint64_t BatchKey(const AttendPlan& plan) {
  if (plan.model == nullptr || plan.projected || plan.context.has_value() ||
      plan.mask.kind != core::ExplicitMask::Kind::kNone || !plan.head_mask.empty() ||
      !plan.position_offsets.empty() || plan.maps.mode != core::AttentionMapMode::kNone ||
      plan.head_statistics) {
    return 0;
  }
  // The plan holds the model, so its address is not reused while the plan
  // lives; user-space addresses leave the top bits free for the flags.
  const auto address = reinterpret_cast<uintptr_t>(plan.model.get());
  return (static_cast<uint64_t>(address) << 2) |
         (plan.precision == core::Precision::kBf16 ? 1u : 0u) | (plan.causal ? 2u : 0u);
}

int64_t BatchCopyBytes(const AttendPlan& plan) {
  if (BatchKey(plan) == 0) return 0;
  int64_t rows = 0;
  for (int64_t b = 0; b < plan.queries.batch(); ++b) rows += plan.queries.length(b);
  // Bounded by the planned (received) hidden states: no overflow.
  return 2 * rows * plan.config.d_model * int64_t{sizeof(float)};
}

void RunAttendBatch(absl::Span<BatchMember> members, LayerCache& cache,
                    const ComputeContext& compute) {
  if (members.empty()) return;
  const AttendPlan& first = *members[0].plan;
  const int64_t d_model = first.config.d_model;

  // The members (PlanAttend checked their values), and where their sequences go.
  std::vector<std::unique_ptr<FloatValues>> values;  // of `members`
  std::vector<int64_t> lengths;
  int64_t rows = 0;
  for (BatchMember& member : members) {
    const AttendPlan& plan = *member.plan;
    values.push_back(
        std::make_unique<FloatValues>(member.request->hidden_states(), plan.hidden_states));
    for (int64_t b = 0; b < plan.queries.batch(); ++b) {
      lengths.push_back(plan.queries.length(b));
      rows += plan.queries.length(b);
    }
  }
  auto fail_all = [members](const absl::Status& status) {
    for (BatchMember& member : members) member.status = status;
  };

  // hidden: [rows, d_model], the valid rows of every sequence back to back.
  std::vector<float> hidden(static_cast<size_t>(rows * d_model));
  int64_t row = 0;
  for (size_t m = 0; m < members.size(); ++m) {
    const AttendPlan& plan = *members[m].plan;
    for (int64_t b = 0; b < plan.queries.batch(); ++b) {
      const int64_t from = plan.queries.is_padded() ? b * plan.queries.max_length()
                                                    : plan.queries.row_offset(b);
      std::copy_n(values[m]->values().data() + from * d_model, plan.queries.length(b) * d_model,
                  hidden.data() + row * d_model);
      row += plan.queries.length(b);
    }
  }
  absl::StatusOr<core::SequenceLayout> layout = core::SequenceLayout::Packed(lengths);
  if (!layout.ok()) return fail_all(layout.status());
  absl::StatusOr<std::shared_ptr<core::AttentionLayer>> layer =
      LayerFor(*members[0].request, *members[0].plan, cache);
  if (!layer.ok()) return fail_all(layer.status());

  core::LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = *std::move(layout);
  inputs.causal = first.causal;
  // (Batched plans ask for no maps and no statistics: BatchKey.)
  core::ForwardOptions options = ForwardOptionsFor(first, compute.block_kernels);
  options.should_stop = compute.should_stop;
  std::vector<float> output(hidden.size());
  core::ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  absl::StatusOr<core::ForwardInfo> info =
      (*layer)->Forward(inputs, options, outputs, compute.workspace);
  if (!info.ok()) return fail_all(info.status());

  // Each member's rows back into its own layout.
  row = 0;
  for (BatchMember& member : members) {
    const AttendPlan& plan = *member.plan;
    v1::AttendResponse* response = &member.response->message;
    OutputTensor out(plan.output_shape, plan.output_dtype, plan.float_data_response,
                     response->mutable_output(), &member.response->output_raw);
    for (int64_t b = 0; b < plan.queries.batch(); ++b) {
      const int64_t to = plan.queries.is_padded() ? b * plan.queries.max_length()
                                                  : plan.queries.row_offset(b);
      const int64_t length = plan.queries.length(b);
      float* const rows = out.values().data() + to * d_model;
      std::copy_n(output.data() + row * d_model, length * d_model, rows);
      // Padding rows are 0, as the core leaves them (the buffer is not zeroed).
      if (plan.queries.is_padded()) {
        std::fill_n(rows + length * d_model, (plan.queries.max_length() - length) * d_model, 0.0f);
      }
      row += length;
    }
    out.Commit();
    SetHowItRan(*info, plan, response);
  }
}

}  // namespace attnserve::server
