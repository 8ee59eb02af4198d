#include "core/attention_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/attention_kernels.h"
#include "core/attention_weights.h"
#include "core/checked_math.h"
#include "core/head_config.h"
#include "core/onednn_util.h"
#include "core/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"

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
//       SDPA (AttentionKernels::Sdpa) -> context heads [n, Hq, S, hd].
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

using internal::AttentionKernels;
using internal::SdpaCall;


// RoPE positions are bounded so that position * frequency stays exact enough
// in double precision.
constexpr int64_t kMaxPositionOffset = int64_t{1} << 40;

// Element counts up to this are safe to index and to size in bytes.
constexpr int64_t kMaxElements = INT64_MAX / 16;

absl::Status Invalid(absl::string_view field, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

absl::Status Cancelled() {
  return absl::CancelledError("attention forward stopped: should_stop returned true");
}

std::string Dims(std::initializer_list<std::pair<absl::string_view, int64_t>> dims) {
  std::string out = "[";
  for (const auto& [name, value] : dims) {
    absl::StrAppend(&out, out.size() > 1 ? ", " : "", name, " ", value);
  }
  return absl::StrCat(out, "]");
}

// OK when `actual` elements are the product of `dims`.
absl::Status CheckSize(absl::string_view field, size_t actual,
                       std::initializer_list<std::pair<absl::string_view, int64_t>> dims) {
  std::vector<int64_t> values;
  for (const auto& dim : dims) values.push_back(dim.second);
  const std::optional<int64_t> expected = CheckedProduct(values);
  if (!expected || *expected > kMaxElements) {
    return Invalid(field, absl::StrCat(Dims(dims), " overflows int64"));
  }
  if (static_cast<int64_t>(actual) == *expected) return absl::OkStatus();
  return Invalid(field,
                 absl::StrCat("size ", actual, " does not match ", Dims(dims), " = ", *expected));
}

absl::Status CheckEmpty(absl::string_view field, size_t size, absl::string_view why) {
  if (size == 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be empty (", why, "), got ", size, " elements"));
}

absl::Status ValidateMask(const ExplicitMask& mask, int64_t batch, int64_t q_len, int64_t kv_len) {
  switch (mask.kind) {
    case ExplicitMask::Kind::kNone:
      return CheckEmpty("mask.values", mask.values.size(), "mask.kind is kNone");
    case ExplicitMask::Kind::kAllowed:
    case ExplicitMask::Kind::kAdditive:
      break;
    default:
      return Invalid("mask.kind", absl::StrCat("unknown value ", static_cast<int>(mask.kind)));
  }
  const struct {
    absl::string_view field;
    int64_t value;
    absl::string_view full_name;
    int64_t full;
  } dims[] = {{"mask.batch_dim", mask.batch_dim, "the batch", batch},
              {"mask.q_dim", mask.q_dim, "the queries' max_length", q_len},
              {"mask.kv_dim", mask.kv_dim, "the keys' max_length", kv_len}};
  for (const auto& dim : dims) {
    if (dim.value != 1 && dim.value != dim.full) {
      return Invalid(dim.field, absl::StrCat("must be 1 or ", dim.full_name, " ", dim.full,
                                             ", got ", dim.value));
    }
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize("mask.values", mask.values.size(),
                {{"batch_dim", mask.batch_dim}, {"q_dim", mask.q_dim}, {"kv_dim", mask.kv_dim}}));
  for (size_t i = 0; i < mask.values.size(); ++i) {
    const float value = mask.values[i];
    if (std::isnan(value)) return Invalid(absl::StrCat("mask.values[", i, "]"), "NaN");
    if (mask.kind == ExplicitMask::Kind::kAdditive && value == INFINITY) {
      return Invalid(absl::StrCat("mask.values[", i, "]"),
                     "+inf (an additive mask takes finite values, or -inf to forbid a key)");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadMask(absl::Span<const float> head_mask, int64_t num_heads) {
  if (head_mask.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(head_mask.size()) != num_heads) {
    return Invalid("head_mask",
                   absl::StrCat(head_mask.size(), " values for num_heads ", num_heads));
  }
  for (size_t h = 0; h < head_mask.size(); ++h) {
    if (!std::isfinite(head_mask[h]) || head_mask[h] < 0.0f) {
      return Invalid(absl::StrCat("head_mask[", h, "]"),
                     absl::StrCat("must be finite and >= 0, got ", head_mask[h]));
    }
  }
  return absl::OkStatus();
}

// The checks shared by the layer and the core: sizes of the attention itself,
// masks, maps and statistics. `layer`: whether head_contribution is produced.
absl::Status ValidateAttention(const HeadConfig& config, const SequenceLayout& queries,
                               const SequenceLayout& keys, const ExplicitMask& mask,
                               absl::Span<const float> head_mask, const ForwardOptions& options,
                               const ForwardOutputs& outputs, bool layer) {
  const int64_t batch = queries.batch();
  const int64_t s = queries.max_length();
  const int64_t t = keys.max_length();
  const std::optional<int64_t> scores = CheckedProduct({config.num_heads, s, t});
  if (!scores || *scores > kMaxElements) {
    return Invalid("layout", absl::StrCat("num_heads ", config.num_heads, " * max_length ", s,
                                          " * keys' max_length ", t, " is too large"));
  }
  if (options.precision != Precision::kFp32 && options.precision != Precision::kBf16) {
    return Invalid("precision",
                   absl::StrCat("unknown value ", static_cast<int>(options.precision)));
  }
  switch (options.attention_path) {
    case AttentionPath::kAuto:
    case AttentionPath::kMaterialized:
      break;
    case AttentionPath::kBlocked:
      if (options.maps.mode != AttentionMapMode::kNone || options.head_statistics) {
        return Invalid("attention_path",
                       "the blocked path returns neither maps nor head statistics (ask for "
                       "kMaterialized or kAuto)");
      }
      break;
    default:
      return Invalid("attention_path",
                     absl::StrCat("unknown value ", static_cast<int>(options.attention_path)));
  }
  if (options.block_queries < 0 || options.block_keys < 0) {
    return Invalid(options.block_queries < 0 ? "block_queries" : "block_keys",
                   "must be >= 0 (0: the core's choice)");
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateMask(mask, batch, s, t));
  ATTNSERVE_RETURN_IF_ERROR(ValidateHeadMask(head_mask, config.num_heads));

  const MapSelection& maps = options.maps;
  switch (maps.mode) {
    case AttentionMapMode::kNone:
      ATTNSERVE_RETURN_IF_ERROR(CheckEmpty("maps.heads", maps.heads.size(), "no maps asked for"));
      ATTNSERVE_RETURN_IF_ERROR(
          CheckEmpty("maps.query_rows", maps.query_rows.size(), "no maps asked for"));
      break;
    case AttentionMapMode::kMeanOverHeads:
      ATTNSERVE_RETURN_IF_ERROR(
          CheckEmpty("maps.heads", maps.heads.size(), "kMeanOverHeads averages over all heads"));
      break;
    case AttentionMapMode::kPerHead:
      break;
    default:
      return Invalid("maps.mode", absl::StrCat("unknown value ", static_cast<int>(maps.mode)));
  }
  for (size_t i = 0; i < maps.heads.size(); ++i) {
    if (maps.heads[i] < 0 || maps.heads[i] >= config.num_heads) {
      return Invalid(
          absl::StrCat("maps.heads[", i, "]"),
          absl::StrCat(maps.heads[i], " is outside [0, num_heads ", config.num_heads, ")"));
    }
  }
  for (size_t i = 0; i < maps.query_rows.size(); ++i) {
    if (maps.query_rows[i] < 0 || maps.query_rows[i] >= s) {
      return Invalid(absl::StrCat("maps.query_rows[", i, "]"),
                     absl::StrCat(maps.query_rows[i], " is outside [0, max_length ", s, ")"));
    }
  }
  const std::optional<int64_t> map_elements = AttentionMapElements(config, queries, keys, maps);
  if (!map_elements || *map_elements > kMaxElements) {
    return Invalid("attention_maps", "the maps asked for overflow int64");
  }
  if (static_cast<int64_t>(outputs.attention_maps.size()) != *map_elements) {
    return Invalid(
        "attention_maps",
        absl::StrCat("size ", outputs.attention_maps.size(), " does not match the maps asked for (",
                     *map_elements, maps.mode == AttentionMapMode::kNone ? ", none" : "",
                     " elements; see AttentionMapElements)"));
  }

  const struct {
    absl::string_view field;
    size_t size;
    bool wanted;
  } statistics[] = {
      {"head_entropy", outputs.head_entropy.size(), options.head_statistics},
      {"head_max_weight", outputs.head_max_weight.size(), options.head_statistics},
      {"head_contribution", outputs.head_contribution.size(), layer && options.head_statistics},
  };
  for (const auto& statistic : statistics) {
    if (statistic.wanted) {
      ATTNSERVE_RETURN_IF_ERROR(CheckSize(statistic.field, statistic.size,
                                          {{"batch", batch}, {"num_heads", config.num_heads}}));
    } else {
      ATTNSERVE_RETURN_IF_ERROR(CheckEmpty(statistic.field, statistic.size,
                                           options.head_statistics
                                               ? "AttentionCore has no output projection"
                                               : "options.head_statistics is false"));
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> Lengths(const SequenceLayout& layout) {
  std::vector<int64_t> lengths(static_cast<size_t>(layout.batch()));
  for (int64_t b = 0; b < layout.batch(); ++b) lengths[b] = layout.length(b);
  return lengths;
}

// The path `options` choose (validated): see AttentionPath.
bool UsesBlocked(const ForwardOptions& options) {
  switch (options.attention_path) {
    case AttentionPath::kBlocked:
      return true;
    case AttentionPath::kMaterialized:
      return false;
    case AttentionPath::kAuto:
      break;
  }
  return options.maps.mode == AttentionMapMode::kNone && !options.head_statistics;
}

SdpaCall MakeCall(const HeadConfig& config, const SequenceLayout& queries,
                  const SequenceLayout& keys, bool causal, const ExplicitMask& mask,
                  absl::Span<const float> head_mask, const ForwardOptions& options,
                  const ForwardOutputs& outputs, bool bf16) {
  SdpaCall call;
  call.batch = queries.batch();
  call.q_len = queries.max_length();
  call.kv_len = keys.max_length();
  call.q_lengths = Lengths(queries);
  call.kv_lengths = Lengths(keys);
  call.causal = causal;
  call.mask = mask;
  call.head_mask = head_mask;
  call.maps = &options.maps;
  call.statistics = options.head_statistics;
  call.bf16 = bf16;
  if (UsesBlocked(options)) {
    internal::MakeBlocked(config, options.block_queries, options.block_keys, call);
  }
  call.attention_maps = outputs.attention_maps;
  call.head_entropy = outputs.head_entropy;
  call.head_max_weight = outputs.head_max_weight;
  return call;
}

ForwardInfo MakeInfo(const SdpaCall& call) {
  ForwardInfo info;
  info.precision = call.bf16 ? Precision::kBf16 : Precision::kFp32;
  info.kernel_path = absl::StrCat(PrecisionName(info.precision), "/",
                                  call.blocked ? "blocked" : "materialized");
  return info;
}

// Token-major rows [tokens, width] of `data` as the blocked path's HeadRows
// for sequences [first, first + n) of `layout`: head h at column h * head_dim.
internal::HeadRows TokenRows(void* data, int64_t width, int64_t head_dim,
                             const SequenceLayout& layout, int64_t first, int64_t n) {
  internal::HeadRows rows;
  rows.data = data;
  rows.row_stride = width;
  rows.head_stride = head_dim;
  rows.first_rows.resize(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) rows.first_rows[c] = layout.row_offset(first + c);
  return rows;
}

// --- Staging: token-major or head-major FP32 rows into the kernels' padded,
// head-major operands (FP32 or BF16), with RoPE on the way.

template <typename T>
void Store(const float* from, int64_t count, T* to) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(to, from, static_cast<size_t>(count) * sizeof(float));
  } else {
    FloatsToBf16(from, count, to);
  }
}

template <typename T>
T FromFloat(float value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return FloatToBf16(value);
  }
}

// Where one head's row comes from: `values` (nullptr: padding, zeros) and,
// with RoPE, the cos/sin of its position ([rotary_dim / 2] each).
struct HeadRow {
  const float* values = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
};

// out [n, heads, len, hd] (row (c, h, pos) from row_of(c, h, pos)), with the
// Llama "rotate half" RoPE on the first 2 * half dimensions:
//   out[i] = x[i] cos - x[i + half] sin, out[i + half] = x[i + half] cos + x[i] sin.
template <typename T, typename RowOf>
void StageHeads(int64_t n, int64_t heads, int64_t len, int64_t hd, int64_t half, RowOf row_of,
                T* out) {
#pragma omp parallel for schedule(static) if (n * heads * len * hd > (int64_t{1} << 14))
  for (int64_t item = 0; item < n * heads * len; ++item) {
    const int64_t c = item / (heads * len);
    const int64_t h = item / len % heads;
    const int64_t pos = item % len;
    T* const to = out + item * hd;
    const HeadRow row = row_of(c, h, pos);
    if (row.values == nullptr) {
      std::memset(to, 0, static_cast<size_t>(hd) * sizeof(T));
    } else if (row.cos == nullptr) {
      Store(row.values, hd, to);
    } else {
      const float* const x = row.values;
      for (int64_t i = 0; i < half; ++i) {
        to[i] = FromFloat<T>(x[i] * row.cos[i] - x[i + half] * row.sin[i]);
        to[i + half] = FromFloat<T>(x[i + half] * row.cos[i] + x[i] * row.sin[i]);
      }
      Store(x + 2 * half, hd - 2 * half, to + 2 * half);
    }
  }
}

// RoPE's cos and sin, [layout.rows(), rotary_dim / 2] each, for the token at
// row_offset(b) + i at position first_positions[b] + i (0 when empty).
void RotaryTables(const SequenceLayout& layout, absl::Span<const int64_t> first_positions,
                  const std::vector<double>& inverse_frequencies, std::vector<float>& cos,
                  std::vector<float>& sin) {
  const int64_t half = static_cast<int64_t>(inverse_frequencies.size());
  cos.resize(static_cast<size_t>(layout.rows() * half));
  sin.resize(cos.size());
  for (int64_t b = 0; b < layout.batch(); ++b) {
    const int64_t first_position = first_positions.empty() ? 0 : first_positions[b];
    const int64_t offset = layout.row_offset(b);
    const int64_t length = layout.length(b);
#pragma omp parallel for schedule(static) if (length * half > 4096)
    for (int64_t i = 0; i < length; ++i) {
      const double position = static_cast<double>(first_position + i);
      float* const c = cos.data() + (offset + i) * half;
      float* const s = sin.data() + (offset + i) * half;
      for (int64_t k = 0; k < half; ++k) {
        const double angle = position * inverse_frequencies[k];
        c[k] = static_cast<float>(std::cos(angle));
        s[k] = static_cast<float>(std::sin(angle));
      }
    }
  }
}

}  // namespace

std::optional<int64_t> AttentionMapElements(const HeadConfig& config, const SequenceLayout& queries,
                                            const SequenceLayout& keys, const MapSelection& maps) {
  const int64_t rows =
      maps.query_rows.empty() ? queries.max_length() : static_cast<int64_t>(maps.query_rows.size());
  switch (maps.mode) {
    case AttentionMapMode::kNone:
      return 0;
    case AttentionMapMode::kPerHead:
      return CheckedProduct(
          {queries.batch(),
           maps.heads.empty() ? config.num_heads : static_cast<int64_t>(maps.heads.size()), rows,
           keys.max_length()});
    case AttentionMapMode::kMeanOverHeads:
      return CheckedProduct({queries.batch(), rows, keys.max_length()});
  }
  return std::nullopt;
}

// Whether the blocked path reads Q, K and V where the projections leave them
// (token-major rows, written in the operand type by the projection matmul)
// instead of from staged dense copies. Never with RoPE (staging applies it).
// The own block kernels read any rows (Q by broadcasts, K and V once into
// their packed blocks), only those within each sequence's length: always.
// oneDNN's block matmuls leave brg:avx512_core* for gemm:jit on rows a whole
// projection width apart (its brgemm matmul wants dense operands), and read
// every row of a block, padding included: only BF16 up to four query blocks
// (measured 4-8% faster than staging at B=8 S=128 and S=512, equal at S=2048,
// 3% slower at S=4096; docs/measurements.md), uniform lengths only.
bool ReadsProjectionsInPlace(const HeadConfig& config, const SdpaCall& call,
                             const SequenceLayout& queries, const SequenceLayout& keys) {
  if (!call.blocked || config.rotary.rotary_dim > 0) return false;
  if (call.own_block_kernels) return true;
  return call.bf16 && call.q_len <= 4 * call.block_queries && queries.is_uniform() &&
         keys.is_uniform();
}

// Whether AttentionCore copies the caller's Q, K and V into the kernels'
// staging: to convert them to BF16, and where padding (which may hold
// anything, NaN too) would otherwise be read -- everywhere but in the own
// block kernels, which read rows within the lengths only.
bool CoreStages(const SdpaCall& call, const SequenceLayout& queries,
                const SequenceLayout& keys) {
  if (call.bf16) return true;
  if (call.blocked && call.own_block_kernels) return false;
  return !queries.is_uniform() || !keys.is_uniform();
}

std::optional<int64_t> ForwardScratchBytes(const HeadConfig& config, const SequenceLayout& queries,
                                           const SequenceLayout& keys, bool cross_attention,
                                           bool projected_inputs, const ForwardOptions& options) {
  if (queries.batch() < 1 || keys.batch() < 1) return 0;
  const bool bf16 = options.precision == Precision::kBf16 && Bf16Supported();
  SdpaCall call;
  call.batch = queries.batch();
  call.q_len = queries.max_length();
  call.kv_len = keys.max_length();
  call.bf16 = bf16;
  if (UsesBlocked(options)) {
    internal::MakeBlocked(config, options.block_queries, options.block_keys, call);
  }
  const int64_t chunk = internal::ChunkFor(config, call);
  const bool staging = projected_inputs ? CoreStages(call, queries, keys)
                                        : !ReadsProjectionsInPlace(config, call, queries, keys);
  std::optional<int64_t> total = internal::KernelScratchBytes(config, call, chunk, staging);
  auto add = [&total](std::initializer_list<int64_t> dims, int64_t element_bytes) {
    const std::optional<int64_t> elements = CheckedProduct(dims);
    const std::optional<int64_t> bytes =
        elements ? CheckedMul(*elements, element_bytes) : std::nullopt;
    total = total && bytes ? CheckedAdd(*total, *bytes) : std::nullopt;
  };
  if (projected_inputs) return total;
  const int64_t rows = queries.rows();
  const int64_t kv_rows = keys.rows();
  const int64_t q_width = config.q_width();
  const int64_t kv_width = 2 * config.kv_width();
  const int64_t element = bf16 ? 2 : 4;
  // The projections (FP32, or BF16 when read in place).
  const int64_t projected_element = !staging && bf16 ? 2 : 4;
  if (cross_attention) {
    add({rows, q_width}, projected_element);
    add({kv_rows, kv_width}, projected_element);
  } else {
    add({rows, q_width + kv_width}, projected_element);
  }
  add({rows, q_width}, element);                                       // concatenated heads
  if (!call.blocked)
    add({chunk, config.num_heads, call.q_len, config.head_dim}, 4);  // context heads
  if (bf16) {
    add({rows, config.d_model}, 2);
    if (cross_attention) add({kv_rows, config.context_dim}, 2);
  }
  if (config.rotary.rotary_dim > 0) add({2, rows + kv_rows, config.rotary.rotary_dim / 2}, 4);
  return total;
}

// ---------------------------------------------------------------------------
// AttentionLayer

// The layer's state. Thread-safe: Forward holds mu_ for the whole call, since
// the stream, the primitives and the scratch buffers are shared.
class AttentionLayer::Impl {
 public:
  Impl(const HeadConfig& config, dnnl::engine engine, AttentionWeights weights)
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
        inverse_frequencies_(InverseFrequencies(config.rotary)),
        kernels_(config, std::move(engine)) {}

  const HeadConfig& config() const { return config_; }

  absl::StatusOr<ForwardInfo> Forward(const LayerInputs& inputs, const ForwardOptions& options,
                                      ForwardOutputs outputs);

 private:
  // [rows, parts[0] | parts[1] | ...]: row r of the result is row r of each
  // part ([rows, widths[i]]) in turn.
  static std::vector<float> FuseColumns(std::initializer_list<const std::vector<float>*> parts,
                                        int64_t rows, std::initializer_list<int64_t> widths);
  // theta^(-2k / rotary_dim) for k < rotary_dim / 2.
  static std::vector<double> InverseFrequencies(const RotaryConfig& rotary);

  absl::Status Validate(const LayerInputs& inputs, const ForwardOptions& options,
                        const ForwardOutputs& outputs) const;
  absl::StatusOr<ForwardInfo> ForwardLocked(const LayerInputs& inputs,
                                            const ForwardOptions& options, ForwardOutputs outputs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where the projected rows of Q, K or V are in projected_: row r of head h
  // starts at element offset + r * stride + h * head_dim.
  struct Projected {
    int64_t offset = 0;
    int64_t stride = 0;
  };
  // Stages the chunk's Q, K, V (see AttentionKernels::q_stage) from the
  // projections, applying RoPE.
  template <typename T>
  void Stage(const LayerInputs& inputs, const SequenceLayout& keys, const Projected (&qkv)[3],
             const SdpaCall& call, int64_t first, int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Concatenates the chunk's heads into token-major rows of context_tokens_.
  template <typename T>
  void ConcatHeads(const SequenceLayout& layout, const SdpaCall& call, int64_t first, int64_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ||head_h W^O_h||_F over each of the chunk's sequences' rows.
  void Contributions(const SdpaCall& call, int64_t first, int64_t n, absl::Span<float> out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MakeBf16Weights() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ShouldStop(const ForwardOptions& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options.should_stop) return false;
    kernels_.Wait();
    return options.should_stop();
  }

  // Where the input projections' weights are, FP32 or BF16: W_q is columns
  // [0, Hq hd) of `q` (row stride q_stride), [W_k | W_v] columns [0, 2 Hkv hd)
  // of `kv` (row stride kv_stride). Fused: both inside W_qkv.
  struct InputWeights {
    const void* q = nullptr;
    int64_t q_stride = 0;
    const void* kv = nullptr;
    int64_t kv_stride = 0;
  };
  InputWeights GetInputWeights(bool bf16) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const HeadConfig config_;  // resolved
  // context_dim == d_model: W_q, W_k and W_v fused into w_qkv_ (w_q_ and w_kv_
  // empty). Otherwise w_q_ and w_kv_ (w_qkv_ empty): their inputs differ in
  // width.
  const bool fused_;
  const std::vector<float> w_qkv_;                 // [d_model, N] = [w_q | w_k | w_v]
  const std::vector<float> w_q_;                   // [d_model, Hq * hd]
  const std::vector<float> w_kv_;                  // [context_dim, 2 * Hkv * hd] = [w_k | w_v]
  const std::vector<float> b_qkv_;                 // [N] = [b_q | b_k | b_v]
  const std::vector<float> w_o_;                   // [Hq * hd, d_model]
  const std::vector<float> b_o_;                   // [d_model]
  const std::vector<double> inverse_frequencies_;  // [rotary_dim / 2]

  absl::Mutex mu_;
  AttentionKernels kernels_ ABSL_GUARDED_BY(mu_);
  // Made on first use (those of the FP32 weights that are not empty).
  std::vector<Bf16> w_qkv_bf16_ ABSL_GUARDED_BY(mu_);
  std::vector<Bf16> w_q_bf16_ ABSL_GUARDED_BY(mu_);
  std::vector<Bf16> w_kv_bf16_ ABSL_GUARDED_BY(mu_);
  std::vector<Bf16> w_o_bf16_ ABSL_GUARDED_BY(mu_);
  // W^O_h (W^O_h)^T, [Hq, hd, hd], when hd <= d_model (else the contribution
  // multiplies by W^O_h directly, which is then cheaper).
  std::vector<double> w_o_gram_ ABSL_GUARDED_BY(mu_);
  // Scratch, reused across calls.
  internal::ScratchBuffer x_bf16_ ABSL_GUARDED_BY(mu_);  // [R, d_model]
  internal::ScratchBuffer c_bf16_ ABSL_GUARDED_BY(mu_);  // [Rc, context_dim]
  // Self-attention: QKV [R, N]. Cross-attention: Q [R, Hq * hd], then
  // KV [Rc, 2 * Hkv * hd].
  internal::ScratchBuffer projected_ ABSL_GUARDED_BY(mu_);
  internal::ScratchBuffer context_heads_ ABSL_GUARDED_BY(mu_);   // [chunk, Hq, S, hd]
  internal::ScratchBuffer context_tokens_ ABSL_GUARDED_BY(mu_);  // [R, Hq * hd]
  std::vector<float> q_cos_ ABSL_GUARDED_BY(mu_), q_sin_ ABSL_GUARDED_BY(mu_);
  std::vector<float> k_cos_ ABSL_GUARDED_BY(mu_), k_sin_ ABSL_GUARDED_BY(mu_);
};

std::vector<float> AttentionLayer::Impl::FuseColumns(
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

std::vector<double> AttentionLayer::Impl::InverseFrequencies(const RotaryConfig& rotary) {
  std::vector<double> frequencies(static_cast<size_t>(rotary.rotary_dim / 2));
  for (size_t k = 0; k < frequencies.size(); ++k) {
    frequencies[k] =
        std::pow(static_cast<double>(rotary.theta),
                 -2.0 * static_cast<double>(k) / static_cast<double>(rotary.rotary_dim));
  }
  return frequencies;
}

absl::Status AttentionLayer::Impl::Validate(const LayerInputs& inputs,
                                            const ForwardOptions& options,
                                            const ForwardOutputs& outputs) const {
  const SequenceLayout& layout = inputs.layout;
  if (layout.batch() < 1) {
    return Invalid("layout", "no sequences (make it with SequenceLayout::Padded or Packed)");
  }
  const int64_t d = config_.d_model;
  const int64_t context_dim = config_.context_dim;
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("hidden_states", inputs.hidden_states.size(),
                                      {{"layout.rows", layout.rows()}, {"d_model", d}}));
  // The projections and the context must fit too.
  const int64_t width = std::max({d, context_dim, config_.q_width() + 2 * config_.kv_width()});
  const std::optional<int64_t> projected = CheckedProduct({layout.rows(), width});
  if (!projected || *projected > kMaxElements) {
    return Invalid("layout", "too many rows for this layer's projections");
  }

  const SequenceLayout* keys = &layout;
  if (inputs.context_layout.has_value()) {
    keys = &*inputs.context_layout;
    if (keys->batch() != layout.batch()) {
      return Invalid(
          "context_layout",
          absl::StrCat("batch ", keys->batch(), " does not match layout's batch ", layout.batch()));
    }
    ATTNSERVE_RETURN_IF_ERROR(
        CheckSize("context", inputs.context.size(),
                  {{"context_layout.rows", keys->rows()}, {"context_dim", context_dim}}));
    const std::optional<int64_t> kv_size = CheckedProduct({keys->rows(), width});
    if (!kv_size || *kv_size > kMaxElements) {
      return Invalid("context_layout", "too many rows for this layer's projections");
    }
  } else if (!inputs.context.empty()) {
    return Invalid("context_layout", "required with context (cross-attention)");
  } else if (context_dim != d) {
    return Invalid("context", absl::StrCat("a layer with context_dim ", context_dim,
                                           " needs context states (self-attention needs "
                                           "context_dim == d_model)"));
  }

  if (config_.rotary.rotary_dim > 0 && !inputs.position_offsets.empty()) {
    if (static_cast<int64_t>(inputs.position_offsets.size()) != layout.batch()) {
      return Invalid("position_offsets", absl::StrCat(inputs.position_offsets.size(),
                                                      " offsets for a batch of ", layout.batch()));
    }
    for (size_t b = 0; b < inputs.position_offsets.size(); ++b) {
      const int64_t offset = inputs.position_offsets[b];
      if (offset < 0 || offset > kMaxPositionOffset) {
        return Invalid(absl::StrCat("position_offsets[", b, "]"),
                       absl::StrCat(offset, " is outside [0, ", kMaxPositionOffset, "]"));
      }
    }
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize("output", outputs.output.size(), {{"layout.rows", layout.rows()}, {"d_model", d}}));
  return ValidateAttention(config_, layout, *keys, inputs.mask, inputs.head_mask, options, outputs,
                           /*layer=*/true);
}

absl::StatusOr<ForwardInfo> AttentionLayer::Impl::Forward(const LayerInputs& inputs,
                                                          const ForwardOptions& options,
                                                          ForwardOutputs outputs) {
  ATTNSERVE_RETURN_IF_ERROR(Validate(inputs, options, outputs));
  absl::MutexLock lock(&mu_);
  try {
    return ForwardLocked(inputs, options, outputs);
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "running the attention layer");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory running the attention layer");
  }
}

absl::StatusOr<ForwardInfo> AttentionLayer::Impl::ForwardLocked(const LayerInputs& inputs,
                                                                const ForwardOptions& options,
                                                                ForwardOutputs outputs) {
  if (ShouldStop(options)) return Cancelled();
  const bool bf16 = options.precision == Precision::kBf16 && Bf16Supported();
  const bool cross = inputs.context_layout.has_value();
  const SequenceLayout& layout = inputs.layout;
  const SequenceLayout& keys = cross ? *inputs.context_layout : layout;
  const int64_t d = config_.d_model;
  const int64_t context_dim = config_.context_dim;  // == d in self-attention (validated)
  const int64_t q_width = config_.q_width();
  const int64_t kv_width = 2 * config_.kv_width();
  const int64_t n_width = q_width + kv_width;  // N
  const int64_t rows = layout.rows();
  const int64_t kv_rows = keys.rows();
  const int64_t element = bf16 ? sizeof(Bf16) : sizeof(float);

  const SdpaCall call = MakeCall(config_, layout, keys, inputs.causal, inputs.mask,
                                 inputs.head_mask, options, outputs, bf16);
  const bool direct = ReadsProjectionsInPlace(config_, call, layout, keys);
  // On the direct route the projection matmul writes the operand type.
  const bool projected_bf16 = direct && bf16;
  const int64_t projected_element = projected_bf16 ? sizeof(Bf16) : sizeof(float);

  // Sizes below were checked by Validate.
  ATTNSERVE_RETURN_IF_ERROR(projected_.Reserve(
      (cross ? rows * q_width + kv_rows * kv_width : rows * n_width) * projected_element));
  ATTNSERVE_RETURN_IF_ERROR(context_tokens_.Reserve(rows * q_width * element));

  // Stage 1: projections.
  const void* x = inputs.hidden_states.data();
  const void* c = cross ? inputs.context.data() : x;
  const void* w_o = w_o_.data();
  if (bf16) {
    MakeBf16Weights();
    ATTNSERVE_RETURN_IF_ERROR(x_bf16_.Reserve(rows * d * 2));
    internal::ConvertToBf16(inputs.hidden_states.data(), rows * d,
                            static_cast<Bf16*>(x_bf16_.data()));
    x = c = x_bf16_.data();
    if (cross) {
      ATTNSERVE_RETURN_IF_ERROR(c_bf16_.Reserve(kv_rows * context_dim * 2));
      internal::ConvertToBf16(inputs.context.data(), kv_rows * context_dim,
                              static_cast<Bf16*>(c_bf16_.data()));
      c = c_bf16_.data();
    }
    w_o = w_o_bf16_.data();
  }
  const InputWeights w_in = GetInputWeights(bf16);
  char* const projected = static_cast<char*>(projected_.data());
  Projected qkv[3];  // Q, K, V
  if (cross) {
    const int64_t kv = rows * q_width;
    ATTNSERVE_RETURN_IF_ERROR(kernels_.Linear(rows, d, q_width, w_in.q_stride, bf16, x, w_in.q,
                                              b_qkv_.data(), projected, projected_bf16));
    ATTNSERVE_RETURN_IF_ERROR(kernels_.Linear(kv_rows, context_dim, kv_width, w_in.kv_stride, bf16,
                                              c, w_in.kv, b_qkv_.data() + q_width,
                                              projected + kv * projected_element, projected_bf16));
    qkv[0] = {0, q_width};
    qkv[1] = {kv, kv_width};
    qkv[2] = {kv + config_.kv_width(), kv_width};
  } else {
    // Fused (Validate checked context_dim == d_model).
    ATTNSERVE_RETURN_IF_ERROR(kernels_.Linear(rows, d, n_width, n_width, bf16, x, w_in.q,
                                              b_qkv_.data(), projected, projected_bf16));
    qkv[0] = {0, n_width};
    qkv[1] = {q_width, n_width};
    qkv[2] = {q_width + config_.kv_width(), n_width};
  }
  if (config_.rotary.rotary_dim > 0) {
    // Queries at position_offsets[b] + i. Keys: the same positions in
    // self-attention; the context's own positions from 0 in cross-attention.
    RotaryTables(layout, inputs.position_offsets, inverse_frequencies_, q_cos_, q_sin_);
    if (cross) RotaryTables(keys, {}, inverse_frequencies_, k_cos_, k_sin_);
  }

  // Stage 2: attention, a chunk of sequences at a time (the blocked path: the
  // whole batch at once), into the token-major rows of context_tokens_.
  const int64_t chunk = kernels_.ChunkSequences(call);
  ATTNSERVE_RETURN_IF_ERROR(kernels_.ReserveChunk(call, chunk, /*staging=*/!direct));
  if (!call.blocked) {
    ATTNSERVE_RETURN_IF_ERROR(
        context_heads_.Reserve(chunk * config_.num_heads * call.q_len * config_.head_dim * 4));
  }
  const int64_t hd = config_.head_dim;
  for (int64_t first = 0; first < call.batch; first += chunk) {
    if (ShouldStop(options)) return Cancelled();
    const int64_t n = std::min(chunk, call.batch - first);
    if (!direct) {
      if (bf16) {
        Stage<Bf16>(inputs, keys, qkv, call, first, n);
      } else {
        Stage<float>(inputs, keys, qkv, call, first, n);
      }
    }
    if (call.blocked) {
      auto projected_rows = [&](const Projected& part, const SequenceLayout& of) {
        return TokenRows(projected + part.offset * projected_element, part.stride, hd, of, first,
                         n);
      };
      const internal::AttentionKernels::Operands operands =
          direct
              ? internal::AttentionKernels::Operands{projected_rows(qkv[0], layout),
                                                     projected_rows(qkv[1], keys),
                                                     projected_rows(qkv[2], keys)}
              : kernels_.Dense(call, n, kernels_.q_stage(), kernels_.k_stage(), kernels_.v_stage());
      ATTNSERVE_RETURN_IF_ERROR(kernels_.SdpaBlocked(
          call, first, n, operands.q, operands.k, operands.v,
          TokenRows(context_tokens_.data(), q_width, hd, layout, first, n), bf16,
          /*zero_rows_past_length=*/false));
      continue;
    }
    ATTNSERVE_RETURN_IF_ERROR(kernels_.Sdpa(call, first, n, kernels_.q_stage(), kernels_.k_stage(),
                                            kernels_.v_stage(), context_heads_.floats()));
    if (options.head_statistics) Contributions(call, first, n, outputs.head_contribution);
    if (bf16) {
      ConcatHeads<Bf16>(layout, call, first, n);
    } else {
      ConcatHeads<float>(layout, call, first, n);
    }
  }

  // Stage 3: the output projection; padding rows are 0.
  if (ShouldStop(options)) return Cancelled();
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
    std::memset(static_cast<char*>(context_tokens_.data()) + begin * q_width * element, 0,
                static_cast<size_t>((end - begin) * q_width * element));
  }
  ATTNSERVE_RETURN_IF_ERROR(kernels_.Linear(rows, q_width, d, d, bf16, context_tokens_.data(), w_o,
                                            b_o_.data(), outputs.output.data(),
                                            /*y_bf16=*/false));
  kernels_.Wait();
  for (const auto& [begin, end] : padding) {
    std::fill(outputs.output.begin() + begin * d, outputs.output.begin() + end * d, 0.0f);
  }
  return MakeInfo(call);
}

template <typename T>
void AttentionLayer::Impl::Stage(const LayerInputs& inputs, const SequenceLayout& keys,
                                 const Projected (&qkv)[3], const SdpaCall& call, int64_t first,
                                 int64_t n) {
  const SequenceLayout& layout = inputs.layout;
  const bool cross = inputs.context_layout.has_value();
  const int64_t hd = config_.head_dim;
  const int64_t half = config_.rotary.rotary_dim / 2;
  const std::vector<float>& k_cos = cross ? k_cos_ : q_cos_;
  const std::vector<float>& k_sin = cross ? k_sin_ : q_sin_;

  StageHeads(
      n, config_.num_heads, call.q_len, hd, half,
      [&](int64_t c, int64_t h, int64_t pos) {
        const int64_t b = first + c;
        HeadRow row;
        if (pos >= layout.length(b)) return row;
        const int64_t r = layout.row_offset(b) + pos;
        row.values = projected_.floats() + qkv[0].offset + r * qkv[0].stride + h * hd;
        if (half > 0) {
          row.cos = q_cos_.data() + r * half;
          row.sin = q_sin_.data() + r * half;
        }
        return row;
      },
      static_cast<T*>(kernels_.q_stage()));
  for (int which = 0; which < 2; ++which) {  // K, then V
    const bool rotate = which == 0 && half > 0;
    StageHeads(
        n, config_.num_kv_heads, call.kv_len, hd, rotate ? half : 0,
        [&](int64_t c, int64_t g, int64_t pos) {
          const int64_t b = first + c;
          HeadRow row;
          if (pos >= keys.length(b)) return row;
          const int64_t r = keys.row_offset(b) + pos;
          row.values =
              projected_.floats() + qkv[1 + which].offset + r * qkv[1 + which].stride + g * hd;
          if (rotate) {
            row.cos = k_cos.data() + r * half;
            row.sin = k_sin.data() + r * half;
          }
          return row;
        },
        static_cast<T*>(which == 0 ? kernels_.k_stage() : kernels_.v_stage()));
  }
}

template <typename T>
void AttentionLayer::Impl::ConcatHeads(const SequenceLayout& layout, const SdpaCall& call,
                                       int64_t first, int64_t n) {
  const int64_t heads = config_.num_heads;
  const int64_t hd = config_.head_dim;
  const int64_t s = call.q_len;
  const int64_t q_width = config_.q_width();
  const float* const context = context_heads_.floats();
  T* const out = static_cast<T*>(context_tokens_.data());
#pragma omp parallel for schedule(static) if (n * s * q_width > (int64_t{1} << 14))
  for (int64_t item = 0; item < n * s; ++item) {
    const int64_t c = item / s;
    const int64_t pos = item % s;
    const int64_t b = first + c;
    if (pos >= layout.length(b)) continue;
    T* const row = out + (layout.row_offset(b) + pos) * q_width;
    for (int64_t h = 0; h < heads; ++h) {
      Store(context + ((c * heads + h) * s + pos) * hd, hd, row + h * hd);
    }
  }
}

void AttentionLayer::Impl::Contributions(const SdpaCall& call, int64_t first, int64_t n,
                                         absl::Span<float> out) {
  const int64_t heads = config_.num_heads;
  const int64_t hd = config_.head_dim;
  const int64_t d = config_.d_model;
  const int64_t s = call.q_len;
  const bool use_gram = hd <= d;
  if (use_gram && w_o_gram_.empty()) {
    // Once per layer: Gram_h[a][b] = sum_k W_o[h*hd + a][k] W_o[h*hd + b][k].
    w_o_gram_.resize(static_cast<size_t>(heads * hd * hd));
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < heads * hd; ++row) {
      const int64_t h = row / hd;
      const float* const wa = w_o_.data() + row * d;
      for (int64_t bcol = 0; bcol < hd; ++bcol) {
        const float* const wb = w_o_.data() + (h * hd + bcol) * d;
        double sum = 0.0;
        for (int64_t k = 0; k < d; ++k) sum += static_cast<double>(wa[k]) * wb[k];
        w_o_gram_[row * hd + bcol] = sum;
      }
    }
  }
  const float* const context = context_heads_.floats();
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < n * heads; ++item) {
    const int64_t c = item / heads;
    const int64_t h = item % heads;
    const int64_t b = first + c;
    double sum = 0.0;
    for (int64_t pos = 0; pos < call.q_lengths[b]; ++pos) {
      const float* const x = context + (item * s + pos) * hd;
      if (use_gram) {
        // ||x W^O_h||^2 = x Gram_h x^T.
        const double* const gram = w_o_gram_.data() + h * hd * hd;
        for (int64_t a = 0; a < hd; ++a) {
          double row = 0.0;
          for (int64_t k = 0; k < hd; ++k) row += gram[a * hd + k] * x[k];
          sum += row * x[a];
        }
      } else {
        // ||x W^O_h||^2 column by column (cheaper than the Gram matrix here).
        const float* const w = w_o_.data() + h * hd * d;
        for (int64_t k = 0; k < d; ++k) {
          double y = 0.0;
          for (int64_t a = 0; a < hd; ++a) y += static_cast<double>(x[a]) * w[a * d + k];
          sum += y * y;
        }
      }
    }
    out[b * heads + h] = static_cast<float>(std::sqrt(std::max(sum, 0.0)));
  }
}

void AttentionLayer::Impl::MakeBf16Weights() {
  if (!w_o_bf16_.empty()) return;
  auto convert = [](const std::vector<float>& from, std::vector<Bf16>& to) {
    to.resize(from.size());
    internal::ConvertToBf16(from.data(), static_cast<int64_t>(from.size()), to.data());
  };
  convert(w_qkv_, w_qkv_bf16_);
  convert(w_q_, w_q_bf16_);
  convert(w_kv_, w_kv_bf16_);
  convert(w_o_, w_o_bf16_);
}

AttentionLayer::Impl::InputWeights AttentionLayer::Impl::GetInputWeights(bool bf16) const {
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
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::engine engine, internal::CpuEngine());
  try {
    return std::unique_ptr<AttentionLayer>(new AttentionLayer(
        std::make_unique<Impl>(resolved, std::move(engine), std::move(weights))));
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "creating an attention layer");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory creating an attention layer");
  }
}

AttentionLayer::AttentionLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AttentionLayer::~AttentionLayer() = default;

const HeadConfig& AttentionLayer::config() const { return impl_->config(); }

absl::StatusOr<ForwardInfo> AttentionLayer::Forward(const LayerInputs& inputs,
                                                    const ForwardOptions& options,
                                                    ForwardOutputs outputs) {
  return impl_->Forward(inputs, options, outputs);
}

// ---------------------------------------------------------------------------
// AttentionCore

// Thread-safe like the layer: Run holds mu_ for the whole call.
class AttentionCore::Impl {
 public:
  Impl(const HeadConfig& config, dnnl::engine engine)
      : config_(config), kernels_(config, std::move(engine)) {}

  const HeadConfig& config() const { return config_; }

  absl::StatusOr<ForwardInfo> Run(const CoreInputs& inputs, const ForwardOptions& options,
                                  ForwardOutputs outputs);

 private:
  absl::StatusOr<ForwardInfo> RunLocked(const CoreInputs& inputs, const SequenceLayout& queries,
                                        const SequenceLayout& keys, const ForwardOptions& options,
                                        ForwardOutputs outputs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename T>
  void Stage(const CoreInputs& inputs, const SdpaCall& call, int64_t first, int64_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ShouldStop(const ForwardOptions& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options.should_stop) return false;
    kernels_.Wait();
    return options.should_stop();
  }

  // Constant after construction.
  const HeadConfig config_;  // resolved

  absl::Mutex mu_;
  AttentionKernels kernels_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A core input's lengths: empty (all `len`) or [batch] values in [1, len].
absl::StatusOr<std::vector<int64_t>> CoreLengths(absl::string_view field,
                                                 absl::Span<const int64_t> lengths, int64_t batch,
                                                 absl::string_view len_name, int64_t len) {
  if (lengths.empty()) return std::vector<int64_t>(static_cast<size_t>(batch), len);
  if (static_cast<int64_t>(lengths.size()) != batch) {
    return Invalid(field, absl::StrCat(lengths.size(), " lengths for a batch of ", batch));
  }
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1 || lengths[b] > len) {
      return Invalid(absl::StrCat(field, "[", b, "]"),
                     absl::StrCat(lengths[b], " is outside [1, ", len_name, " ", len, "]"));
    }
  }
  return std::vector<int64_t>(lengths.begin(), lengths.end());
}

}  // namespace

