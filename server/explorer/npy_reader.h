#ifndef ATTNSERVE_SERVER_EXPLORER_NPY_READER_H_
#define ATTNSERVE_SERVER_EXPLORER_NPY_READER_H_

// A strict reader of NumPy .npy files sent by untrusted clients (the
// explorer's uploads). Accepts format versions 1.0, 2.0 and 3.0, C order,
// little-endian float32 ('<f4') or float64 ('<f8'; converted to float32),
// finite values only. Everything else is refused with a message that names
// the part of the file ("<field>: descr: ...", "<field>: shape: ...") and
// says what was expected. Sizes are bounded before anything is allocated
// and every product is overflow-checked.
// The format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// What one file may hold.
struct NpyReadLimits {
  // The header (the Python dict literal after the length field).
  int64_t max_header_bytes = 64 * 1024;
  int max_dims = 8;
  // Elements of the array (each becomes a float).
  int64_t max_elements = int64_t{64} << 20;
};

// A C-order array of float32 values read from a .npy file.
struct NpyArray {
  std::vector<int64_t> shape;  // () for a scalar
  std::vector<float> values;   // row-major, product(shape) of them
  // The stored dtype: "<f4" or "<f8".
  std::string descr;
};

// Parses `bytes` as a whole .npy file. `field` names the file in messages
// (e.g. "inputs.npy"). INVALID_ARGUMENT, naming `field` and the part, for a
// bad magic or version, a malformed, oversized or truncated header, a dtype
// other than '<f4'/'<f8', Fortran order, a shape over the limits (or whose
// size overflows int64), data that is not exactly the shape's size, or a
// value that is NaN or infinite. Thread-safe (no state).
absl::StatusOr<NpyArray> ReadNpy(absl::string_view bytes, absl::string_view field,
                                 const NpyReadLimits& limits = {});

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_NPY_READER_H_
