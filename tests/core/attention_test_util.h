#ifndef ATTNSERVE_TESTS_CORE_ATTENTION_TEST_UTIL_H_
#define ATTNSERVE_TESTS_CORE_ATTENTION_TEST_UTIL_H_

// Random inputs for the attention tests (header-only; the test binaries bring
// GoogleTest).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/attention_inputs.h"
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::testing {

// FP32 and BF16 against the double-precision reference (relative Frobenius).
inline constexpr double kFp32Tolerance = 1e-5;
inline constexpr double kBf16Tolerance = 2e-2;
// BF16 against the double reference fed the same BF16-rounded operands
// (ReferenceLayerWithBf16Operands). Left between them: FP32 accumulation,
// and the BF16 softmax's degree-4 exponential (relative error 4.2e-5) sending
// a probability's rounding to the other neighbour now and then; modelled in
// FP32 on shapes like attention_layer_bf16_test's it stayed below 1e-3. On
// 2400 fresh cases of that test's shapes, truncating the operands instead of
// rounding them moved the reference 1.1e-2 to 2.0e-2, and the unrounded
// reference lay 2.3e-3 to 5.0e-3 away (kBf16Tolerance is four times that).
inline constexpr double kBf16RoundedOperandsTolerance = 2e-3;

// A fresh seed per run; tests print it (SCOPED_TRACE(SeedTrace(seed))) so that
// a failure can be reproduced.
inline uint64_t FreshSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

inline std::string SeedTrace(uint64_t seed) { return absl::StrCat("random seed ", seed); }

inline std::vector<float> RandomNormal(size_t n, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<float> values(n);
  for (float& v : values) v = static_cast<float>(normal(rng));
  return values;
}

// Random weights of the usual magnitude (uniform in +-1/sqrt(fan_in)),
// independent of SeededWeights. `config` must be resolved.
inline core::AttentionWeights RandomWeights(const core::HeadConfig& config, std::mt19937_64& rng) {
  auto uniform = [&rng](size_t n, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::uniform_real_distribution<double> dist(-bound, bound);
    std::vector<float> values(n);
    for (float& v : values) v = static_cast<float>(dist(rng));
    return values;
  };
  const size_t d = static_cast<size_t>(config.d_model);
  const size_t c = static_cast<size_t>(config.context_dim);
  const size_t q = static_cast<size_t>(config.q_width());
  const size_t kv = static_cast<size_t>(config.kv_width());
  core::AttentionWeights w;
  w.w_q = uniform(d * q, config.d_model);
  w.b_q = uniform(q, config.d_model);
  w.w_k = uniform(c * kv, config.context_dim);
  w.b_k = uniform(kv, config.context_dim);
  w.w_v = uniform(c * kv, config.context_dim);
  w.b_v = uniform(kv, config.context_dim);
  w.w_o = uniform(q * d, config.q_width());
  w.b_o = uniform(d, config.q_width());
  return w;
}

// Token-major states [layout.rows(), width]: random rows for the tokens,
// `padding` in the padding rows.
inline std::vector<float> RandomStates(const core::SequenceLayout& layout, int64_t width,
                                       std::mt19937_64& rng,
                                       float padding = std::numeric_limits<float>::quiet_NaN()) {
  std::vector<float> states(static_cast<size_t>(layout.rows() * width), padding);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t b = 0; b < layout.batch(); ++b) {
    for (int64_t i = 0; i < layout.length(b) * width; ++i) {
      states[layout.row_offset(b) * width + i] = static_cast<float>(normal(rng));
    }
  }
  return states;
}

// The rows of sequence b of a token-major matrix [layout.rows(), width].
inline std::vector<float> SequenceRows(const std::vector<float>& matrix,
                                       const core::SequenceLayout& layout, int64_t b,
                                       int64_t width) {
  const auto begin = matrix.begin() + layout.row_offset(b) * width;
  return std::vector<float>(begin, begin + layout.length(b) * width);
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_ATTENTION_TEST_UTIL_H_
