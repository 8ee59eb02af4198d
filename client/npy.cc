#include "client/npy.h"

#include <bit>
#include <cctype>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/file_io.h"

namespace attnserve::client {
namespace {

// The raw bytes of '<f4' data are copied straight into floats.
static_assert(std::endian::native == std::endian::little, "attnctl assumes a little-endian host");

constexpr absl::string_view kMagic("\x93NUMPY", 6);
// Matches NumPy's own reader: it needs at most 32 dimensions.
constexpr int kMaxRank = 32;

int64_t ItemSize(NpyDtype dtype) { return dtype == NpyDtype::kFloat32 ? 4 : 1; }

std::string ShapeText(absl::Span<const int64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// A tiny reader of the Python dict literal in a .npy header, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// It accepts exactly what NumPy writes (and any spacing), nothing more.
class HeaderParser {
 public:
  HeaderParser(absl::string_view text, absl::string_view name) : text_(text), name_(name) {}

  absl::StatusOr<NpyArray> Parse() {
    NpyArray array;
    std::optional<std::string> descr;
    std::optional<bool> fortran_order;
    std::optional<std::vector<int64_t>> shape;
    SkipSpace();
    if (!Consume('{')) return Error("the header is not a Python dict");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      absl::StatusOr<std::string> key = ParseString();
      if (!key.ok()) return key.status();
      SkipSpace();
      if (!Consume(':')) return Error(absl::StrCat("expected ':' after '", *key, "'"));
      SkipSpace();
      if (*key == "descr") {
        if (descr.has_value()) return Error("'descr' appears twice");
        if (Peek() != '\'' && Peek() != '"') {
          return Error("'descr' is not a string (structured dtypes are not supported)");
        }
        absl::StatusOr<std::string> value = ParseString();
        if (!value.ok()) return value.status();
        descr = *std::move(value);
      } else if (*key == "fortran_order") {
        if (fortran_order.has_value()) return Error("'fortran_order' appears twice");
        if (ConsumeWord("True")) {
          fortran_order = true;
        } else if (ConsumeWord("False")) {
          fortran_order = false;
        } else {
          return Error("'fortran_order' is not True or False");
        }
      } else if (*key == "shape") {
        if (shape.has_value()) return Error("'shape' appears twice");
        absl::StatusOr<std::vector<int64_t>> value = ParseShape();
        if (!value.ok()) return value.status();
        shape = *std::move(value);
      } else {
        return Error(absl::StrCat("unexpected key '", *key,
                                  "' (a .npy header has descr, fortran_order and shape)"));
      }
      SkipSpace();
      if (Consume(',')) continue;
      SkipSpace();
      if (Consume('}')) break;
      return Error("expected ',' or '}' in the header dict");
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the header dict");
    if (!descr.has_value()) return Error("the header has no 'descr'");
    if (!fortran_order.has_value()) return Error("the header has no 'fortran_order'");
    if (!shape.has_value()) return Error("the header has no 'shape'");

    if (*descr == "<f4") {
      array.dtype = NpyDtype::kFloat32;
    } else if (*descr == "|b1") {
      array.dtype = NpyDtype::kBool;
    } else if (*descr == "|u1") {
      array.dtype = NpyDtype::kUint8;
    } else if (*descr == ">f4") {
      return Error("dtype '>f4' is big-endian; save little-endian '<f4' (x.astype('<f4'))");
    } else {
      return Error(
          absl::StrCat("dtype '", *descr, "' is not supported ('<f4'; '|b1' or '|u1' for masks)"));
    }
    if (*fortran_order) {
      return Error("fortran_order is True; save a C-order array (np.ascontiguousarray(x))");
    }
    array.shape = *std::move(shape);
    return array;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": bad .npy header: ", what));
  }

  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  bool Consume(char c) {
    if (Peek() != c) return false;
    ++pos_;
    return true;
  }
  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  // A quoted string without escapes (NumPy's keys and descr never need them).
  absl::StatusOr<std::string> ParseString() {
    const char quote = Peek();
    if (quote != '\'' && quote != '"') return Error("expected a quoted string");
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == absl::string_view::npos) return Error("unterminated string");
    std::string value(text_.substr(pos_ + 1, end - pos_ - 1));
    if (value.find('\\') != std::string::npos) return Error("escapes in strings are not supported");
    pos_ = end + 1;
    return value;
  }

