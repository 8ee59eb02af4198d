#ifndef ATTNSERVE_SERVER_EXPLORER_NPY_WRITER_H_
#define ATTNSERVE_SERVER_EXPLORER_NPY_WRITER_H_

#include <cstdint>
#include <string>

#include "absl/types/span.h"

namespace attnserve::server {

// A .npy file (format version 1.0, '<f4', C order) holding `values` with
// `shape` (product(shape) values, row-major; the caller guarantees it). The
// header is padded so the data starts at a multiple of 64 bytes, as NumPy
// writes it. Thread-safe (no state).
std::string WriteNpyFloat32(absl::Span<const int64_t> shape, absl::Span<const float> values);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_NPY_WRITER_H_
