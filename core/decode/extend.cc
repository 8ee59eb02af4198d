// The decode route of the attention layer, AttentionLayer::Extend. With R the
// new tokens of the items that run (token-major, item after item):
//
//  1. X [R, d_model]    the items' hidden states gathered (kInputs, or
//                       converted into kInputsBf16)
//  2. QKV [R, N]        = X W_qkv + b_qkv, one matmul (Impl::ProjectQkv, as
//                       Forward's self-attention), FP32 (kProjections)
//  3. Q [R, Hq, hd], K [R, Hkv, hd], V [R, Hkv, hd]  staged token-major
//                       (kQStage...) by StageHeads, RoPE on Q and K at each
//                       token's position (RotaryTables, kRotary)
//  4. K, V appended to each item's cache; an item the pool refuses drops out
//  5. context [R, Hq hd] = PagedAttention of each item's new rows over its
//                       cache (FP32 heads; BF16: converted from kContextHeads)
//  6. out [R, d_model]  = context W_o + b_o, one matmul (Impl::ProjectContext)
//                       into kOutputs, then scattered to the items' outputs
//     and each item's head statistics from its map rows (a scratch map
//     when the item asks for statistics and no map)
//  7. each item's last new row's Q [Hq, hd] kept in its cache (latest_query)
//
// should_stop is polled between the stages; a call that fails after step 4
// truncates every cache it appended to back to its length (AppendRollback).

#include "core/decode/extend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_layer.h"
#include "core/attention_layer_impl.h"
#include "core/bf16.h"
#include "core/checked_math.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "core/decode/paged_attention.h"
#include "core/forward_common.h"
#include "core/head_config.h"
#include "core/head_staging.h"
#include "core/kernels/primitives.h"
#include "core/kernels/row_statistics.h"
#include "core/kernels/workspace_state.h"
#include "core/route.h"
#include "core/status_macros.h"
#include "core/validation.h"

namespace attnserve::core {

namespace internal {

struct ExtendStep {
  // An item that passed validation.
  struct Item {
    ExtendItem* item = nullptr;
    int64_t index = 0;       // in the call's items
    int64_t n = 0;           // new tokens
    int64_t row = 0;         // its first row among the step's R
    int64_t old_length = 0;  // its cache's length before the call
    bool appended = false;   // its K and V are in its cache
  };
  std::vector<Item> items;
  int64_t rows = 0;  // R
  // The new tokens as packed sequences, and their first RoPE positions (for
  // RotaryTables; empty without RoPE).
  SequenceLayout layout;
  std::vector<int64_t> first_positions;
  Route route;
};

}  // namespace internal

namespace {

using internal::ExtendStep;
using internal::WorkspaceState;

// Truncates every cache the step appended to back to its length before the
// call, unless Commit() was called: a call that fails (an error returned, or
// oneDNN's exception unwinding through) leaves every cache as it was.
class AppendRollback {
 public:
  explicit AppendRollback(ExtendStep& step) : step_(step) {}
  ~AppendRollback() {
    if (committed_) return;
    for (ExtendStep::Item& item : step_.items) {
      if (!item.appended) continue;
      // Cannot fail: old_length <= the cache's length.
      item.item->cache->Truncate(item.old_length).IgnoreError();
      item.appended = false;
    }
  }
  AppendRollback(const AppendRollback&) = delete;
  AppendRollback& operator=(const AppendRollback&) = delete;
  void Commit() { committed_ = true; }

