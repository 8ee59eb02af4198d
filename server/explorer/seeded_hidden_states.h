#ifndef ATTNSERVE_SERVER_EXPLORER_SEEDED_HIDDEN_STATES_H_
#define ATTNSERVE_SERVER_EXPLORER_SEEDED_HIDDEN_STATES_H_

#include <cstdint>
#include <vector>

namespace attnserve::server {

// The stream of core::SeededUniform the explorer's random inputs draw from
// (the seeded weights use streams 0..7).
inline constexpr uint64_t kHiddenStatesStream = 8;

// Seeded random hidden states [seq_len, d_model], row-major: element i
// (the row-major index) is float32(2 u - 1) with
// u = core::SeededUniform(seed, kHiddenStatesStream, i), a value in [-1, 1)
// with 24 random bits (exact in float32). docs/seeded_weights.md gives the
// generator; docs/explorer.md this use of it. The caller bounds the sizes.
// Thread-safe (no state).
std::vector<float> SeededHiddenStates(uint64_t seed, int64_t seq_len, int64_t d_model);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_SEEDED_HIDDEN_STATES_H_
