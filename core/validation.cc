#include "core/validation.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/checked_math.h"
#include "core/kernels/simd.h"
#include "core/status_macros.h"

namespace attnserve::core {
namespace {

// "<field>.<name>", or <name> alone when field is empty.
std::string Sub(absl::string_view field, absl::string_view name) {
  return field.empty() ? std::string(name) : absl::StrCat(field, ".", name);
}

std::string Dims(std::initializer_list<std::pair<absl::string_view, int64_t>> dims) {
  std::string out = "[";
  for (const auto& [name, value] : dims) {
    absl::StrAppend(&out, out.size() > 1 ? ", " : "", name, " ", value);
  }
  return absl::StrCat(out, "]");
}

absl::Status CheckEmpty(absl::string_view field, size_t size, absl::string_view why) {
  if (size == 0) return absl::OkStatus();
  return InvalidField(field, absl::StrCat("must be empty (", why, "), got ", size, " elements"));
}

// Non-finite: the exponent's bits all set (infinity or NaN).
bool NonFinite(float value) {
  return (std::bit_cast<uint32_t>(value) & 0x7f800000u) == 0x7f800000u;
}
bool NonFinite(Bf16 value) { return (value & 0x7f80u) == 0x7f80u; }
// Whether any of values[0, n) is not finite: the largest exponent field is all
// ones. One vectorized pass (SIMD max), no branch per value, in the CPU's
// widest vectors: it reads every request's inputs on the gRPC thread before
// they are queued, so it is part of each call's transport time (3 MB at B=8
// S=128: 0.28 ms in the baseline SSE2 build, 0.12 ms in the AVX-512 clone;
// docs/measurements.md, "Where the transport time goes").
ATTNSERVE_CLONES bool AnyNonFinite(const float* values, int64_t n) {
  uint32_t largest = 0;
#pragma omp simd reduction(max : largest)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t exponent = std::bit_cast<uint32_t>(values[i]) & 0x7f800000u;
    largest = exponent > largest ? exponent : largest;
  }
  return largest == 0x7f800000u;
}
ATTNSERVE_CLONES bool AnyNonFinite(const Bf16* values, int64_t n) {
  uint16_t largest = 0;
#pragma omp simd reduction(max : largest)
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t exponent = static_cast<uint16_t>(values[i] & 0x7f80u);
    largest = exponent > largest ? exponent : largest;
  }
  return largest == 0x7f80u;
}
float AsFloat(float value) { return value; }
float AsFloat(Bf16 value) { return Bfloat16ToFloat(value); }

