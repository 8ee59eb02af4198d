#include "server/explorer/seeded_hidden_states.h"

#include <vector>

#include "core/attention_weights.h"

namespace attnserve::server {

std::vector<float> SeededHiddenStates(uint64_t seed, int64_t seq_len, int64_t d_model) {
  const int64_t n = seq_len * d_model;
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double u = core::SeededUniform(seed, kHiddenStatesStream, static_cast<uint64_t>(i));
    values[static_cast<size_t>(i)] = static_cast<float>(2.0 * u - 1.0);
  }
  return values;
}

}  // namespace attnserve::server
