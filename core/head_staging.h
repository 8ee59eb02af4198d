#ifndef ATTNSERVE_CORE_HEAD_STAGING_H_
#define ATTNSERVE_CORE_HEAD_STAGING_H_

// Private to core/: copying heads into the kernels' dense, padded operands
// (FP32 or BF16), with rotary position embeddings (RoPE) on the way. Shared by
// AttentionLayer (from its projections) and AttentionCore (from the caller's
// heads).

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/bf16.h"
#include "core/fork_grain.h"
#include "core/head_config.h"

namespace attnserve::core::internal {

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
#pragma omp parallel for schedule(static) if (n * heads * len * hd > kCopyForkGrain)
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
                  absl::Span<const double> inverse_frequencies, float* cos, float* sin);

// theta^(-2k / rotary_dim) for k < rotary_dim / 2.
std::vector<double> InverseFrequencies(const RotaryConfig& rotary);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_HEAD_STAGING_H_