template <typename T>
absl::Status MaskValues(absl::Span<const T> values, ExplicitMask::Kind kind,
                        absl::string_view field) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!NonFinite(values[i])) continue;
    const float value = AsFloat(values[i]);
    if (std::isnan(value)) return InvalidField(absl::StrCat(field, "[", i, "]"), "NaN");
    if (kind == ExplicitMask::Kind::kAdditive && value > 0.0f) {
      return InvalidField(absl::StrCat(field, "[", i, "]"),
                          "+inf (an additive mask takes finite values, or -inf to forbid a key)");
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Finite(absl::Span<const T> values, const SequenceLayout& layout, int64_t blocks,
                    int64_t width, absl::string_view field) {
  const int64_t block_rows = layout.is_padded() ? layout.max_length() : 0;
  for (int64_t b = 0; b < layout.batch(); ++b) {
    for (int64_t h = 0; h < blocks; ++h) {
      // Padded: sequence b's block h starts at (b * blocks + h) * padded rows.
      const int64_t first_row =
          layout.is_padded() ? (b * blocks + h) * block_rows : layout.row_offset(b);
      const T* row = values.data() + first_row * width;
      const int64_t n = layout.length(b) * width;
      // The position is looked for on a hit only.
      if (!AnyNonFinite(row, n)) continue;
      int64_t i = 0;
      while (!NonFinite(row[i])) ++i;
      return InvalidField(field, absl::StrCat("sequence ", b, blocks > 1 ? absl::StrCat(", head ", h) : "",
                                              " holds ", AsFloat(row[i]), " at position ", i / width,
                                              "; inputs must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status InvalidField(absl::string_view field, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

absl::Status CheckSize(absl::string_view field, size_t actual,
                       std::initializer_list<std::pair<absl::string_view, int64_t>> dims) {
  std::vector<int64_t> values;
  for (const auto& dim : dims) values.push_back(dim.second);
  const std::optional<int64_t> expected = CheckedProduct(values);
  if (!expected || *expected > kMaxElements) {
    return InvalidField(field, absl::StrCat(Dims(dims), " overflows int64"));
  }
  if (static_cast<int64_t>(actual) == *expected) return absl::OkStatus();
  return InvalidField(field,
                 absl::StrCat("size ", actual, " does not match ", Dims(dims), " = ", *expected));
}

absl::Status ValidateMask(const ExplicitMask& mask, int64_t batch, int64_t q_len, int64_t kv_len,
                          absl::string_view field) {
  switch (mask.kind) {
    case ExplicitMask::Kind::kNone:
      return CheckEmpty(Sub(field, "values"), mask.values.size(), "mask.kind is kNone");
    case ExplicitMask::Kind::kAllowed:
    case ExplicitMask::Kind::kAdditive:
      break;
    default:
      return InvalidField(Sub(field, "kind"), absl::StrCat("unknown value ", static_cast<int>(mask.kind)));
  }
  ATTNSERVE_RETURN_IF_ERROR(ValidateMaskDims(
      {mask.batch_dim, mask.q_dim, mask.kv_dim}, batch, q_len, kv_len,
      {Sub(field, "batch_dim"), Sub(field, "q_dim"), Sub(field, "kv_dim")}));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize(Sub(field, "values"), mask.values.size(),
                {{"batch_dim", mask.batch_dim}, {"q_dim", mask.q_dim}, {"kv_dim", mask.kv_dim}}));
  return ValidateMaskValues(mask.values, mask.kind, Sub(field, "values"));
}

absl::Status ValidateMaskDims(const std::array<int64_t, 3>& dims, int64_t batch, int64_t q_len,
                              int64_t kv_len, const std::array<absl::string_view, 3>& dim_fields) {
  const struct {
    absl::string_view full_name;
    int64_t full;
  } full[] = {{"the batch", batch}, {"the queries' max_length", q_len}, {"the keys' max_length", kv_len}};
  for (size_t d = 0; d < 3; ++d) {
    if (dims[d] != 1 && dims[d] != full[d].full) {
      return InvalidField(dim_fields[d], absl::StrCat("must be 1 or ", full[d].full_name, " ",
                                                      full[d].full, ", got ", dims[d]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateMaskValues(absl::Span<const float> values, ExplicitMask::Kind kind,
                                absl::string_view field) {
  return MaskValues(values, kind, field);
}

absl::Status ValidateMaskValues(absl::Span<const Bf16> values, ExplicitMask::Kind kind,
                                absl::string_view field) {
  return MaskValues(values, kind, field);
}

absl::Status ValidateFinite(absl::Span<const float> values, const SequenceLayout& layout,
                            int64_t blocks, int64_t width, absl::string_view field) {
  return Finite(values, layout, blocks, width, field);
}

absl::Status ValidateFinite(absl::Span<const Bf16> values, const SequenceLayout& layout,
                            int64_t blocks, int64_t width, absl::string_view field) {
  return Finite(values, layout, blocks, width, field);
}

absl::Status ValidatePrecision(Precision precision, absl::string_view field) {
  if (precision != Precision::kFp32 && precision != Precision::kBf16) {
    return InvalidField(field, absl::StrCat("unknown value ", static_cast<int>(precision)));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeadMask(absl::Span<const float> head_mask, int64_t num_heads,
                              absl::string_view field) {
  if (head_mask.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(head_mask.size()) != num_heads) {
    return InvalidField(field,
                   absl::StrCat(head_mask.size(), " values for num_heads ", num_heads));
  }
  for (size_t h = 0; h < head_mask.size(); ++h) {
    if (!std::isfinite(head_mask[h]) || head_mask[h] < 0.0f) {
      return InvalidField(absl::StrCat(field, "[", h, "]"),
                     absl::StrCat("must be finite and >= 0, got ", head_mask[h]));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePositionOffsets(absl::Span<const int64_t> offsets, int64_t batch,
                                     int64_t rotary_dim, absl::string_view field) {
  if (offsets.empty()) return absl::OkStatus();
  if (rotary_dim == 0) {
    return InvalidField(field, "the layer has no rotary embeddings (rotary_dim 0)");
  }
  if (static_cast<int64_t>(offsets.size()) != batch) {
    return InvalidField(field, absl::StrCat(offsets.size(), " offsets for a batch of ", batch));
  }
  for (size_t b = 0; b < offsets.size(); ++b) {
    ATTNSERVE_RETURN_IF_ERROR(ValidatePosition(offsets[b], field, static_cast<int64_t>(b)));
  }
  return absl::OkStatus();
}

absl::Status ValidatePosition(int64_t position, absl::string_view field, int64_t index) {
  if (position < 0 || position > kMaxPositionOffset) {
    return InvalidField(index >= 0 ? absl::StrCat(field, "[", index, "]") : std::string(field),
                        absl::StrCat(position, " is outside [0, ", kMaxPositionOffset, "]"));
  }
  return absl::OkStatus();
}

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

absl::Status ValidateForwardOptions(const HeadConfig& config, const SequenceLayout& queries,
                                    const ForwardOptions& options, absl::string_view field) {
  ATTNSERVE_RETURN_IF_ERROR(ValidatePrecision(options.precision, Sub(field, "precision")));
  switch (options.attention_path) {
    case AttentionPath::kAuto:
    case AttentionPath::kMaterialized:
      break;
    case AttentionPath::kBlocked:
      if (options.maps.mode != AttentionMapMode::kNone || options.head_statistics) {
        return InvalidField(Sub(field, "attention_path"),
                            "the blocked path returns neither maps nor head statistics (ask for "
                            "kMaterialized or kAuto)");
      }
      break;
    default:
      return InvalidField(Sub(field, "attention_path"),
                          absl::StrCat("unknown value ", static_cast<int>(options.attention_path)));
  }
  if (options.block_kernels != BlockKernels::kAuto &&
      options.block_kernels != BlockKernels::kOneDnn) {
    return InvalidField(Sub(field, "block_kernels"),
                        absl::StrCat("unknown value ", static_cast<int>(options.block_kernels)));
  }
  if (options.block_queries < 0 || options.block_keys < 0) {
    return InvalidField(Sub(field, options.block_queries < 0 ? "block_queries" : "block_keys"),
                        "must be >= 0 (0: the core's choice)");
  }

  return ValidateMapSelection(options.maps, config.num_heads, queries.max_length(),
                              Sub(field, "maps"));
}

absl::Status ValidateMapSelection(const MapSelection& maps, int64_t num_heads, int64_t q_len,
                                  absl::string_view field) {
  const std::string heads_field = Sub(field, "heads");
  const std::string rows_field = Sub(field, "query_rows");
  switch (maps.mode) {
    case AttentionMapMode::kNone:
      ATTNSERVE_RETURN_IF_ERROR(CheckEmpty(heads_field, maps.heads.size(), "no maps asked for"));
      ATTNSERVE_RETURN_IF_ERROR(CheckEmpty(rows_field, maps.query_rows.size(), "no maps asked for"));
      break;
    case AttentionMapMode::kMeanOverHeads:
      ATTNSERVE_RETURN_IF_ERROR(
          CheckEmpty(heads_field, maps.heads.size(), "mean maps average over all heads"));
      break;
    case AttentionMapMode::kPerHead:
      break;
    default:
      return InvalidField(Sub(field, "mode"),
                          absl::StrCat("unknown value ", static_cast<int>(maps.mode)));
  }
  if (static_cast<int64_t>(maps.heads.size()) > num_heads) {
    return InvalidField(heads_field,
                        absl::StrCat(maps.heads.size(), " heads asked of num_heads ", num_heads));
  }
  for (size_t i = 0; i < maps.heads.size(); ++i) {
    if (maps.heads[i] < 0 || maps.heads[i] >= num_heads) {
      return InvalidField(absl::StrCat(heads_field, "[", i, "]"),
                          absl::StrCat(maps.heads[i], " is outside [0, num_heads ", num_heads, ")"));
    }
  }
  if (static_cast<int64_t>(maps.query_rows.size()) > q_len) {
    return InvalidField(rows_field,
                        absl::StrCat(maps.query_rows.size(), " rows asked of max_length ", q_len));
  }
  for (size_t i = 0; i < maps.query_rows.size(); ++i) {
    if (maps.query_rows[i] < 0 || maps.query_rows[i] >= q_len) {
      return InvalidField(absl::StrCat(rows_field, "[", i, "]"),
                          absl::StrCat(maps.query_rows[i], " is outside [0, max_length ", q_len, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateAttentionOutputs(const HeadConfig& config, const SequenceLayout& queries,
                                      const SequenceLayout& keys, const ForwardOptions& options,
                                      const ForwardOutputs& outputs, bool layer) {
  const int64_t batch = queries.batch();
  const int64_t s = queries.max_length();
  const int64_t t = keys.max_length();
  const std::optional<int64_t> scores = CheckedProduct({config.num_heads, s, t});
  if (!scores || *scores > kMaxElements) {
    return InvalidField("layout", absl::StrCat("num_heads ", config.num_heads, " * max_length ", s,
                                               " * keys' max_length ", t, " is too large"));
  }
  const MapSelection& maps = options.maps;
  const std::optional<int64_t> map_elements = AttentionMapElements(config, queries, keys, maps);
  if (!map_elements || *map_elements > kMaxElements) {
    return InvalidField("attention_maps", "the maps asked for overflow int64");
  }
  if (static_cast<int64_t>(outputs.attention_maps.size()) != *map_elements) {
    return InvalidField(
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

}  // namespace attnserve::core
