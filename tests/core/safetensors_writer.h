#ifndef ATTNSERVE_TESTS_CORE_SAFETENSORS_WRITER_H_
#define ATTNSERVE_TESTS_CORE_SAFETENSORS_WRITER_H_

// Writes safetensors files for tests: tensors from float values, stored as
// F32, BF16 (round to nearest even) or F16 (round to nearest even), and the
// raw pieces (header text, data bytes) so tests can build defective files.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve::testing {

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Finite, normal-range values only (what tests write).
inline uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xffu) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffffu;
  if (exponent <= 0) {  // subnormal or zero in half
    if (exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

class SafetensorsWriter {
 public:
  // Adds a tensor of `dtype` ("F32", "BF16" or "F16") from `values`.
  void Add(const std::string& name, const std::vector<int64_t>& shape,
           const std::vector<float>& values, const std::string& dtype = "F32") {
    std::string bytes;
    for (float v : values) {
      if (dtype == "F32") {
        bytes.append(reinterpret_cast<const char*>(&v), 4);
      } else {
        const uint16_t h = dtype == "BF16" ? FloatToBf16(v) : FloatToF16(v);
        bytes.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    AddRaw(name, dtype, absl::StrCat("[", absl::StrJoin(shape, ","), "]"), bytes);
  }
  // Adds an entry with the given dtype and shape text and bytes as they are.
  void AddRaw(const std::string& name, const std::string& dtype, const std::string& shape_json,
              const std::string& bytes) {
    const size_t begin = data_.size();
    data_ += bytes;
    entries_.push_back(absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype, "\",\"shape\":",
                                    shape_json, ",\"data_offsets\":[", begin, ",", data_.size(),
                                    "]}"));
  }
  std::string Header() const {
    return absl::StrCat("{\"__metadata__\":{\"format\":\"pt\"}",
                        entries_.empty() ? "" : ",", absl::StrJoin(entries_, ","), "}");
  }
  const std::string& data() const { return data_; }

  // The whole file: 8-byte little-endian length, header, data.
  std::string Bytes() const { return Assemble(Header(), data_); }
  static std::string Assemble(const std::string& header, const std::string& data) {
    std::string out(8, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + header + data;
  }
  void Write(const std::string& path) const { WriteFile(path, Bytes()); }
  static void WriteFile(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }

 private:
  std::vector<std::string> entries_;
  std::string data_;
};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_SAFETENSORS_WRITER_H_
