// libFuzzer target: an untrusted .npy file (the attention explorer's uploads)
// through cli::ParseNpy with the explorer's limits. The parser must never
// crash, and either accept the file with data that agrees with its shape and
// dtype, within the limits, or refuse it with INVALID_ARGUMENT and a message
// that names the file ("inputs.npy: ...") and says what is wrong. Anything
// else traps.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "cli/npy.h"

namespace {

int last_outcome = 0;

}  // namespace

// The replay's check of seed names (tests/fuzz/replay_main.cc): 2 accepted,
// 1 refused.
extern "C" int AttnserveFuzzLastOutcome() { return last_outcome; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::cli::NpyLimits limits;
  limits.max_header_bytes = 64 * 1024;
  limits.max_dims = 3;
  limits.max_elements = int64_t{1} << 20;
  constexpr absl::string_view kName = "inputs.npy";
  const absl::StatusOr<attnserve::cli::NpyArray> array = attnserve::cli::ParseNpy(
      absl::string_view(reinterpret_cast<const char*>(data), size), kName, limits);
  if (!array.ok()) {
    if (array.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    const absl::string_view message = array.status().message();
    if (!absl::StartsWith(message, "inputs.npy: ") || message.size() <= kName.size() + 2) {
      __builtin_trap();
    }
    last_outcome = 1;
    return 0;
  }
  if (array->shape.size() > static_cast<size_t>(limits.max_dims)) __builtin_trap();
  // The element count, from the shape: 0 when a dimension is 0, else the
  // product, which must stay within the limit at every step.
  int64_t elements = 1;
  for (int64_t d : array->shape) {
    if (d < 0) __builtin_trap();
    if (d == 0) elements = 0;
  }
  if (elements != 0) {
    for (int64_t d : array->shape) {
      if (elements > limits.max_elements / d) __builtin_trap();
      elements *= d;
    }
  }
  if (elements != array->num_elements() || elements > limits.max_elements) __builtin_trap();
  const int64_t item = array->dtype == attnserve::cli::NpyDtype::kFloat32 ? 4 : 1;
  if (static_cast<int64_t>(array->data.size()) != elements * item) __builtin_trap();
  const std::vector<float> values = array->ToFloats();
  if (static_cast<int64_t>(values.size()) != elements) __builtin_trap();
  last_outcome = 2;
  return 0;
}