 private:
  ExtendStep& step_;
  bool committed_ = false;
};

// The call's own conditions: a self-attention layer, known precision, a
// head mask of num_heads values.
absl::Status ValidateExtendOptions(const HeadConfig& config, const ExtendOptions& options) {
  if (config.context_dim != config.d_model) {
    return InvalidField("context_dim",
                        absl::StrCat("Extend runs self-attention: the layer's context_dim ",
                                     config.context_dim, " must be its d_model ", config.d_model));
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidatePrecision(options.precision, "options.precision"));
  return ValidateHeadMask(options.head_mask, config.num_heads, "options.head_mask");
}

// The cache of items[index]: present, of the layer's KV shape, and no
// earlier item's.
absl::Status ValidateCache(const HeadConfig& config, absl::Span<const ExtendItem> items,
                           size_t index, absl::string_view field) {
  const LayerKvCache* cache = items[index].cache;
  if (cache == nullptr) return InvalidField(field, "must not be null");
  const KvLayout& layout = cache->layout();
  if (layout.num_kv_heads != config.num_kv_heads || layout.head_dim != config.head_dim) {
    return InvalidField(
        field, absl::StrCat("its layout has num_kv_heads ", layout.num_kv_heads, " and head_dim ",
                            layout.head_dim, "; the layer's are ", config.num_kv_heads, " and ",
                            config.head_dim));
  }
  for (size_t j = 0; j < index; ++j) {
    if (items[j].cache == cache) {
      return InvalidField(field, absl::StrCat("the same cache as items[", j,
                                              "] (a cache takes one step per call)"));
    }
  }
  return absl::OkStatus();
}

// items[index] for `config`: every field, before anything runs. Sets *n to
// its new tokens.
absl::Status ValidateExtendItem(const HeadConfig& config, absl::Span<const ExtendItem> items,
                                size_t index, int64_t* n) {
  const ExtendItem& item = items[index];
  const std::string field = absl::StrCat("items[", index, "].");
  ATTNSERVE_RETURN_IF_ERROR(ValidateCache(config, items, index, absl::StrCat(field, "cache")));
  const int64_t d = config.d_model;
  const int64_t size = static_cast<int64_t>(item.hidden_states.size());
  if (size == 0 || size % d != 0) {
    return InvalidField(absl::StrCat(field, "hidden_states"),
                        absl::StrCat("size ", size, " is not [n, d_model ", d, "] with n >= 1"));
  }
  *n = size / d;
  const std::optional<int64_t> projected =
      CheckedMul(*n, config.q_width() + 2 * config.kv_width());
  if (!projected || *projected > kMaxElements) {
    return InvalidField(absl::StrCat(field, "hidden_states"),
                        "too many tokens for this layer's projections");
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize(absl::StrCat(field, "output"), item.output.size(), {{"n", *n}, {"d_model", d}}));
  if (!item.attention_map.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(
        absl::StrCat(field, "attention_map"), item.attention_map.size(),
        {{"num_heads", config.num_heads}, {"n", *n}, {"L", item.cache->length() + *n}}));
  }
  if (!item.head_entropy.empty() || !item.head_max_weight.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(absl::StrCat(field, "head_entropy"),
                                        item.head_entropy.size(),
                                        {{"num_heads", config.num_heads}, {"n", *n}}));
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(absl::StrCat(field, "head_max_weight"),
                                        item.head_max_weight.size(),
                                        {{"num_heads", config.num_heads}, {"n", *n}}));
    // The scratch map the statistics are computed from.
    const std::optional<int64_t> map =
        CheckedProduct({config.num_heads, *n, item.cache->length() + *n});
    if (!map || *map > kMaxElements) {
      return InvalidField(absl::StrCat(field, "head_entropy"),
                          "the new rows' attention maps, which the statistics are computed "
                          "from, are too large");
    }
  }
  if (config.rotary.rotary_dim > 0) {
    ATTNSERVE_RETURN_IF_ERROR(
        ValidatePosition(item.first_position, absl::StrCat(field, "first_position")));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const SequenceLayout tokens, SequenceLayout::Packed({*n}));
  return ValidateFinite(item.hidden_states, tokens, 1, d, absl::StrCat(field, "hidden_states"));
}

// Validates every item (setting its status) and gathers those that pass into
// `step`, with their rows, and the step's route. INVALID_ARGUMENT ("items")
// when their sizes overflow.
absl::Status PlanStep(const HeadConfig& config, absl::Span<ExtendItem> items,
                      Precision precision, ExtendStep& step) {
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < items.size(); ++i) {
    int64_t n = 0;
    items[i].status = ValidateExtendItem(config, items, i, &n);
    if (!items[i].status.ok()) continue;
    const std::optional<int64_t> rows = CheckedAdd(step.rows, n);
    if (!rows) return InvalidField("items", "the new tokens' count overflows int64");
    step.items.push_back({&items[i], static_cast<int64_t>(i), n, step.rows,
                          items[i].cache->length(), false});
    step.rows = *rows;
    lengths.push_back(n);
    if (config.rotary.rotary_dim > 0) step.first_positions.push_back(items[i].first_position);
  }
  if (!lengths.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(step.layout, SequenceLayout::Packed(std::move(lengths)));
  }
  ATTNSERVE_ASSIGN_OR_RETURN(step.route, MakeExtendRoute(config, step.rows, precision));
  return absl::OkStatus();
}

