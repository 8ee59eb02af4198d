#ifndef ATTNSERVE_SERVER_EXPLORER_CELL_MASK_H_
#define ATTNSERVE_SERVER_EXPLORER_CELL_MASK_H_

#include <cstdint>
#include <vector>

namespace attnserve::server {

// Which cells (query q, key k) of a self-attention map are masked out: a
// causal layer's future keys (k > q) and the keys a key mask removes for
// every query. The explorer draws such cells as -1 (a weight of 0 there is
// the mask's, not the model's). A value type; thread-compatible.
class CellMask {
 public:
  // `key_allowed`: one entry per key, 0 = masked; empty: every key allowed.
  CellMask(bool causal, std::vector<uint8_t> key_allowed)
      : causal_(causal), key_allowed_(std::move(key_allowed)) {}

  bool masked(int64_t query, int64_t key) const {
    return (causal_ && key > query) ||
           (!key_allowed_.empty() && key_allowed_[static_cast<size_t>(key)] == 0);
  }

 private:
  bool causal_;
  std::vector<uint8_t> key_allowed_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_CELL_MASK_H_
