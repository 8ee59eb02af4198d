#include "core/attention_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/attention_layer_impl.h"
#include "core/attention_weights.h"
#include "core/checked_math.h"
#include "core/fork_grain.h"
#include "core/forward_common.h"
#include "core/head_config.h"
#include "core/head_contributions.h"
#include "core/head_staging.h"
#include "core/kernels/blocked_sdpa.h"
#include "core/kernels/materialized_sdpa.h"
#include "core/kernels/primitives.h"
#include "core/route.h"
#include "core/status_macros.h"
#include "core/validation.h"

// The layer, with R query rows and Rc key/value rows (Rc = R in
// self-attention) in their layouts' token-major order:
//
//  1. projections over all rows (padding rows too: they are never read).
//     When context_dim == d_model, W_qkv = [W_q | W_k | W_v] is fused once
//     ([d_model, N], N = (Hq + 2 Hkv) hd):
//       self-attention:  QKV [R, N] = X W_qkv + b_qkv              one matmul
//       cross-attention: Q [R, Hq hd] = X W_qkv[:, Q] + b_q and
//                        KV [Rc, 2 Hkv hd] = C W_qkv[:, K|V] + b_kv  two matmuls,
//       reading column blocks of W_qkv through strides (no second copy of the
//       weights; oneDNN runs them on gemm:jit, as fast as brg here).
//     Otherwise (cross-attention only: the context is context_dim wide) W_q
//     [d_model, Hq hd] and W_kv = [W_k | W_v] [context_dim, 2 Hkv hd] are kept
//     apart, dense, and the same two matmuls read them (on brg).
//  2. per chunk of sequences (the attention's scores are materialized, so their
//     size bounds the chunk):
//       stage Q, K, V head-major and padded, [n, H, max_length, hd]: rows past
//       a sequence's length are 0; RoPE is applied on the way; BF16 converted
//       here.
//       SDPA (core/kernels/) -> context heads [n, Hq, S, hd].
//       head contributions; concatenate the heads into token-major rows.
//  3. out [R, d_model] = context W_o + b_o; padding rows set to 0.
//
// Ragged batches (padded with short lengths, or packed) run padded to the
// longest sequence with a key-padding mask: one set of primitives per
// (chunk, S, T) however the lengths vary, and batched matmuls over the chunk.
// The price is the padding's share of the attention FLOPs; the projections
// never see packing padding.

namespace attnserve::core {
namespace {

using internal::SdpaCall;
using internal::WorkspaceState;

// [rows, parts[0] | parts[1] | ...]: row r of the result is row r of each
// part ([rows, widths[i]]) in turn.
std::vector<float> FuseColumns(
    std::initializer_list<const std::vector<float>*> parts, int64_t rows,
    std::initializer_list<int64_t> widths) {
  int64_t total = 0;
  for (int64_t width : widths) total += width;
  std::vector<float> fused(static_cast<size_t>(rows * total));
  for (int64_t r = 0; r < rows; ++r) {
    float* out = fused.data() + r * total;
    auto width = widths.begin();
    for (const std::vector<float>* part : parts) {
      out = std::copy_n(part->data() + r * *width, *width, out);
      ++width;
    }
  }
  return fused;
}

}  // namespace

AttentionLayer::Impl::Impl(const HeadConfig& config, AttentionWeights weights)
    : config_(config),
      fused_(config.context_dim == config.d_model),
      w_qkv_(fused_ ? FuseColumns({&weights.w_q, &weights.w_k, &weights.w_v}, config.d_model,
                                  {config.q_width(), config.kv_width(), config.kv_width()})
                    : std::vector<float>()),
      w_q_(fused_ ? std::vector<float>() : std::move(weights.w_q)),
      w_kv_(fused_ ? std::vector<float>()
                   : FuseColumns({&weights.w_k, &weights.w_v}, config.context_dim,
                                 {config.kv_width(), config.kv_width()})),
      b_qkv_(FuseColumns({&weights.b_q, &weights.b_k, &weights.b_v}, 1,
                         {config.q_width(), config.kv_width(), config.kv_width()})),
      w_o_(std::move(weights.w_o)),
      b_o_(std::move(weights.b_o)),
      inverse_frequencies_(internal::InverseFrequencies(config.rotary)) {}

absl::Status AttentionLayer::Impl::Validate(const LayerInputs& inputs,
                                            const ForwardOptions& options,
                                            const ForwardOutputs& outputs) const {
  const SequenceLayout& layout = inputs.layout;
  if (layout.batch() < 1) {
    return InvalidField("layout", "no sequences (make it with SequenceLayout::Padded or Packed)");
  }
  const int64_t d = config_.d_model;
  const int64_t context_dim = config_.context_dim;
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("hidden_states", inputs.hidden_states.size(),
                                      {{"layout.rows", layout.rows()}, {"d_model", d}}));
  // The projections and the context must fit too.
  const int64_t width = std::max({d, context_dim, config_.q_width() + 2 * config_.kv_width()});
  const std::optional<int64_t> projected = CheckedProduct({layout.rows(), width});
  if (!projected || *projected > kMaxElements) {
    return InvalidField("layout", "too many rows for this layer's projections");
  }

