#ifndef ATTNSERVE_CORE_CHECKED_MATH_H_
#define ATTNSERVE_CORE_CHECKED_MATH_H_

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "absl/types/span.h"

namespace attnserve::core {

// a * b, or nullopt when it overflows int64 or an operand is negative.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t product = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// a + b, or nullopt when it overflows int64 or an operand is negative.
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// The product of `dims`, or nullopt when one is negative or it overflows int64.
// The product of no dims is 1.
inline std::optional<int64_t> CheckedProduct(absl::Span<const int64_t> dims) {
  int64_t product = 1;
  for (int64_t d : dims) {
    std::optional<int64_t> next = CheckedMul(product, d);
    if (!next) return std::nullopt;
    product = *next;
  }
  return product;
}

inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> dims) {
  return CheckedProduct(absl::MakeConstSpan(dims.begin(), dims.size()));
}

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_CHECKED_MATH_H_
