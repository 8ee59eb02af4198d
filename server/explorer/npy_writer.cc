#include "server/explorer/npy_writer.h"

#include <bit>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve::server {

static_assert(std::endian::native == std::endian::little,
              "the .npy data is written as little-endian by memcpy");

std::string WriteNpyFloat32(absl::Span<const int64_t> shape, absl::Span<const float> values) {
  const std::string dims = shape.size() == 1 ? absl::StrCat(shape[0], ",")
                                              : absl::StrJoin(shape, ", ");
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // magic (6) + version (2) + length (2) + header + '\n', a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>((header.size() >> 8) & 0xff);
  out += header;
  const size_t data_offset = out.size();
  out.resize(data_offset + values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(out.data() + data_offset, values.data(), values.size() * sizeof(float));
  return out;
}

}  // namespace attnserve::server