absl::StatusOr<ForwardInfo> AttentionCore::Impl::Run(const CoreInputs& inputs,
                                                     const ForwardOptions& options,
                                                     ForwardOutputs outputs) {
  const struct {
    absl::string_view field;
    int64_t value;
  } dims[] = {{"batch", inputs.batch}, {"q_len", inputs.q_len}, {"kv_len", inputs.kv_len}};
  for (const auto& dim : dims) {
    if (dim.value < 1)
      return Invalid(dim.field, absl::StrCat("must be at least 1, got ", dim.value));
  }
  const int64_t hd = config_.head_dim;
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("q", inputs.q.size(),
                                      {{"batch", inputs.batch},
                                       {"num_heads", config_.num_heads},
                                       {"q_len", inputs.q_len},
                                       {"head_dim", hd}}));
  for (const auto& [field, span] :
       {std::pair<absl::string_view, absl::Span<const float>>{"k", inputs.k}, {"v", inputs.v}}) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(field, span.size(),
                                        {{"batch", inputs.batch},
                                         {"num_kv_heads", config_.num_kv_heads},
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
      const SequenceLayout queries,
      SequenceLayout::Padded(inputs.batch, inputs.q_len, std::move(q_lengths)));
  ATTNSERVE_ASSIGN_OR_RETURN(
      const SequenceLayout keys,
      SequenceLayout::Padded(inputs.batch, inputs.kv_len, std::move(kv_lengths)));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize("output", outputs.output.size(),
                                      {{"batch", inputs.batch},
                                       {"num_heads", config_.num_heads},
                                       {"q_len", inputs.q_len},
                                       {"head_dim", hd}}));
  ATTNSERVE_RETURN_IF_ERROR(ValidateAttention(config_, queries, keys, inputs.mask, inputs.head_mask,
                                              options, outputs,
                                              /*layer=*/false));
  absl::MutexLock lock(&mu_);
  try {
    return RunLocked(inputs, queries, keys, options, outputs);
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "running scaled dot-product attention");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory running scaled dot-product attention");
  }
}

