#ifndef ATTNSERVE_CORE_VALIDATION_H_
#define ATTNSERVE_CORE_VALIDATION_H_

// The checks of a forward's inputs, each rule written once. AttentionLayer and
// AttentionCore call them before anything is allocated; a server calls them
// with its wire's field names (each check names what it rejects under the
// caller's `field`, e.g. "mask.values[3]: NaN" for field "mask"), keeping only
// the checks of its own wire format. Every error is INVALID_ARGUMENT.
// Thread-safe.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/bf16.h"
#include "core/head_config.h"

namespace attnserve::core {

// RoPE positions (position_offsets, and a sequence's last position) are at
// most this, so that position * frequency stays exact to well under a
// milli-radian in double precision and the cos/sin tables stay accurate.
constexpr int64_t kMaxPositionOffset = int64_t{1} << 30;

// Element counts up to this are safe to index and to size in bytes.
constexpr int64_t kMaxElements = INT64_MAX / 16;

// INVALID_ARGUMENT "<field>: <message>".
absl::Status InvalidField(absl::string_view field, absl::string_view message);

// OK when `actual` elements are the product of `dims` (each a name and a size);
// otherwise names the field, the dims and their product (or the overflow).
absl::Status CheckSize(absl::string_view field, size_t actual,
                       std::initializer_list<std::pair<absl::string_view, int64_t>> dims);

// An explicit mask for a batch of `batch` with q_len queries and kv_len keys:
// its kind, each dim 1 or full (ValidateMaskDims), its size, and values
// (ValidateMaskValues). Errors name `field`.kind, .batch_dim, .values[i], ...
absl::Status ValidateMask(const ExplicitMask& mask, int64_t batch, int64_t q_len, int64_t kv_len,
                          absl::string_view field = "mask");

// A mask's dims [batch_dim, q_dim, kv_dim]: each 1 (broadcast) or full,
// [batch, q_len, kv_len]. `dim_fields` names each dim in errors (a server
// passes its wire's names, e.g. "mask.values.shape[1] (seq_q)").
absl::Status ValidateMaskDims(const std::array<int64_t, 3>& dims, int64_t batch, int64_t q_len,
                              int64_t kv_len, const std::array<absl::string_view, 3>& dim_fields);

// A mask's values: no NaN, and no +inf in an additive mask (-inf forbids a
// key). Errors name `field`[i]. The Bf16 form reads the bits as sent (a
// server checks BF16 wire values without converting them); BF16 and FP32 give
// the same verdict and message for the same value.
absl::Status ValidateMaskValues(absl::Span<const float> values, ExplicitMask::Kind kind,
                                absl::string_view field);
absl::Status ValidateMaskValues(absl::Span<const Bf16> values, ExplicitMask::Kind kind,
                                absl::string_view field);

// The inputs a forward reads are finite: a NaN or infinity in a real token
// would only come back as NaN. `values` is [batch, blocks, rows, width]: rows
// are the layout's padded rows (or its packed rows, with blocks 1); blocks is
// 1 for states and the head count for projected heads. Padding may hold
// anything (it is never read into a result). Errors name `field`, the
// sequence (and head, when blocks > 1) and the position. One pass over the
// real rows; the Bf16 form tests the exponent bits without converting.
absl::Status ValidateFinite(absl::Span<const float> values, const SequenceLayout& layout,
                            int64_t blocks, int64_t width, absl::string_view field);
absl::Status ValidateFinite(absl::Span<const Bf16> values, const SequenceLayout& layout,
                            int64_t blocks, int64_t width, absl::string_view field);

// kFp32 or kBf16; errors name `field`.
absl::Status ValidatePrecision(Precision precision, absl::string_view field = "precision");

// Empty, or [num_heads] values each finite and >= 0.
absl::Status ValidateHeadMask(absl::Span<const float> head_mask, int64_t num_heads,
                              absl::string_view field = "head_mask");

// A RoPE position in [0, kMaxPositionOffset]; errors name `field` (or
// `field`[index] when index >= 0).
absl::Status ValidatePosition(int64_t position, absl::string_view field, int64_t index = -1);

// Empty, or [batch] RoPE positions each in [0, kMaxPositionOffset]
// (ValidatePosition); a layer without rotary embeddings (rotary_dim 0) takes
// none.
absl::Status ValidatePositionOffsets(absl::Span<const int64_t> offsets, int64_t batch,
                                     int64_t rotary_dim,
                                     absl::string_view field = "position_offsets");

// Elements of the attention maps `maps` asks for, for queries in `queries`
// and keys in `keys` (the queries' layout again in self-attention), or
// nullopt on int64 overflow.
std::optional<int64_t> AttentionMapElements(const HeadConfig& config, const SequenceLayout& queries,
                                            const SequenceLayout& keys, const MapSelection& maps);

// A map selection for num_heads heads and q_len query rows (the queries'
// max_length): a known mode; heads only per head, at most num_heads of them,
// each in [0, num_heads); query rows only with maps, at most q_len of them,
// each in [0, q_len). Errors name `field`.mode, `field`.heads[i],
// `field`.query_rows[i] (a server passes "attention_maps").
absl::Status ValidateMapSelection(const MapSelection& maps, int64_t num_heads, int64_t q_len,
                                  absl::string_view field = "maps");

// The options of a forward with these layouts: precision, attention path
// (kBlocked returns neither maps nor statistics), block sizes, block kernels
// and the map selection (ValidateMapSelection). Errors name "precision",
// "attention_path", "maps.heads[i]", ... under `field` when it is not empty
// ("<field>.maps.heads[i]").
absl::Status ValidateForwardOptions(const HeadConfig& config, const SequenceLayout& queries,
                                    const ForwardOptions& options, absl::string_view field = "");

// The sizes of the outputs a forward fills: attention_maps as the options ask,
// the head statistics ([batch, num_heads] each when asked, else empty;
// head_contribution only when `layer`). And the attention's own size: the
// scores of one sequence, num_heads * S * T, fit kMaxElements.
absl::Status ValidateAttentionOutputs(const HeadConfig& config, const SequenceLayout& queries,
                                      const SequenceLayout& keys, const ForwardOptions& options,
                                      const ForwardOutputs& outputs, bool layer);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_VALIDATION_H_
