// libFuzzer target: an untrusted .npy file (the explorer's uploads) through
// ReadNpy. The reader must never crash, and either accept the file with
// values that agree with its shape (all finite), or refuse it with
// INVALID_ARGUMENT and a message that names the field and the part of the
// file ("inputs.npy: <part>: ..."). Anything else traps.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "server/explorer/npy_reader.h"

namespace {

int last_outcome = 0;

// The parts a refusal may name, as ReadNpy's contract lists them.
bool NamesAPart(absl::string_view message) {
  constexpr absl::string_view kPrefix = "inputs.npy: ";
  if (!absl::StartsWith(message, kPrefix)) return false;
  message.remove_prefix(kPrefix.size());
  for (absl::string_view part : {"magic: ", "version: ", "header length: ", "header: ", "descr: ",
                                 "fortran_order: ", "shape: ", "data: "}) {
    if (absl::StartsWith(message, part) && message.size() > part.size()) return true;
  }
  return false;
}

}  // namespace

// The replay's check of seed names (tests/fuzz/replay_main.cc): 2 accepted,
// 1 refused.
extern "C" int AttnserveFuzzLastOutcome() { return last_outcome; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::server::NpyReadLimits limits;
  limits.max_elements = int64_t{1} << 20;
  const absl::StatusOr<attnserve::server::NpyArray> array = attnserve::server::ReadNpy(
      absl::string_view(reinterpret_cast<const char*>(data), size), "inputs.npy", limits);
  if (!array.ok()) {
    if (array.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    if (!NamesAPart(array.status().message())) __builtin_trap();
    last_outcome = 1;
    return 0;
  }
  const auto elements = attnserve::core::CheckedProduct(array->shape);
  if (!elements || *elements > limits.max_elements) __builtin_trap();
  if (static_cast<int64_t>(array->values.size()) != *elements) __builtin_trap();
  if (array->descr != "<f4" && array->descr != "<f8") __builtin_trap();
  for (float v : array->values) {
    if (!std::isfinite(v)) __builtin_trap();
  }
  last_outcome = 2;
  return 0;
}