absl::StatusOr<ForwardInfo> AttentionCore::Impl::RunLocked(const CoreInputs& inputs,
                                                           const SequenceLayout& queries,
                                                           const SequenceLayout& keys,
                                                           const ForwardOptions& options,
                                                           ForwardOutputs outputs) {
  if (ShouldStop(options)) return Cancelled();
  const bool bf16 = options.precision == Precision::kBf16 && Bf16Supported();
  const SdpaCall call = MakeCall(config_, queries, keys, inputs.causal, inputs.mask,
                                 inputs.head_mask, options, outputs, bf16);
  const int64_t chunk = kernels_.ChunkSequences(call);
  const bool stage = CoreStages(call, queries, keys);
  ATTNSERVE_RETURN_IF_ERROR(kernels_.ReserveChunk(call, chunk, stage));
  const int64_t q_block = config_.num_heads * call.q_len * config_.head_dim;
  const int64_t kv_block = config_.num_kv_heads * call.kv_len * config_.head_dim;
  for (int64_t first = 0; first < call.batch; first += chunk) {
    if (ShouldStop(options)) return Cancelled();
    const int64_t n = std::min(chunk, call.batch - first);
    const void* q = inputs.q.data() + first * q_block;
    const void* k = inputs.k.data() + first * kv_block;
    const void* v = inputs.v.data() + first * kv_block;
    if (stage) {
      if (bf16) {
        Stage<Bf16>(inputs, call, first, n);
      } else {
        Stage<float>(inputs, call, first, n);
      }
      q = kernels_.q_stage();
      k = kernels_.k_stage();
      v = kernels_.v_stage();
    }
    ATTNSERVE_RETURN_IF_ERROR(
        kernels_.Sdpa(call, first, n, q, k, v, outputs.output.data() + first * q_block));
  }
  kernels_.Wait();
  return MakeInfo(call);
}