  // A tuple of non-negative integers: (), (5,), (2, 3) or (2, 3,).
  absl::StatusOr<std::vector<int64_t>> ParseShape() {
    if (!Consume('(')) return Error("'shape' is not a tuple");
    std::vector<int64_t> shape;
    while (true) {
      SkipSpace();
      if (Consume(')')) break;
      if (Peek() == '-') return Error("'shape' has a negative dimension");
      if (!std::isdigit(static_cast<unsigned char>(Peek()))) {
        return Error("'shape' is not a tuple of integers");
      }
      int64_t d = 0;
      while (std::isdigit(static_cast<unsigned char>(Peek()))) {
        const int digit = text_[pos_++] - '0';
        if (d > (std::numeric_limits<int64_t>::max() - digit) / 10) {
          return Error("a dimension of 'shape' overflows int64");
        }
        d = d * 10 + digit;
      }
      Consume('L');  // Python 2's long literals, in files NumPy wrote long ago
      shape.push_back(d);
      if (shape.size() > kMaxRank)
        return Error(absl::StrCat("more than ", kMaxRank, " dimensions"));
      SkipSpace();
      if (Consume(',')) continue;
      SkipSpace();
      if (Consume(')')) break;
      return Error("expected ',' or ')' in 'shape'");
    }
    // Python's (5) is the int 5, not a tuple; NumPy writes (5,).
    return shape;
  }

  absl::string_view text_;
  absl::string_view name_;
  size_t pos_ = 0;
};

}  // namespace

absl::string_view NpyDtypeName(NpyDtype dtype) {
  switch (dtype) {
    case NpyDtype::kFloat32:
      return "<f4";
    case NpyDtype::kBool:
      return "|b1";
    case NpyDtype::kUint8:
      return "|u1";
  }
  return "?";
}

int64_t NpyArray::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> NpyArray::ToFloats() const {
  const int64_t n = num_elements();
  std::vector<float> values(n);
  if (dtype == NpyDtype::kFloat32) {
    std::memcpy(values.data(), data.data(), n * sizeof(float));
  } else if (dtype == NpyDtype::kBool) {
    for (int64_t i = 0; i < n; ++i) values[i] = data[i] != 0 ? 1.0f : 0.0f;
  } else {
    for (int64_t i = 0; i < n; ++i) values[i] = static_cast<unsigned char>(data[i]);
  }
  return values;
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, absl::string_view name) {
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
  };
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic) {
    return error("not a .npy file (it does not start with \"\\x93NUMPY\")");
  }
  if (bytes.size() < kMagic.size() + 2) return error("truncated .npy file (no version)");
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  if ((major != 1 && major != 2) || minor != 0) {
    return error(absl::StrCat(".npy format version ", major, ".", minor,
                              " is not supported (1.0 and 2.0 are)"));
  }
  // Version 1.0 has a 2-byte little-endian header length, 2.0 a 4-byte one.
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t prefix = kMagic.size() + 2 + length_bytes;
  if (bytes.size() < prefix) return error("truncated .npy file (no header length)");
  uint64_t header_len = 0;
  for (size_t i = 0; i < length_bytes; ++i) {
    header_len |= uint64_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
  }
  if (header_len > bytes.size() - prefix) {
    return error(absl::StrCat("truncated .npy file (the header says it is ", header_len,
                              " bytes; the file has ", bytes.size() - prefix,
                              " after the prefix)"));
  }
  HeaderParser parser(bytes.substr(prefix, header_len), name);
  absl::StatusOr<NpyArray> array = parser.Parse();
  if (!array.ok()) return array.status();

  // product(shape) x item size, checked against int64 overflow.
  const int64_t item = ItemSize(array->dtype);
  int64_t expected = item;
  for (int64_t d : array->shape) {
    if (d != 0 && expected > std::numeric_limits<int64_t>::max() / d) {
      return error(absl::StrCat("shape ", ShapeText(array->shape), " is too large"));
    }
    expected *= d;
  }
  const absl::string_view data = bytes.substr(prefix + header_len);
  if (static_cast<uint64_t>(expected) != data.size()) {
    return error(absl::StrCat(
        data.size() < static_cast<uint64_t>(expected) ? "truncated .npy file: " : "size mismatch: ",
        "shape ", ShapeText(array->shape), " of ", NpyDtypeName(array->dtype), " needs ", expected,
        " data bytes, the file has ", data.size()));
  }
  array->data = std::string(data);
  return array;
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  if (!bytes.ok()) return bytes.status();
  return ParseNpy(*bytes, path);
}

std::string EncodeNpyFloat32(absl::Span<const int64_t> shape, absl::Span<const float> values) {
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': ", ShapeText(shape), ", }");
  // Pad with spaces and end with a newline so that magic, version, length and
  // header fill a multiple of 64 bytes (the data then starts aligned).
  const size_t prefix = kMagic.size() + 2 + 2;
  const size_t total = (prefix + header.size() + 1 + 63) / 64 * 64;
  header.append(total - prefix - header.size() - 1, ' ');
  header.push_back('\n');
  std::string bytes(kMagic);
  bytes.push_back('\x01');
  bytes.push_back('\x00');
  // Headers of our shapes (at most a few hundred bytes) always fit version
  // 1.0's 16-bit length.
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>(header.size() >> 8));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return bytes;
}

absl::Status WriteNpyFile(const std::string& path, absl::Span<const int64_t> shape,
                          absl::Span<const float> values) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (n != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": shape ", ShapeText(shape), " needs ", n,
                                                   " values, got ", values.size()));
  }
  return WriteFileBytes(path, EncodeNpyFloat32(shape, values));
}

}  // namespace attnserve::client
