#include "core/attention_core.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/forward_common.h"
#include "core/head_staging.h"
#include "core/kernels/blocked_sdpa.h"
#include "core/kernels/materialized_sdpa.h"
#include "core/route.h"
#include "core/status_macros.h"
#include "core/validation.h"

namespace attnserve::core {
namespace {

using internal::SdpaCall;
using internal::WorkspaceState;

// A core input's lengths: empty (all `len`) or [batch] values in [1, len].
absl::StatusOr<std::vector<int64_t>> CoreLengths(absl::string_view field,
                                                 absl::Span<const int64_t> lengths, int64_t batch,
                                                 absl::string_view len_name, int64_t len) {
  if (lengths.empty()) return std::vector<int64_t>(static_cast<size_t>(batch), len);
  if (static_cast<int64_t>(lengths.size()) != batch) {
    return InvalidField(field, absl::StrCat(lengths.size(), " lengths for a batch of ", batch));
  }
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1 || lengths[b] > len) {
      return InvalidField(absl::StrCat(field, "[", b, "]"),
                          absl::StrCat(lengths[b], " is outside [1, ", len_name, " ", len, "]"));
    }
  }
  return std::vector<int64_t>(lengths.begin(), lengths.end());
}

// Checks the inputs' sizes and returns the queries' and keys' layouts.
absl::StatusOr<std::pair<SequenceLayout, SequenceLayout>> ValidateCoreInputs(
    const HeadConfig& config, const CoreInputs& inputs, const ForwardOutputs& outputs) {
  const struct {
    absl::string_view field;
    int64_t value;
  } dims[] = {{"batch", inputs.batch}, {"q_len", inputs.q_len}, {"kv_len", inputs.kv_len}};
  for (const auto& dim : dims) {
    if (dim.value < 1) {
      return InvalidField(dim.field, absl::StrCat("must be at least 1, got ", dim.value));
    }
  }
  const int64_t hd = config.head_dim;
  for (const auto& [field, size] : {std::pair<absl::string_view, size_t>{"q", inputs.q.size()},
                                    {"output", outputs.output.size()}}) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(field, size,
                                        {{"batch", inputs.batch},
                                         {"num_heads", config.num_heads},
                                         {"q_len", inputs.q_len},
                                         {"head_dim", hd}}));
  }
  for (const auto& [field, span] :
       {std::pair<absl::string_view, absl::Span<const float>>{"k", inputs.k}, {"v", inputs.v}}) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(field, span.size(),
                                        {{"batch", inputs.batch},
                                         {"num_kv_heads", config.num_kv_heads},
                                         {"kv_len", inputs.kv_len},
                                         {"head_dim", hd}}));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      std::vector<int64_t> q_lengths,
      CoreLengths("q_lengths", inputs.q_lengths, inputs.batch, "q_len", inputs.q_len));
  ATTNSERVE_ASSIGN_OR_RETURN(
      std::vector<int64_t> kv_lengths,
      CoreLengths("kv_lengths", inputs.kv_lengths, inputs.batch, "kv_len", inputs.kv_len));
  ATTNSERVE_ASSIGN_OR_RETURN(
      SequenceLayout queries,
      SequenceLayout::Padded(inputs.batch, inputs.q_len, std::move(q_lengths)));
  ATTNSERVE_ASSIGN_OR_RETURN(
      SequenceLayout keys, SequenceLayout::Padded(inputs.batch, inputs.kv_len, std::move(kv_lengths)));
  return std::make_pair(std::move(queries), std::move(keys));
}

}  // namespace

absl::StatusOr<ForwardInfo> AttentionCore::Run(const CoreInputs& inputs,
                                               const ForwardOptions& options,
                                               ForwardOutputs outputs,
                                               Workspace* workspace) const {
  ATTNSERVE_ASSIGN_OR_RETURN(const auto layouts, ValidateCoreInputs(config_, inputs, outputs));
  const auto& [queries, keys] = layouts;
  ATTNSERVE_RETURN_IF_ERROR(ValidateForwardOptions(config_, queries, options));
  ATTNSERVE_RETURN_IF_ERROR(ValidateMask(inputs.mask, inputs.batch, inputs.q_len, inputs.kv_len));
  ATTNSERVE_RETURN_IF_ERROR(ValidateHeadMask(inputs.head_mask, config_.num_heads));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateAttentionOutputs(config_, queries, keys, options, outputs, /*layer=*/false));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateFinite(inputs.q, queries, config_.num_heads, config_.head_dim, "q"));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateFinite(inputs.k, keys, config_.num_kv_heads, config_.head_dim, "k"));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateFinite(inputs.v, keys, config_.num_kv_heads, config_.head_dim, "v"));
  return internal::RunInWorkspace(
      workspace, "running scaled dot-product attention", [&](WorkspaceState& state) {
        return RunOn(inputs, queries, keys, options, outputs, state);
      });
}