// Q [R, Hq, hd], K [R, Hkv, hd], V [R, Hkv, hd] FP32 (kQStage, kKStage,
// kVStage) from QKV [R, N] (kProjections), RoPE on Q and K with the tables
// cos, sin [R, rotary_dim / 2] (nullptr without RoPE). Each token is a
// "sequence" of length 1 to StageHeads, whose [R, heads, 1, hd] output is
// then token-major.
void StageNewTokens(const HeadConfig& config, int64_t rows, const float* cos, const float* sin,
                    WorkspaceState& workspace) {
  const float* const qkv = workspace.data<float>(Scratch::kProjections);
  const int64_t hd = config.head_dim;
  const int64_t half = config.rotary.rotary_dim / 2;
  const int64_t n_width = config.q_width() + 2 * config.kv_width();
  const struct {
    Scratch to;
    int64_t heads;
    int64_t column;  // of QKV
    int64_t half;    // rotated pairs: RoPE on Q and K, not on V
  } parts[] = {
      {Scratch::kQStage, config.num_heads, 0, half},
      {Scratch::kKStage, config.num_kv_heads, config.q_width(), half},
      {Scratch::kVStage, config.num_kv_heads, config.q_width() + config.kv_width(), 0},
  };
  for (const auto& part : parts) {
    internal::StageHeads(
        rows, part.heads, 1, hd, part.half,
        [&](int64_t r, int64_t h, int64_t) {
          internal::HeadRow row;
          row.values = qkv + r * n_width + part.column + h * hd;
          if (part.half > 0) {
            row.cos = cos + r * half;
            row.sin = sin + r * half;
          }
          return row;
        },
        workspace.data<float>(part.to));
  }
}

// Appends each item's K and V rows (kKStage, kVStage) to its cache. An item
// the pool refuses gets RESOURCE_EXHAUSTED and sits out the rest of the
// step; any other failure is the call's (INTERNAL: the sizes were checked).
absl::Status AppendNewTokens(const HeadConfig& config, ExtendStep& step,
                             WorkspaceState& workspace) {
  const float* const k = workspace.data<float>(Scratch::kKStage);
  const float* const v = workspace.data<float>(Scratch::kVStage);
  const int64_t width = config.kv_width();
  for (ExtendStep::Item& item : step.items) {
    const size_t size = static_cast<size_t>(item.n * width);
    const absl::Status appended =
        item.item->cache->Append(absl::MakeConstSpan(k + item.row * width, size),
                                 absl::MakeConstSpan(v + item.row * width, size), item.n,
                                 item.item->blocks_ahead);
    if (appended.ok()) {
      item.appended = true;
    } else if (absl::IsResourceExhausted(appended)) {
      item.item->status = absl::ResourceExhaustedError(
          absl::StrCat("items[", item.index, "].cache: ", appended.message()));
    } else {
      return absl::InternalError(absl::StrCat("items[", item.index,
                                              "]: appending to its cache failed: ",
                                              appended.message()));
    }
  }
  return absl::OkStatus();
}

// The head statistics of each of the item's rows of `map` [heads, n, L]
// (after the head mask; entries past a row's position are 0 and add nothing)
// into its head_entropy and head_max_weight [heads, n].
void WriteRowStatistics(int64_t heads, int64_t n, int64_t length, absl::Span<const float> map,
                        ExtendItem& item) {
  for (int64_t r = 0; r < heads * n; ++r) {
    const internal::RowStatistics stats = internal::StatisticsOfRow(
        map.subspan(static_cast<size_t>(r * length), static_cast<size_t>(length)));
    item.head_entropy[static_cast<size_t>(r)] = static_cast<float>(stats.entropy);
    item.head_max_weight[static_cast<size_t>(r)] = stats.max_weight;
  }
}

