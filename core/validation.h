#ifndef ATTNSERVE_CORE_VALIDATION_H_
#define ATTNSERVE_CORE_VALIDATION_H_

// The checks of a forward's inputs, each rule written once. AttentionLayer and
// AttentionCore call them before anything is allocated; a server calls them
// with its wire's field names (each check names what it rejects under the
// caller's `field`, e.g. "mask.values[3]: NaN" for field "mask"), keeping only
// the checks of its own wire format. Every error is INVALID_ARGUMENT.
// Thread-safe.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
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
// its kind, each dim 1 or full, its size, and values (no NaN; no +inf in an
// additive mask). Errors name `field`.kind, .batch_dim, .values[i], ...
absl::Status ValidateMask(const ExplicitMask& mask, int64_t batch, int64_t q_len, int64_t kv_len,
                          absl::string_view field = "mask");

// Empty, or [num_heads] values each finite and >= 0.
absl::Status ValidateHeadMask(absl::Span<const float> head_mask, int64_t num_heads,
                              absl::string_view field = "head_mask");

// Empty, or [batch] RoPE positions each in [0, kMaxPositionOffset].
absl::Status ValidatePositionOffsets(absl::Span<const int64_t> offsets, int64_t batch,
                                     absl::string_view field = "position_offsets");

// Elements of the attention maps `maps` asks for, for queries in `queries`
// and keys in `keys` (the queries' layout again in self-attention), or
// nullopt on int64 overflow.
std::optional<int64_t> AttentionMapElements(const HeadConfig& config, const SequenceLayout& queries,
                                            const SequenceLayout& keys, const MapSelection& maps);

// The options of a forward with these layouts: precision, attention path
// (kBlocked returns neither maps nor statistics), block sizes, and the map
// selection (mode; heads in [0, num_heads), each at most once; query rows in
// [0, max_length)). Errors name "precision", "attention_path", "maps.heads[i]",
// ... under `field` when it is not empty ("<field>.maps.heads[i]").
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
