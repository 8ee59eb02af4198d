// libFuzzer target: a safetensors header (the JSON text of an untrusted
// checkpoint) through ParseSafetensorsHeader. The first 4 bytes choose the
// size of the data section the header must fit; the rest is the header. Every
// tensor it accepts must lie inside the data section, in order of its checks:
// a size that agrees with its shape and dtype, no overlap.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/safetensors.h"

namespace attnserve::core {
namespace {

int64_t ElementBytes(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF64:
    case SafetensorsDtype::kI64:
    case SafetensorsDtype::kU64:
      return 8;
    case SafetensorsDtype::kF32:
    case SafetensorsDtype::kI32:
    case SafetensorsDtype::kU32:
      return 4;
    case SafetensorsDtype::kF16:
    case SafetensorsDtype::kBF16:
    case SafetensorsDtype::kI16:
    case SafetensorsDtype::kU16:
      return 2;
    default:
      return 1;
  }
}

void FuzzOne(const uint8_t* data, size_t size) {
  if (size < 4) return;
  uint32_t data_size = 0;
  std::memcpy(&data_size, data, sizeof(data_size));
  const absl::string_view header(reinterpret_cast<const char*>(data) + 4, size - 4);
  std::map<std::string, SafetensorsTensor, std::less<>> tensors;
  std::map<std::string, std::string, std::less<>> metadata;
  if (!ParseSafetensorsHeader(header, data_size, "fuzz", &tensors, &metadata).ok()) return;
  int64_t previous_end = -1;
  std::map<int64_t, int64_t> ranges;  // begin -> end
  for (const auto& [name, tensor] : tensors) {
    if (tensor.begin < 0 || tensor.begin > tensor.end || tensor.end > data_size) __builtin_trap();
    const auto elements = CheckedProduct(tensor.shape);
    if (!elements) __builtin_trap();
    const auto bytes = CheckedMul(*elements, ElementBytes(tensor.dtype));
    if (!bytes || *bytes != tensor.end - tensor.begin) __builtin_trap();
    if (tensor.end > tensor.begin) ranges[tensor.begin] = tensor.end;
  }
  for (const auto& [begin, end] : ranges) {
    if (begin < previous_end) __builtin_trap();  // overlap
    previous_end = end;
  }
}

}  // namespace
}  // namespace attnserve::core

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::core::FuzzOne(data, size);
  return 0;
}