// The new rows' attention over their caches (PagedAttention, with the head
// mask) into the context rows [R, Hq hd]: kContextTokens directly (FP32), or
// FP32 heads in kContextHeads converted into it (BF16). The rows of items
// that sit out are 0 (the output projection runs over all R rows).
absl::Status AttendNewTokens(const HeadConfig& config, const ExtendStep& step,
                             absl::Span<const float> head_mask, WorkspaceState& workspace) {
  const bool bf16 = step.route.bf16();
  const int64_t q_width = config.q_width();
  const float* const q = workspace.data<float>(Scratch::kQStage);
  float* const heads =
      workspace.data<float>(bf16 ? Scratch::kContextHeads : Scratch::kContextTokens);
  std::vector<PagedAttentionItem> attention;
  attention.reserve(step.items.size());
  // Maps of items that ask for statistics and no map: the paged attention's
  // online softmax keeps no per-key weights, so the rows are materialized
  // here for the statistics and dropped after the call.
  std::vector<std::vector<float>> scratch_maps;
  scratch_maps.reserve(step.items.size());
  std::vector<const ExtendStep::Item*> ran;  // attention[k] is ran[k]'s
  ran.reserve(step.items.size());
  for (const ExtendStep::Item& item : step.items) {
    const int64_t offset = item.row * q_width;
    const size_t size = static_cast<size_t>(item.n * q_width);
    if (!item.appended) {
      std::fill_n(heads + offset, size, 0.0f);
      continue;
    }
    absl::Span<float> map = item.item->attention_map;
    if (map.empty() && !item.item->head_entropy.empty()) {
      scratch_maps.emplace_back(
          static_cast<size_t>(config.num_heads * item.n * item.item->cache->length()));
      map = absl::MakeSpan(scratch_maps.back());
    }
    attention.push_back(PagedAttentionItem{
        item.item->cache, static_cast<int>(config.num_heads), item.n, config.scale,
        absl::MakeConstSpan(q + offset, size), absl::MakeSpan(heads + offset, size), map,
        head_mask});
    ran.push_back(&item);
  }
  const absl::Status attended = PagedAttention(attention);
  if (!attended.ok()) {
    return absl::InternalError(
        absl::StrCat("the paged attention refused a validated step: ", attended.message()));
  }
  for (size_t k = 0; k < attention.size(); ++k) {
    ExtendItem& item = *ran[k]->item;
    if (item.head_entropy.empty()) continue;
    WriteRowStatistics(config.num_heads, ran[k]->n, attention[k].cache->length(),
                       attention[k].attention_map, item);
  }
  if (bf16) {
    internal::ConvertToBf16(heads, step.rows * q_width,
                            workspace.data<Bf16>(Scratch::kContextTokens));
  }
  return absl::OkStatus();
}

// The output rows (kOutputs, [R, d_model]) to the outputs of the items that ran.
void ScatterOutputs(const HeadConfig& config, const ExtendStep& step, WorkspaceState& workspace) {
  const float* const outputs = workspace.data<float>(Scratch::kOutputs);
  const int64_t d = config.d_model;
  for (const ExtendStep::Item& item : step.items) {
    if (!item.appended) continue;
    std::memcpy(item.item->output.data(), outputs + item.row * d,
                static_cast<size_t>(item.n * d) * sizeof(float));
  }
}

// Each item's last new row's query (kQStage, [Hq, hd] FP32 after RoPE) kept
// in its cache, for a later read of that token's attention. Last, when
// nothing can fail any more: a failed call keeps the caches' earlier queries.
void KeepLatestQueries(const HeadConfig& config, const ExtendStep& step,
                       WorkspaceState& workspace) {
  const float* const q = workspace.data<float>(Scratch::kQStage);
  const int64_t q_width = config.q_width();
  for (const ExtendStep::Item& item : step.items) {
    if (!item.appended) continue;
    item.item->cache->SetLatestQuery(
        absl::MakeConstSpan(q + (item.row + item.n - 1) * q_width, static_cast<size_t>(q_width)));
  }
}

}  // namespace