template <typename T>
void AttentionCore::Impl::Stage(const CoreInputs& inputs, const SdpaCall& call, int64_t first,
                                int64_t n) {
  const int64_t hd = config_.head_dim;
  auto stage = [&](absl::Span<const float> from, int64_t heads, int64_t len,
                   const std::vector<int64_t>& lengths, void* to) {
    StageHeads(
        n, heads, len, hd, /*half=*/0,
        [&](int64_t c, int64_t h, int64_t pos) {
          HeadRow row;
          const int64_t b = first + c;
          if (pos < lengths[b]) row.values = from.data() + ((b * heads + h) * len + pos) * hd;
          return row;
        },
        static_cast<T*>(to));
  };
  stage(inputs.q, config_.num_heads, call.q_len, call.q_lengths, kernels_.q_stage());
  stage(inputs.k, config_.num_kv_heads, call.kv_len, call.kv_lengths, kernels_.k_stage());
  stage(inputs.v, config_.num_kv_heads, call.kv_len, call.kv_lengths, kernels_.v_stage());
}

absl::StatusOr<std::unique_ptr<AttentionCore>> AttentionCore::Create(const HeadConfig& config) {
  HeadConfig to_resolve = config;
  // d_model is not used: without one, take the heads' width.
  if (to_resolve.d_model == 0 && to_resolve.head_dim > 0 && to_resolve.num_heads > 0 &&
      to_resolve.head_dim <= kMaxHeadDim && to_resolve.num_heads <= kMaxHeads) {
    to_resolve.d_model = std::min(kMaxDModel, to_resolve.num_heads * to_resolve.head_dim);
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const HeadConfig resolved, ResolveHeadConfig(to_resolve));
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::engine engine, internal::CpuEngine());
  try {
    return std::unique_ptr<AttentionCore>(
        new AttentionCore(std::make_unique<Impl>(resolved, std::move(engine))));
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "creating an attention core");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory creating an attention core");
  }
}

AttentionCore::AttentionCore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AttentionCore::~AttentionCore() = default;

const HeadConfig& AttentionCore::config() const { return impl_->config(); }

absl::StatusOr<ForwardInfo> AttentionCore::Run(const CoreInputs& inputs,
                                               const ForwardOptions& options,
                                               ForwardOutputs outputs) {
  return impl_->Run(inputs, options, outputs);
}

}  // namespace attnserve::core
