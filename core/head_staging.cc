#include "core/head_staging.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace attnserve::core::internal {

void RotaryTables(const SequenceLayout& layout, absl::Span<const int64_t> first_positions,
                  absl::Span<const double> inverse_frequencies, float* cos, float* sin) {
  const int64_t half = static_cast<int64_t>(inverse_frequencies.size());
  for (int64_t b = 0; b < layout.batch(); ++b) {
    const int64_t first_position = first_positions.empty() ? 0 : first_positions[b];
    const int64_t offset = layout.row_offset(b);
    const int64_t length = layout.length(b);
#pragma omp parallel for schedule(static) if (length * half > 4096)
    for (int64_t i = 0; i < length; ++i) {
      const double position = static_cast<double>(first_position + i);
      float* const c = cos + (offset + i) * half;
      float* const s = sin + (offset + i) * half;
      for (int64_t k = 0; k < half; ++k) {
        const double angle = position * inverse_frequencies[k];
        c[k] = static_cast<float>(std::cos(angle));
        s[k] = static_cast<float>(std::sin(angle));
      }
    }
  }
}


std::vector<double> InverseFrequencies(const RotaryConfig& rotary) {
  std::vector<double> frequencies(static_cast<size_t>(rotary.rotary_dim / 2));
  for (size_t k = 0; k < frequencies.size(); ++k) {
    frequencies[k] =
        std::pow(static_cast<double>(rotary.theta),
                 -2.0 * static_cast<double>(k) / static_cast<double>(rotary.rotary_dim));
  }
  return frequencies;
}

}  // namespace attnserve::core::internal
