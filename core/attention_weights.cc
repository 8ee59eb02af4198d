#include "core/attention_weights.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/head_config.h"

namespace attnserve::core {
namespace {

// One tensor of AttentionWeights with its expected shape.
struct TensorSpec {
  absl::string_view name;
  int64_t rows;  // 1 for biases
  int64_t columns;
  int64_t fan_in;  // input width of the projection the tensor belongs to
};

// The tensors in field order; the index is the SeededUniform stream.
std::vector<TensorSpec> TensorSpecs(const HeadConfig& config) {
  const int64_t d = config.d_model;
  const int64_t c = config.context_dim;
  const int64_t q = config.num_heads * config.head_dim;
  const int64_t kv = config.num_kv_heads * config.head_dim;
  return {
      {"w_q", d, q, d},  {"b_q", 1, q, d},  {"w_k", c, kv, c}, {"b_k", 1, kv, c},
      {"w_v", c, kv, c}, {"b_v", 1, kv, c}, {"w_o", q, d, q},  {"b_o", 1, d, q},
  };
}

// The fields of `weights` in the order of TensorSpecs.
std::vector<const std::vector<float>*> Tensors(const AttentionWeights& weights) {
  return {&weights.w_q, &weights.b_q, &weights.w_k, &weights.b_k,
          &weights.w_v, &weights.b_v, &weights.w_o, &weights.b_o};
}

std::vector<std::vector<float>*> Tensors(AttentionWeights& weights) {
  return {&weights.w_q, &weights.b_q, &weights.w_k, &weights.b_k,
          &weights.w_v, &weights.b_v, &weights.w_o, &weights.b_o};
}

// splitmix64's output function (Steele, Lea, Flood 2014).
uint64_t SplitMix64Finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

absl::Status ValidateWeights(const HeadConfig& config, const AttentionWeights& weights) {
  const std::vector<TensorSpec> specs = TensorSpecs(config);
  const std::vector<const std::vector<float>*> tensors = Tensors(weights);
  for (size_t t = 0; t < specs.size(); ++t) {
    const TensorSpec& spec = specs[t];
    const std::vector<float>& tensor = *tensors[t];
    const std::optional<int64_t> expected = CheckedProduct({spec.rows, spec.columns});
    if (!expected) {
      return absl::InvalidArgumentError(absl::StrCat(spec.name, ": expected size overflows int64"));
    }
    if (static_cast<int64_t>(tensor.size()) != *expected) {
      return absl::InvalidArgumentError(
          spec.rows == 1
              ? absl::StrCat(spec.name, ": size ", tensor.size(), " does not match the expected ",
                             *expected)
              : absl::StrCat(spec.name, ": size ", tensor.size(), " does not match the expected [",
                             spec.rows, ", ", spec.columns, "] = ", *expected));
    }
    for (size_t i = 0; i < tensor.size(); ++i) {
      if (!std::isfinite(tensor[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat(spec.name, "[", i, "]: ", tensor[i], " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

double SeededUniform(uint64_t seed, uint64_t stream, uint64_t index) {
  // Unsigned arithmetic wraps mod 2^64, as the recipe says.
  const uint64_t z = seed + stream * 0xD1B54A32D192ED03ull + (index + 1) * 0x9E3779B97F4A7C15ull;
  return static_cast<double>(SplitMix64Finalize(z) >> 40) * 0x1.0p-24;
}

AttentionWeights SeededWeights(const HeadConfig& config, uint64_t seed) {
  AttentionWeights weights;
  const std::vector<TensorSpec> specs = TensorSpecs(config);
  const std::vector<std::vector<float>*> tensors = Tensors(weights);
  for (size_t t = 0; t < specs.size(); ++t) {
    const TensorSpec& spec = specs[t];
    const double bound = 1.0 / std::sqrt(static_cast<double>(spec.fan_in));
    std::vector<float>& tensor = *tensors[t];
    // A config that is not resolved (negative or overflowing sizes) gets empty
    // tensors, which ValidateWeights then rejects.
    const std::optional<int64_t> size = CheckedProduct({spec.rows, spec.columns});
    tensor.resize(size ? static_cast<size_t>(*size) : 0);
    for (size_t i = 0; i < tensor.size(); ++i) {
      const double u = SeededUniform(seed, t, i);
      tensor[i] = static_cast<float>((2.0 * u - 1.0) * bound);
    }
  }
  return weights;
}

}  // namespace attnserve::core
