#include "core/head_config.h"

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnserve::core {
namespace {

// OK when 1 <= value <= max; INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckDimension(absl::string_view field, int64_t value, int64_t max) {
  if (value < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_config.", field, ": must be positive, got ", value));
  }
  if (value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_config.", field, ": ", value, " exceeds the limit ", max));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HeadConfig> ResolveHeadConfig(const HeadConfig& config) {
  HeadConfig resolved = config;

  if (absl::Status s = CheckDimension("d_model", resolved.d_model, kMaxDModel); !s.ok()) return s;
  if (absl::Status s = CheckDimension("num_heads", resolved.num_heads, kMaxHeads); !s.ok()) {
    return s;
  }
  if (resolved.context_dim == 0) resolved.context_dim = resolved.d_model;
  if (absl::Status s = CheckDimension("context_dim", resolved.context_dim, kMaxDModel); !s.ok()) {
    return s;
  }

  if (resolved.num_kv_heads == 0) resolved.num_kv_heads = resolved.num_heads;
  if (absl::Status s = CheckDimension("num_kv_heads", resolved.num_kv_heads, kMaxHeads); !s.ok()) {
    return s;
  }
  if (resolved.num_heads % resolved.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_config.num_kv_heads: ", resolved.num_kv_heads,
                     " does not divide num_heads ", resolved.num_heads));
  }

  if (resolved.head_dim == 0) {
    // The default head_dim is d_model / num_heads.
    if (resolved.d_model % resolved.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat("head_config.num_heads: ", resolved.num_heads,
                                                     " does not divide d_model ", resolved.d_model,
                                                     " (head_dim unset, so d_model / num_heads)"));
    }
    resolved.head_dim = resolved.d_model / resolved.num_heads;
  }
  if (absl::Status s = CheckDimension("head_dim", resolved.head_dim, kMaxHeadDim); !s.ok()) {
    return s;
  }

  if (resolved.scale == 0.0f) {
    resolved.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(resolved.head_dim)));
  }
  if (!std::isfinite(resolved.scale) || resolved.scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_config.scale: must be finite and positive, got ", resolved.scale));
  }

  const RotaryConfig& rotary = resolved.rotary;
  if (rotary.rotary_dim < 0 || rotary.rotary_dim > resolved.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_config.rotary.rotary_dim: ", rotary.rotary_dim,
                     " is outside [0, head_dim ", resolved.head_dim, "]"));
  }
  if (rotary.rotary_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_config.rotary.rotary_dim: must be even (it rotates pairs), got ", rotary.rotary_dim));
  }
  if (!std::isfinite(rotary.theta) || !(rotary.theta > 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_config.rotary.theta: must be finite and greater than 1, got ", rotary.theta));
  }
  return resolved;
}

}  // namespace attnserve::core