absl::StatusOr<ForwardInfo> AttentionLayer::Impl::Extend(absl::Span<ExtendItem> items,
                                                         const ExtendOptions& options,
                                                         Workspace* workspace) const {
  for (ExtendItem& item : items) item.status = absl::OkStatus();
  ExtendStep step;
  absl::Status status = ValidateExtendOptions(config_, options);
  if (status.ok()) status = PlanStep(config_, items, options.precision, step);
  if (status.ok() && !step.items.empty()) {
    status = internal::RunInWorkspace(
        workspace, "extending the attention layer's KV caches",
        [&](WorkspaceState& state) { return ExtendOn(step, options, state); });
  }
  if (!status.ok()) {
    // The call's error replaces an item's own only where the item passed
    // validation (a pool's refusal included: nothing of the call stands).
    for (ExtendStep::Item& item : step.items) item.item->status = status;
    for (ExtendItem& item : items) {
      if (item.status.ok()) item.status = status;
    }
    return status;
  }
  return internal::MakeInfo(step.route);
}

absl::Status AttentionLayer::Impl::ExtendOn(ExtendStep& step, const ExtendOptions& options,
                                            WorkspaceState& workspace) const {
  ATTNSERVE_RETURN_IF_ERROR(workspace.Reserve(step.route));
  if (internal::ShouldStop(options.should_stop, workspace)) return internal::Cancelled();
  ATTNSERVE_RETURN_IF_ERROR(ProjectNewTokens(step, workspace));
  if (internal::ShouldStop(options.should_stop, workspace)) return internal::Cancelled();

  AppendRollback rollback(step);
  ATTNSERVE_RETURN_IF_ERROR(AppendNewTokens(config_, step, workspace));
  if (internal::ShouldStop(options.should_stop, workspace)) return internal::Cancelled();
  ATTNSERVE_RETURN_IF_ERROR(AttendNewTokens(config_, step, options.head_mask, workspace));
  if (internal::ShouldStop(options.should_stop, workspace)) return internal::Cancelled();

  ATTNSERVE_RETURN_IF_ERROR(ProjectContext(workspace, step.rows, step.route.bf16(),
                                           workspace.buffer(Scratch::kContextTokens).data(),
                                           workspace.data<float>(Scratch::kOutputs)));
  workspace.stream.wait();
  ScatterOutputs(config_, step, workspace);
  KeepLatestQueries(config_, step, workspace);
  rollback.Commit();
  return absl::OkStatus();
}

absl::Status AttentionLayer::Impl::ProjectNewTokens(const ExtendStep& step,
                                                    WorkspaceState& workspace) const {
  const bool bf16 = step.route.bf16();
  const int64_t d = config_.d_model;
  void* const x = workspace.buffer(bf16 ? Scratch::kInputsBf16 : Scratch::kInputs).data();
  for (const ExtendStep::Item& item : step.items) {
    const float* const from = item.item->hidden_states.data();
    if (bf16) {
      FloatsToBf16(from, item.n * d, static_cast<Bf16*>(x) + item.row * d);
    } else {
      std::memcpy(static_cast<float*>(x) + item.row * d, from,
                  static_cast<size_t>(item.n * d) * sizeof(float));
    }
  }
  ATTNSERVE_RETURN_IF_ERROR(ProjectQkv(workspace, step.rows, bf16, x,
                                       workspace.buffer(Scratch::kProjections).data(),
                                       config_.q_width() + 2 * config_.kv_width(),
                                       /*qkv_bf16=*/false));
  const int64_t half = config_.rotary.rotary_dim / 2;
  float* cos = nullptr;
  float* sin = nullptr;
  if (half > 0) {
    cos = workspace.data<float>(Scratch::kRotary);
    sin = cos + step.rows * half;
    internal::RotaryTables(step.layout, step.first_positions, inverse_frequencies_, cos, sin);
  }
  workspace.stream.wait();  // the projections are read next, on the CPU
  StageNewTokens(config_, step.rows, cos, sin, workspace);
  return absl::OkStatus();
}

}  // namespace attnserve::core
