#ifndef ATTNSERVE_TESTS_CORE_DECODE_DECODE_REFERENCE_H_
#define ATTNSERVE_TESTS_CORE_DECODE_DECODE_REFERENCE_H_

// The decode tests' reference (header-only; the test binaries bring
// GoogleTest): a sequence's keys and values as they were appended, kept apart
// from the cache, and the rows of full causal attention over them, straight
// from the math in double precision.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "tests/core/reference_attention.h"

namespace attnserve::testing {

// Every token's K and V of one sequence: [length, num_kv_heads, head_dim].
struct SequenceHistory {
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  std::vector<float> k, v;

  int64_t length() const { return static_cast<int64_t>(k.size()) / (num_kv_heads * head_dim); }
  void Append(absl::Span<const float> new_k, absl::Span<const float> new_v) {
    k.insert(k.end(), new_k.begin(), new_k.end());
    v.insert(v.end(), new_v.begin(), new_v.end());
  }
  void Truncate(int64_t length) {
    k.resize(static_cast<size_t>(length * num_kv_heads * head_dim));
    v.resize(k.size());
  }
};

// The last n query rows of causal attention over a whole sequence of L =
// history.length() tokens, row i at position L - n + i:
//   s_ij = q_ih . K_g[j] * scale for j <= L - n + i (g = h / (heads / kv_heads)),
//   P_i = softmax(s_i), out_ih = sum_j P_ij V_g[j].
struct DecodeReference {
  std::vector<double> out;   // [n, heads, head_dim]
  std::vector<double> maps;  // [heads, n, L], 0 past each row's position
};

// `bf16_kv`: K and V rounded to BF16 (to nearest even) first, as a BF16 cache
// holds them.
inline DecodeReference ReferenceDecodeRows(const SequenceHistory& history,
                                           absl::Span<const float> q, int64_t n, int64_t heads,
                                           double scale, bool bf16_kv) {
  const int64_t length = history.length(), hd = history.head_dim;
  const int64_t kv_heads = history.num_kv_heads, group = heads / kv_heads;
  auto value = [&](const std::vector<float>& kv, int64_t j, int64_t g, int64_t e) {
    const double x = kv[static_cast<size_t>((j * kv_heads + g) * hd + e)];
    return bf16_kv ? RoundToBf16(x) : x;
  };
  DecodeReference r;
  r.out.assign(static_cast<size_t>(n * heads * hd), 0.0);
  r.maps.assign(static_cast<size_t>(heads * n * length), 0.0);
  std::vector<double> s(static_cast<size_t>(length));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t visible = length - n + i + 1;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      double max_s = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        double dot = 0.0;
        for (int64_t e = 0; e < hd; ++e) {
          dot += static_cast<double>(q[static_cast<size_t>((i * heads + h) * hd + e)]) *
                 value(history.k, j, g, e);
        }
        s[static_cast<size_t>(j)] = dot * scale;
        max_s = std::max(max_s, dot * scale);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < visible; ++j) sum += std::exp(s[static_cast<size_t>(j)] - max_s);
      double* out = &r.out[static_cast<size_t>((i * heads + h) * hd)];
      double* map = &r.maps[static_cast<size_t>((h * n + i) * length)];
      for (int64_t j = 0; j < visible; ++j) {
        const double p = std::exp(s[static_cast<size_t>(j)] - max_s) / sum;
        map[j] = p;
        for (int64_t e = 0; e < hd; ++e) out[e] += p * value(history.v, j, g, e);
      }
    }
  }
  return r;
}

// max_i |actual_i - expected_i| / max_i |expected_i|: the error relative to
// the largest magnitude (infinity when sizes differ or actual is not finite).
inline double MaxAbsErrorRelative(absl::Span<const float> actual,
                                  absl::Span<const double> expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double max_error = 0.0, max_expected = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return std::numeric_limits<double>::infinity();
    max_error = std::max(max_error, std::abs(actual[i] - expected[i]));
    max_expected = std::max(max_expected, std::abs(expected[i]));
  }
  return max_expected > 0.0 ? max_error / max_expected : max_error;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_DECODE_DECODE_REFERENCE_H_
