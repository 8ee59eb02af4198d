#include "server/explorer/max_pool_grid.h"

#include <algorithm>
#include <vector>

namespace attnserve::server {

MaxPoolGrid::MaxPoolGrid(int64_t num_heads, int64_t seq_len, int64_t grid)
    : num_heads_(num_heads),
      seq_len_(seq_len),
      pool_((seq_len + grid - 1) / grid),
      rows_((seq_len + pool_ - 1) / pool_),
      cols_(rows_),
      cells_(static_cast<size_t>(num_heads * rows_ * cols_), -1.0f) {}

void MaxPoolGrid::AddRows(absl::Span<const int64_t> query_rows, absl::Span<const float> maps,
                          const CellMask& mask) {
  const int64_t n = static_cast<int64_t>(query_rows.size());
  for (int64_t h = 0; h < num_heads_; ++h) {
    for (int64_t r = 0; r < n; ++r) {
      const int64_t q = query_rows[static_cast<size_t>(r)];
      const float* row = maps.data() + (h * n + r) * seq_len_;
      float* cells = cells_.data() + (h * rows_ + q / pool_) * cols_;
      for (int64_t k = 0; k < seq_len_; ++k) {
        if (mask.masked(q, k)) continue;
        float& cell = cells[k / pool_];
        cell = std::max(cell, row[k]);
      }
    }
  }
}

}  // namespace attnserve::server