  const SequenceLayout* keys = &layout;
  if (inputs.context_layout.has_value()) {
    keys = &*inputs.context_layout;
    if (keys->batch() != layout.batch()) {
      return InvalidField(
          "context_layout",
          absl::StrCat("batch ", keys->batch(), " does not match layout's batch ", layout.batch()));
    }
    ATTNSERVE_RETURN_IF_ERROR(
        CheckSize("context", inputs.context.size(),
                  {{"context_layout.rows", keys->rows()}, {"context_dim", context_dim}}));
    const std::optional<int64_t> kv_size = CheckedProduct({keys->rows(), width});
    if (!kv_size || *kv_size > kMaxElements) {
      return InvalidField("context_layout", "too many rows for this layer's projections");
    }
  } else if (!inputs.context.empty()) {
    return InvalidField("context_layout", "required with context (cross-attention)");
  } else if (context_dim != d) {
    return InvalidField("context", absl::StrCat("a layer with context_dim ", context_dim,
                                           " needs context states (self-attention needs "
                                           "context_dim == d_model)"));
  }

  ATTNSERVE_RETURN_IF_ERROR(ValidatePositionOffsets(inputs.position_offsets, layout.batch(),
                                                    config_.rotary.rotary_dim));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize("output", outputs.output.size(), {{"layout.rows", layout.rows()}, {"d_model", d}}));
  ATTNSERVE_RETURN_IF_ERROR(ValidateForwardOptions(config_, layout, options));
  ATTNSERVE_RETURN_IF_ERROR(
      ValidateMask(inputs.mask, layout.batch(), layout.max_length(), keys->max_length()));
  ATTNSERVE_RETURN_IF_ERROR(ValidateHeadMask(inputs.head_mask, config_.num_heads));
  ATTNSERVE_RETURN_IF_ERROR(ValidateAttentionOutputs(config_, layout, *keys, options, outputs,
                                                     /*layer=*/true));
  ATTNSERVE_RETURN_IF_ERROR(ValidateFinite(inputs.hidden_states, layout, 1, d, "hidden_states"));
  if (inputs.context_layout.has_value()) {
    ATTNSERVE_RETURN_IF_ERROR(ValidateFinite(inputs.context, *keys, 1, context_dim, "context"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardInfo> AttentionLayer::Impl::ForwardOn(const LayerInputs& inputs,
                                                            const ForwardOptions& options,
                                                            ForwardOutputs outputs,
                                                            WorkspaceState& workspace) const {
  if (internal::ShouldStop(options, workspace)) return internal::Cancelled();
  const bool cross = inputs.context_layout.has_value();
  const SequenceLayout& keys = cross ? *inputs.context_layout : inputs.layout;
  ATTNSERVE_ASSIGN_OR_RETURN(
      const internal::RoutedCall routed,
      internal::RouteCall(config_,
                          {.queries = inputs.layout,
                           .keys = keys,
                           .cross_attention = cross,
                           .causal = inputs.causal,
                           .mask = inputs.mask.kind},
                          inputs.mask, inputs.head_mask, options, outputs, workspace));
  const Route& route = routed.route;
  Pass pass{inputs, keys, cross, route, routed.call, workspace, {}, {}};
  ATTNSERVE_RETURN_IF_ERROR(Project(pass));
  ATTNSERVE_RETURN_IF_ERROR(Attend(pass, options, outputs.head_contribution));
  if (internal::ShouldStop(options, workspace)) return internal::Cancelled();
  ATTNSERVE_RETURN_IF_ERROR(ProjectOutput(pass, outputs.output));
  return internal::MakeInfo(route);
}

absl::Status AttentionLayer::Impl::Project(Pass& pass) const {
  const LayerInputs& inputs = pass.inputs;
  const SequenceLayout& layout = inputs.layout;
  WorkspaceState& workspace = pass.workspace;
  const bool bf16 = pass.route.bf16();
  const bool cross = pass.cross;
  const int64_t d = config_.d_model;
  const int64_t context_dim = config_.context_dim;  // == d in self-attention (validated)
  const int64_t q_width = config_.q_width();
  const int64_t kv_width = 2 * config_.kv_width();
  const int64_t n_width = q_width + kv_width;  // N
  const int64_t rows = layout.rows();
  const int64_t kv_rows = pass.keys.rows();
  // Where the projections are read in place, the matmul writes the operand type.
  const bool projected_bf16 = pass.route.projections_bf16;
  const int64_t projected_element = projected_bf16 ? sizeof(Bf16) : sizeof(float);

  const void* x = inputs.hidden_states.data();
  const void* c = cross ? inputs.context.data() : x;
  if (bf16) {
    Bf16* const x_bf16 = workspace.data<Bf16>(Scratch::kInputsBf16);
    internal::ConvertToBf16(inputs.hidden_states.data(), rows * d, x_bf16);
    x = c = x_bf16;
    if (cross) {
      Bf16* const c_bf16 = workspace.data<Bf16>(Scratch::kContextBf16);
      internal::ConvertToBf16(inputs.context.data(), kv_rows * context_dim, c_bf16);
      c = c_bf16;
    }
  }
  const InputWeights w_in = GetInputWeights(bf16);
  char* const projected = workspace.data<char>(Scratch::kProjections);
  Projected* const qkv = pass.qkv;
  if (cross) {
    const int64_t q_stride = ProjectionRowStride(q_width, projected_element);
    const int64_t kv_stride = ProjectionRowStride(kv_width, projected_element);
    const int64_t kv = rows * q_stride;
    ATTNSERVE_RETURN_IF_ERROR(internal::Linear(workspace, rows, d, q_width, w_in.q_stride, bf16, x,
                                               w_in.q, b_qkv_.data(), projected, q_stride,
                                               projected_bf16));
    ATTNSERVE_RETURN_IF_ERROR(internal::Linear(
        workspace, kv_rows, context_dim, kv_width, w_in.kv_stride, bf16, c, w_in.kv,
        b_qkv_.data() + q_width, projected + kv * projected_element, kv_stride, projected_bf16));
    qkv[0] = {0, q_stride};
    qkv[1] = {kv, kv_stride};
    qkv[2] = {kv + config_.kv_width(), kv_stride};
  } else {
    // Fused (Validate checked context_dim == d_model).
    const int64_t stride = ProjectionRowStride(n_width, projected_element);
    ATTNSERVE_RETURN_IF_ERROR(
        ProjectQkv(workspace, rows, bf16, x, projected, stride, projected_bf16));
    qkv[0] = {0, stride};
    qkv[1] = {q_width, stride};
    qkv[2] = {q_width + config_.kv_width(), stride};
  }
  if (config_.rotary.rotary_dim > 0) {
    // Queries at position_offsets[b] + i. Keys: the same positions in
    // self-attention; the context's own positions from 0 in cross-attention.
    const int64_t half = config_.rotary.rotary_dim / 2;
    float* const tables = workspace.data<float>(Scratch::kRotary);
    Rotary& rotary = pass.rotary;
    float* const q_cos = tables;
    float* const q_sin = q_cos + rows * half;
    internal::RotaryTables(layout, inputs.position_offsets, inverse_frequencies_, q_cos, q_sin);
    rotary = {q_cos, q_sin, q_cos, q_sin};
    if (cross) {
      float* const k_cos = q_sin + rows * half;
      float* const k_sin = k_cos + kv_rows * half;
      internal::RotaryTables(pass.keys, {}, inverse_frequencies_, k_cos, k_sin);
      rotary.k_cos = k_cos;
      rotary.k_sin = k_sin;
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionLayer::Impl::Attend(const Pass& pass, const ForwardOptions& options,
                                          absl::Span<float> head_contribution) const {
  const Route& route = pass.route;
  const SdpaCall& call = pass.call;
  WorkspaceState& workspace = pass.workspace;
  const SequenceLayout& layout = pass.inputs.layout;
  const int64_t hd = config_.head_dim;
  const int64_t projected_element = route.projections_bf16 ? sizeof(Bf16) : sizeof(float);
  char* const projected = workspace.data<char>(Scratch::kProjections);
  for (int64_t first = 0; first < call.batch; first += route.chunk) {
    if (internal::ShouldStop(options, workspace)) return internal::Cancelled();
    const int64_t n = std::min(route.chunk, call.batch - first);
    if (route.staged) {
      if (route.bf16()) {
        Stage<Bf16>(pass, first, n);
      } else {
        Stage<float>(pass, first, n);
      }
    }
    if (route.blocked) {
      auto projected_rows = [&](const Projected& part, const SequenceLayout& of) {
        return internal::TokenHeadRows(projected + part.offset * projected_element, part.stride,
                                       hd, of, first, n);
      };
      auto staged_rows = [&](Scratch stage, int64_t heads, int64_t len) {
        return internal::DenseHeadRows(workspace.buffer(stage).data(), n, heads, len, hd);
      };
      internal::BlockedOperands operands;
      if (route.staged) {
        operands.q = staged_rows(Scratch::kQStage, config_.num_heads, call.q_len);
        operands.k = staged_rows(Scratch::kKStage, config_.num_kv_heads, call.kv_len);
        operands.v = staged_rows(Scratch::kVStage, config_.num_kv_heads, call.kv_len);
      } else {
        operands.q = projected_rows(pass.qkv[0], layout);
        operands.k = projected_rows(pass.qkv[1], pass.keys);
        operands.v = projected_rows(pass.qkv[2], pass.keys);
      }
      operands.context = internal::TokenHeadRows(workspace.buffer(Scratch::kContextTokens).data(),
                                                 config_.q_width(), hd, layout, first, n);
      operands.context_bf16 = route.bf16();
      operands.zero_rows_past_length = false;
      ATTNSERVE_RETURN_IF_ERROR(internal::BlockedSdpaFor(route.own_block_kernels)
                                    .Run(config_, call, first, n, operands, workspace));
      continue;
    }
    ATTNSERVE_RETURN_IF_ERROR(internal::MaterializedSdpa(
        config_, call, first, n, workspace.buffer(Scratch::kQStage).data(),
        workspace.buffer(Scratch::kKStage).data(), workspace.buffer(Scratch::kVStage).data(),
        workspace.data<float>(Scratch::kContextHeads), workspace));
    if (options.head_statistics) Contributions(pass, first, n, head_contribution);
    if (route.bf16()) {
      ConcatHeads<Bf16>(pass, first, n);
    } else {
      ConcatHeads<float>(pass, first, n);
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionLayer::Impl::ProjectOutput(const Pass& pass, absl::Span<float> output) const {
  const SequenceLayout& layout = pass.inputs.layout;
  WorkspaceState& workspace = pass.workspace;
  const bool bf16 = pass.route.bf16();
  const int64_t d = config_.d_model;
  const int64_t q_width = config_.q_width();
  const int64_t element = bf16 ? sizeof(Bf16) : sizeof(float);
  char* const context_tokens = workspace.data<char>(Scratch::kContextTokens);
  std::vector<std::pair<int64_t, int64_t>> padding;  // [begin, end) rows
  if (layout.is_padded()) {
    for (int64_t b = 0; b < layout.batch(); ++b) {
      if (layout.length(b) < layout.max_length()) {
        padding.emplace_back(layout.row_offset(b) + layout.length(b),
                             layout.row_offset(b) + layout.max_length());
      }
    }
  }
  for (const auto& [begin, end] : padding) {
    std::memset(context_tokens + begin * q_width * element, 0,
                static_cast<size_t>((end - begin) * q_width * element));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      ProjectContext(workspace, layout.rows(), bf16, context_tokens, output.data()));
  workspace.stream.wait();
  for (const auto& [begin, end] : padding) {
    std::fill(output.begin() + begin * d, output.begin() + end * d, 0.0f);
  }
  return absl::OkStatus();
}

absl::Status AttentionLayer::Impl::ProjectQkv(WorkspaceState& workspace, int64_t rows, bool bf16,
                                              const void* x, void* qkv, int64_t qkv_stride,
                                              bool qkv_bf16) const {
  const int64_t n_width = config_.q_width() + 2 * config_.kv_width();
  const InputWeights w_in = GetInputWeights(bf16);
  return internal::Linear(workspace, rows, config_.d_model, n_width, n_width, bf16, x, w_in.q,
                          b_qkv_.data(), qkv, qkv_stride, qkv_bf16);
}

absl::Status AttentionLayer::Impl::ProjectContext(WorkspaceState& workspace, int64_t rows,
                                                  bool bf16, const void* context,
                                                  float* out) const {
  if (bf16) MakeBf16Weights();
  const void* const w_o = bf16 ? static_cast<const void*>(w_o_bf16_.data()) : w_o_.data();
  return internal::Linear(workspace, rows, config_.q_width(), config_.d_model, config_.d_model,
                          bf16, context, w_o, b_o_.data(), out, config_.d_model, /*y_bf16=*/false);
}

template <typename T>
void AttentionLayer::Impl::Stage(const Pass& pass, int64_t first, int64_t n) const {
  const SequenceLayout& layout = pass.inputs.layout;
  const SequenceLayout& keys = pass.keys;
  const SdpaCall& call = pass.call;
  const Projected (&qkv)[3] = pass.qkv;
  const float* const projected = pass.workspace.data<float>(Scratch::kProjections);
  const int64_t hd = config_.head_dim;
  const int64_t half = config_.rotary.rotary_dim / 2;
  const Rotary& rotary = pass.rotary;

  internal::StageHeads(
      n, config_.num_heads, call.q_len, hd, half,
      [&](int64_t c, int64_t h, int64_t pos) {
        const int64_t b = first + c;
        internal::HeadRow row;
        if (pos >= layout.length(b)) return row;
        const int64_t r = layout.row_offset(b) + pos;
        row.values = projected + qkv[0].offset + r * qkv[0].stride + h * hd;
        if (half > 0) {
          row.cos = rotary.q_cos + r * half;
          row.sin = rotary.q_sin + r * half;
        }
        return row;
      },
      pass.workspace.data<T>(Scratch::kQStage));
  for (int which = 0; which < 2; ++which) {  // K, then V
    const bool rotate = which == 0 && half > 0;
    internal::StageHeads(
        n, config_.num_kv_heads, call.kv_len, hd, rotate ? half : 0,
        [&](int64_t c, int64_t g, int64_t pos) {
          const int64_t b = first + c;
          internal::HeadRow row;
          if (pos >= keys.length(b)) return row;
          const int64_t r = keys.row_offset(b) + pos;
          row.values = projected + qkv[1 + which].offset + r * qkv[1 + which].stride + g * hd;
          if (rotate) {
            row.cos = rotary.k_cos + r * half;
            row.sin = rotary.k_sin + r * half;
          }
          return row;
        },
        pass.workspace.data<T>(which == 0 ? Scratch::kKStage : Scratch::kVStage));
  }
}

template <typename T>
void AttentionLayer::Impl::ConcatHeads(const Pass& pass, int64_t first, int64_t n) const {
  const SequenceLayout& layout = pass.inputs.layout;
  const SdpaCall& call = pass.call;
  const int64_t heads = config_.num_heads;
  const int64_t hd = config_.head_dim;
  const int64_t s = call.q_len;
  const int64_t q_width = config_.q_width();
  const float* const context = pass.workspace.data<float>(Scratch::kContextHeads);
  T* const out = pass.workspace.data<T>(Scratch::kContextTokens);
#pragma omp parallel for schedule(static) if (n * s * q_width > internal::kCopyForkGrain)
  for (int64_t item = 0; item < n * s; ++item) {
    const int64_t c = item / s;
    const int64_t pos = item % s;
    const int64_t b = first + c;
    if (pos >= layout.length(b)) continue;
    T* const row = out + (layout.row_offset(b) + pos) * q_width;
    for (int64_t h = 0; h < heads; ++h) {
      internal::Store(context + ((c * heads + h) * s + pos) * hd, hd, row + h * hd);
    }
  }
}

void AttentionLayer::Impl::Contributions(const Pass& pass, int64_t first, int64_t n,
                                         absl::Span<float> out) const {
  const bool use_gram = config_.head_dim <= config_.d_model;
  if (use_gram) {
    absl::call_once(gram_once_, [this] { w_o_gram_ = internal::OutputGram(config_, w_o_); });
  }
  internal::HeadContributions(config_, pass.call, first, n,
                              pass.workspace.data<float>(Scratch::kContextHeads),
                              use_gram ? &w_o_gram_ : nullptr, w_o_, out);
}

void AttentionLayer::Impl::MakeBf16Weights() const {
  absl::call_once(bf16_once_, [this] {
    auto convert = [](const std::vector<float>& from, std::vector<Bf16>& to) {
      to.resize(from.size());
      internal::ConvertToBf16(from.data(), static_cast<int64_t>(from.size()), to.data());
    };
    convert(w_qkv_, w_qkv_bf16_);
    convert(w_q_, w_q_bf16_);
    convert(w_kv_, w_kv_bf16_);
    convert(w_o_, w_o_bf16_);
  });
}

AttentionLayer::Impl::InputWeights AttentionLayer::Impl::GetInputWeights(bool bf16) const {
  if (bf16) MakeBf16Weights();
  const int64_t q_width = config_.q_width();
  const int64_t kv_width = 2 * config_.kv_width();
  InputWeights w;
  if (fused_) {
    const int64_t n_width = q_width + kv_width;
    w.q = bf16 ? static_cast<const void*>(w_qkv_bf16_.data()) : w_qkv_.data();
    w.q_stride = n_width;
    w.kv = bf16 ? static_cast<const void*>(w_qkv_bf16_.data() + q_width) : w_qkv_.data() + q_width;
    w.kv_stride = n_width;
  } else {
    w.q = bf16 ? static_cast<const void*>(w_q_bf16_.data()) : w_q_.data();
    w.q_stride = q_width;
    w.kv = bf16 ? static_cast<const void*>(w_kv_bf16_.data()) : w_kv_.data();
    w.kv_stride = kv_width;
  }
  return w;
}

absl::StatusOr<std::unique_ptr<AttentionLayer>> AttentionLayer::Create(const HeadConfig& config,
                                                                       AttentionWeights weights) {
  ATTNSERVE_ASSIGN_OR_RETURN(const HeadConfig resolved, ResolveHeadConfig(config));
  ATTNSERVE_RETURN_IF_ERROR(ValidateWeights(resolved, weights));
  try {
    return std::unique_ptr<AttentionLayer>(
        new AttentionLayer(std::make_unique<Impl>(resolved, std::move(weights))));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory creating an attention layer");
  }
}

AttentionLayer::AttentionLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AttentionLayer::~AttentionLayer() = default;

const HeadConfig& AttentionLayer::config() const { return impl_->config(); }

absl::StatusOr<ForwardInfo> AttentionLayer::Forward(const LayerInputs& inputs,
                                                    const ForwardOptions& options,
                                                    ForwardOutputs outputs,
                                                    Workspace* workspace) const {
  ATTNSERVE_RETURN_IF_ERROR(impl_->Validate(inputs, options, outputs));
  return internal::RunInWorkspace(
      workspace, "running the attention layer", [&](WorkspaceState& state) {
        return impl_->ForwardOn(inputs, options, outputs, state);
      });
}

absl::StatusOr<ForwardInfo> AttentionLayer::Extend(absl::Span<ExtendItem> items,
                                                   const ExtendOptions& options,
                                                   Workspace* workspace) const {
  return impl_->Extend(items, options, workspace);
}

}  // namespace attnserve::core
