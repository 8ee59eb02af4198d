#ifndef ATTNSERVE_CLI_NPY_H_
#define ATTNSERVE_CLI_NPY_H_

// Reading and writing NumPy's .npy files (format versions 1.0, 2.0 and 3.0):
// attnctl's input, mask and output files and the attention explorer's
// uploads (untrusted bytes: every size is bounded by NpyLimits before
// anything is allocated, and the parser is fuzzed). Written: C-order
// little-endian float32 ('<f4'). Read:
// float32 as it is; booleans ('|b1') and bytes ('|u1') as they are, for
// masks; float64 (NumPy's default), float16, the other integers and
// big-endian data converted to float32, and Fortran-order arrays to C order.
// The format:
// https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve::cli {

enum class NpyDtype {
  kFloat32,  // '<f4'
  kBool,     // '|b1'
  kUint8,    // '|u1'
};

// "<f4", "|b1" or "|u1".
absl::string_view NpyDtypeName(NpyDtype dtype);

// A C-order (row-major) array read from a .npy file.
struct NpyArray {
  NpyDtype dtype = NpyDtype::kFloat32;
  std::vector<int64_t> shape;  // () for a scalar
  // The elements' little-endian bytes, row-major: product(shape) x item size.
  std::string data;
  // What the file stored, when reading converted it: its NumPy dtype and
  // order, e.g. "float64" or "float32 (big-endian), Fortran order". Empty
  // when the values were read as stored.
  std::string converted_from;

  int64_t num_elements() const;
  // The values as floats: float32 as they are, booleans and bytes as their
  // numeric values (0/1 for booleans, 0..255 for bytes).
  std::vector<float> ToFloats() const;
};

// What one file may hold; the defaults bound nothing a real file needs.
struct NpyLimits {
  // The header (the dict literal after the length field).
  int64_t max_header_bytes = int64_t{1} << 20;
  // Dimensions of the shape (NumPy's own reader takes at most 32).
  int max_dims = 32;
  // Elements of the array.
  int64_t max_elements = int64_t{1} << 40;
};

// Parses the bytes of a .npy file. '<f4', '|b1' and '|u1' are read as they
// are; float16 and float64, signed and unsigned integers of 1 to 8 bytes and
// big-endian data become float32 (rounded to nearest even, as NumPy's
// astype('<f4')), and Fortran-order data C order; converted_from then says
// from what. Every error names `name` (the file's path) and says what is
// wrong. INVALID_ARGUMENT for: no magic string, a version other than 1.0, 2.0
// or 3.0, a header over limits.max_header_bytes, one that runs past the end or
// is not a dict with exactly 'descr',
// 'fortran_order' and 'shape', a dtype that cannot become float32 (complex,
// strings, objects, dates, structured), a finite float64 value beyond
// float32's range, a negative or overflowing shape, a shape over
// limits.max_dims or limits.max_elements, and a data size other than
// product(shape) x item size (truncated or trailing). NaN and infinities are
// read as they are (the caller decides whether they may be). Thread-safe.
absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, absl::string_view name,
                                  const NpyLimits& limits = {});

// Reads and parses the file at `path`. NOT_FOUND (or another errno-derived
// code) when it cannot be read; ParseNpy's errors otherwise.
absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path);

// The array ReadNpyFile would return, without its data: dtype, shape and
// converted_from from the header alone (the data is not read or checked).
// Errors as ReadNpyFile's for the file and the header.
absl::StatusOr<NpyArray> ReadNpyHeader(const std::string& path);

// "converted float64 -> float32" (and the like) when reading converted
// `array`'s values; "" when they were read as stored.
std::string NpyConversionNote(const NpyArray& array);

// The bytes of a version 1.0 .npy file of '<f4' values with `shape` (the
// header padded to a multiple of 64 bytes, as NumPy writes it). Requires
// values.size() == product(shape).
std::string EncodeNpyFloat32(absl::Span<const int64_t> shape, absl::Span<const float> values);

// Writes EncodeNpyFloat32(shape, values) to `path`. INVALID_ARGUMENT when
// values.size() != product(shape); an errno-derived code when the file cannot
// be written.
absl::Status WriteNpyFile(const std::string& path, absl::Span<const int64_t> shape,
                          absl::Span<const float> values);

}  // namespace attnserve::cli

#endif  // ATTNSERVE_CLI_NPY_H_
