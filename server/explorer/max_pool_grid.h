#ifndef ATTNSERVE_SERVER_EXPLORER_MAX_POOL_GRID_H_
#define ATTNSERVE_SERVER_EXPLORER_MAX_POOL_GRID_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "server/explorer/cell_mask.h"

namespace attnserve::server {

// Per-head attention maps [num_heads, seq_len, seq_len] reduced to a grid of
// [num_heads, rows, cols] cells by max-pooling (no peak disappears), fed one
// chunk of query rows at a time so the full maps are never held. With
// pool p = ceil(seq_len / grid) and rows = cols = ceil(seq_len / p), cell
// (i, j) of head h is the largest weight of queries [i p, (i+1) p) and keys
// [j p, (j+1) p) that the mask leaves; -1 when the mask removes every one of
// them. Thread-compatible (one request's).
class MaxPoolGrid {
 public:
  // seq_len >= 1, grid >= 1, num_heads >= 1 (the caller validates).
  MaxPoolGrid(int64_t num_heads, int64_t seq_len, int64_t grid);

  int64_t pool() const { return pool_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }

  // Adds the maps of query rows `query_rows` (each in [0, seq_len)):
  // `maps` is [num_heads, query_rows.size(), seq_len], row-major.
  void AddRows(absl::Span<const int64_t> query_rows, absl::Span<const float> maps,
               const CellMask& mask);

  // [num_heads, rows, cols], row-major.
  const std::vector<float>& cells() const { return cells_; }

 private:
  const int64_t num_heads_;
  const int64_t seq_len_;
  const int64_t pool_;
  const int64_t rows_;
  const int64_t cols_;
  std::vector<float> cells_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_MAX_POOL_GRID_H_
