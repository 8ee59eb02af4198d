#ifndef ATTNSERVE_CORE_KERNELS_ROW_STATISTICS_H_
#define ATTNSERVE_CORE_KERNELS_ROW_STATISTICS_H_

// Private to core/: the head statistics of one row of attention weights, the
// one definition the materialized path (per query row, averaged over rows)
// and a decode session's latest-token read share.

#include <algorithm>
#include <cmath>

#include "absl/types/span.h"

namespace attnserve::core::internal {

struct RowStatistics {
  double entropy = 0.0;    // -sum_j p_j ln p_j (nats); zero weights add nothing
  float max_weight = 0.0f;  // max_j p_j
};

// The statistics of the weights p of one query row (each in [0, 1]).
inline RowStatistics StatisticsOfRow(absl::Span<const float> p) {
  RowStatistics s;
  for (const float w : p) {
    if (w > 0.0f) s.entropy -= static_cast<double>(w) * std::log(static_cast<double>(w));
    s.max_weight = std::max(s.max_weight, w);
  }
  return s;
}

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_ROW_STATISTICS_H_