absl::StatusOr<ForwardInfo> AttentionCore::RunOn(const CoreInputs& inputs,
                                                 const SequenceLayout& queries,
                                                 const SequenceLayout& keys,
                                                 const ForwardOptions& options,
                                                 ForwardOutputs outputs,
                                                 WorkspaceState& workspace) const {
  if (internal::ShouldStop(options, workspace)) return internal::Cancelled();
  ATTNSERVE_ASSIGN_OR_RETURN(
      const internal::RoutedCall routed,
      internal::RouteCall(config_,
                          {.queries = queries,
                           .keys = keys,
                           .projected_inputs = true,
                           .causal = inputs.causal,
                           .mask = inputs.mask.kind},
                          inputs.mask, inputs.head_mask, options, outputs, workspace));
  const Route& route = routed.route;
  const SdpaCall& call = routed.call;
  const int64_t hd = config_.head_dim;
  const int64_t q_block = config_.num_heads * call.q_len * hd;
  const int64_t kv_block = config_.num_kv_heads * call.kv_len * hd;
  for (int64_t first = 0; first < call.batch; first += route.chunk) {
    if (internal::ShouldStop(options, workspace)) return internal::Cancelled();
    const int64_t n = std::min(route.chunk, call.batch - first);
    const void* q = inputs.q.data() + first * q_block;
    const void* k = inputs.k.data() + first * kv_block;
    const void* v = inputs.v.data() + first * kv_block;
    if (route.staged) {
      if (route.bf16()) {
        Stage<Bf16>(inputs, call, first, n, workspace);
      } else {
        Stage<float>(inputs, call, first, n, workspace);
      }
      q = workspace.buffer(Scratch::kQStage).data();
      k = workspace.buffer(Scratch::kKStage).data();
      v = workspace.buffer(Scratch::kVStage).data();
    }
    float* const context = outputs.output.data() + first * q_block;
    if (route.blocked) {
      internal::BlockedOperands operands;
      operands.q = internal::DenseHeadRows(q, n, config_.num_heads, call.q_len, hd);
      operands.k = internal::DenseHeadRows(k, n, config_.num_kv_heads, call.kv_len, hd);
      operands.v = internal::DenseHeadRows(v, n, config_.num_kv_heads, call.kv_len, hd);
      operands.context = internal::DenseHeadRows(context, n, config_.num_heads, call.q_len, hd);
      ATTNSERVE_RETURN_IF_ERROR(internal::BlockedSdpaFor(route.own_block_kernels)
                                    .Run(config_, call, first, n, operands, workspace));
    } else {
      ATTNSERVE_RETURN_IF_ERROR(
          internal::MaterializedSdpa(config_, call, first, n, q, k, v, context, workspace));
    }
  }
  workspace.stream.wait();
  return internal::MakeInfo(route);
}

template <typename T>
void AttentionCore::Stage(const CoreInputs& inputs, const SdpaCall& call, int64_t first, int64_t n,
                          WorkspaceState& workspace) const {
  const int64_t hd = config_.head_dim;
  auto stage = [&](absl::Span<const float> from, int64_t heads, int64_t len,
                   const std::vector<int64_t>& lengths, Scratch to) {
    internal::StageHeads(
        n, heads, len, hd, /*half=*/0,
        [&](int64_t c, int64_t h, int64_t pos) {
          internal::HeadRow row;
          const int64_t b = first + c;
          if (pos < lengths[b]) row.values = from.data() + ((b * heads + h) * len + pos) * hd;
          return row;
        },
        workspace.data<T>(to));
  };
  stage(inputs.q, config_.num_heads, call.q_len, call.q_lengths, Scratch::kQStage);
  stage(inputs.k, config_.num_kv_heads, call.kv_len, call.kv_lengths, Scratch::kKStage);
  stage(inputs.v, config_.num_kv_heads, call.kv_len, call.kv_lengths, Scratch::kVStage);
}

absl::StatusOr<std::unique_ptr<AttentionCore>> AttentionCore::Create(const HeadConfig& config) {
  HeadConfig to_resolve = config;
  // d_model is not used: without one, take the heads' width.
  if (to_resolve.d_model == 0 && to_resolve.head_dim > 0 && to_resolve.num_heads > 0 &&
      to_resolve.head_dim <= kMaxHeadDim && to_resolve.num_heads <= kMaxHeads) {
    to_resolve.d_model = std::min(kMaxDModel, to_resolve.num_heads * to_resolve.head_dim);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const HeadConfig resolved, ResolveHeadConfig(to_resolve));
  return std::unique_ptr<AttentionCore>(new AttentionCore(resolved));
}

AttentionCore::~AttentionCore() = default;

}  // namespace attnserve::core
