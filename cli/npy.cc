#include "cli/npy.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/file_io.h"

namespace attnserve::cli {
namespace {

// The raw bytes of '<f4' data are copied straight into floats.
static_assert(std::endian::native == std::endian::little, "attnctl assumes a little-endian host");

constexpr absl::string_view kMagic("\x93NUMPY", 6);

std::string ShapeText(absl::Span<const int64_t> shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

// What a .npy header says.
struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// A tiny reader of the Python dict literal in a .npy header, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// It accepts exactly what NumPy writes (and any spacing), nothing more.
class HeaderParser {
 public:
  HeaderParser(absl::string_view text, absl::string_view name, int max_dims)
      : text_(text), name_(name), max_dims_(max_dims) {}

  absl::StatusOr<Header> Parse() {
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
    return Header{.descr = *std::move(descr),
                  .fortran_order = *fortran_order,
                  .shape = *std::move(shape)};
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
      if (shape.size() > static_cast<size_t>(max_dims_)) {
        return Error(absl::StrCat("more than ", max_dims_, " dimensions"));
      }
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
  int max_dims_;
  size_t pos_ = 0;
};


// How a .npy file stores its elements, from 'descr': byte order, kind and
// size ('<f8': little-endian, float, 8 bytes).
struct StoredType {
  char kind = 0;  // 'f' float, 'i' signed integer, 'u' unsigned, 'b' boolean
  int size = 0;
  bool big_endian = false;
};

// NumPy's name of a stored type, e.g. "float64", "int16", "bool".
std::string StoredTypeName(const StoredType& t) {
  if (t.kind == 'b') return "bool";
  const char* kind = t.kind == 'f' ? "float" : t.kind == 'i' ? "int" : "uint";
  return absl::StrCat(kind, 8 * t.size);
}

// The stored type of `descr`, or nullopt for one that cannot become float32
// (complex, strings, objects, dates, ...).
std::optional<StoredType> ParseStoredType(absl::string_view descr) {
  if (descr.size() < 3) return std::nullopt;
  StoredType t;
  const char order = descr[0];
  if (order != '<' && order != '>' && order != '|' && order != '=') return std::nullopt;
  t.big_endian = order == '>' || (order == '=' && std::endian::native == std::endian::big);
  t.kind = descr[1];
  // One plain digit, as NumPy writes the sizes it stores (1, 2, 4, 8).
  if (descr.size() != 3 || !absl::ascii_isdigit(descr[2])) return std::nullopt;
  t.size = descr[2] - '0';
  switch (t.kind) {
    case 'f':
      if (t.size != 2 && t.size != 4 && t.size != 8) return std::nullopt;
      break;
    case 'i':
    case 'u':
      if (t.size != 1 && t.size != 2 && t.size != 4 && t.size != 8) return std::nullopt;
      break;
    case 'b':
      if (t.size != 1) return std::nullopt;
      break;
    default:
      return std::nullopt;
  }
  // A one-byte type has no byte order.
  if (t.size == 1) t.big_endian = false;
  return t;
}

// The element at `p` as an unsigned integer of `size` bytes.
uint64_t LoadBits(const char* p, int size, bool big_endian) {
  uint64_t bits = 0;
  for (int b = 0; b < size; ++b) {
    const int shift = 8 * (big_endian ? size - 1 - b : b);
    bits |= uint64_t{static_cast<unsigned char>(p[b])} << shift;
  }
  return bits;
}

// An IEEE binary16 value, exactly (every half is a float).
float HalfToFloat(uint16_t h) {
  const float sign = (h & 0x8000) != 0 ? -1.0f : 1.0f;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  if (exponent == 31) {
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity()
                         : std::numeric_limits<float>::quiet_NaN();
  }
  return sign * std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
}

// The element at `p` of type `t` as a float (rounded to nearest even, as a
// C++ conversion and NumPy's astype do).
float ElementToFloat(const char* p, const StoredType& t) {
  const uint64_t bits = LoadBits(p, t.size, t.big_endian);
  switch (t.kind) {
    case 'f':
      if (t.size == 2) return HalfToFloat(static_cast<uint16_t>(bits));
      if (t.size == 4) return std::bit_cast<float>(static_cast<uint32_t>(bits));
      return static_cast<float>(std::bit_cast<double>(bits));
    case 'i': {
      // Sign-extend the low `size` bytes.
      const int unused = 64 - 8 * t.size;
      return static_cast<float>(static_cast<int64_t>(bits << unused) >> unused);
    }
    default:  // 'u', 'b'
      return static_cast<float>(bits);
  }
}

// Walks a Fortran-order (column-major) array of `shape` in C (row-major)
// order: position() is the Fortran position of the element at the current C
// position, Next() moves to the next C position. Memory of the rank only (an
// upload's elements are not matched by a table of positions).
class FortranWalk {
 public:
  explicit FortranWalk(const std::vector<int64_t>& shape)
      : shape_(shape), index_(shape.size(), 0), strides_(shape.size()) {
    int64_t stride = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      strides_[d] = stride;
      stride *= shape[d];
    }
  }

  int64_t position() const { return position_; }

  void Next() {
    for (size_t d = shape_.size(); d-- > 0;) {
      position_ += strides_[d];
      if (++index_[d] < shape_[d]) return;
      position_ -= strides_[d] * shape_[d];
      index_[d] = 0;
    }
  }

 private:
  const std::vector<int64_t>& shape_;
  std::vector<int64_t> index_;
  std::vector<int64_t> strides_;
  int64_t position_ = 0;
};

// A .npy file's header (parsed) and data (not checked).
struct SplitFile {
  Header header;
  absl::string_view data;
};

absl::StatusOr<SplitFile> Split(absl::string_view bytes, absl::string_view name,
                                const NpyLimits& limits) {
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
  };
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic) {
    return error("not a .npy file (it does not start with \"\\x93NUMPY\")");
  }
  if (bytes.size() < kMagic.size() + 2) return error("truncated .npy file (no version)");
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  if (major < 1 || major > 3 || minor != 0) {
    return error(absl::StrCat(".npy format version ", major, ".", minor,
                              " is not supported (1.0, 2.0 and 3.0 are)"));
  }
  // Version 1.0 has a 2-byte little-endian header length, 2.0 and 3.0 (whose
  // header may be UTF-8; ours takes ASCII, as NumPy writes it) a 4-byte one.
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t prefix = kMagic.size() + 2 + length_bytes;
  if (bytes.size() < prefix) return error("truncated .npy file (no header length)");
  uint64_t header_len = 0;
  for (size_t i = 0; i < length_bytes; ++i) {
    header_len |= uint64_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
  }
  if (header_len > static_cast<uint64_t>(limits.max_header_bytes)) {
    return error(absl::StrCat("bad .npy header: ", header_len, " bytes long, over the limit of ",
                              limits.max_header_bytes));
  }
  if (header_len > bytes.size() - prefix) {
    return error(absl::StrCat("truncated .npy file (the header says it is ", header_len,
                              " bytes; the file has ", bytes.size() - prefix,
                              " after the prefix)"));
  }
  HeaderParser parser(bytes.substr(prefix, header_len), name, limits.max_dims);
  absl::StatusOr<Header> header = parser.Parse();
  if (!header.ok()) return header.status();
  return SplitFile{.header = *std::move(header), .data = bytes.substr(prefix + header_len)};
}

// The array `split` describes: its dtype, shape and converted_from, and
// unless `header_only` its data (converted, and checked against the shape).
absl::StatusOr<NpyArray> Decode(const SplitFile& split, absl::string_view name,
                                const NpyLimits& limits, bool header_only) {
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", what));
  };
  const Header& header = split.header;
  const std::optional<StoredType> stored = ParseStoredType(header.descr);
  if (!stored.has_value()) {
    return error(absl::StrCat(
        "bad .npy header: dtype '", header.descr,
        "' cannot be converted to float32 (float16/32/64, integers and booleans can)"));
  }
  NpyArray array;
  array.shape = header.shape;
  const bool as_stored = !header.fortran_order && !stored->big_endian &&
                         ((stored->kind == 'f' && stored->size == 4) || stored->kind == 'b' ||
                          (stored->kind == 'u' && stored->size == 1));
  if (stored->kind == 'b') {
    array.dtype = NpyDtype::kBool;
  } else if (stored->kind == 'u' && stored->size == 1) {
    array.dtype = NpyDtype::kUint8;
  } else {
    array.dtype = NpyDtype::kFloat32;
  }
  // Booleans and bytes in Fortran order are reordered but stay what they are.
  const bool converts_values = array.dtype == NpyDtype::kFloat32 &&
                               !(stored->kind == 'f' && stored->size == 4 && !stored->big_endian);
  if (!as_stored) {
    std::vector<std::string> what;
    if (converts_values || stored->big_endian) {
      what.push_back(absl::StrCat(StoredTypeName(*stored), stored->big_endian ? " (big-endian)" : ""));
    }
    if (header.fortran_order) what.push_back("Fortran order");
    array.converted_from = absl::StrJoin(what, ", ");
  }

  // product(shape), checked against int64 overflow and the limit before
  // anything of that size is allocated.
  int64_t elements = 1;
  for (int64_t d : array.shape) {
    if (d != 0 && elements > std::numeric_limits<int64_t>::max() / stored->size / d) {
      return error(absl::StrCat("shape ", ShapeText(array.shape), " is too large"));
    }
    elements *= d;
  }
  if (elements > limits.max_elements) {
    return error(absl::StrCat("shape ", ShapeText(array.shape), " has ", elements,
                              " elements, over the limit of ", limits.max_elements));
  }
  const int64_t expected = elements * stored->size;
  if (header_only) return array;
  if (static_cast<uint64_t>(expected) != split.data.size()) {
    return error(absl::StrCat(
        split.data.size() < static_cast<uint64_t>(expected) ? "truncated .npy file: "
                                                              : "size mismatch: ",
        "shape ", ShapeText(array.shape), " of ", header.descr, " needs ", expected,
        " data bytes, the file has ", split.data.size()));
  }
  if (as_stored) {
    array.data = std::string(split.data);
    return array;
  }

  const int64_t n = array.num_elements();
  std::optional<FortranWalk> walk;
  if (header.fortran_order) walk.emplace(array.shape);
  // The stored element at C position c (the walk is at c).
  auto source = [&](int64_t c) {
    return split.data.data() + (walk ? walk->position() : c) * stored->size;
  };
  if (array.dtype != NpyDtype::kFloat32) {
    // Bytes or booleans, only reordered.
    array.data.resize(n);
    for (int64_t c = 0; c < n; ++c) {
      array.data[c] = *source(c);
      if (walk) walk->Next();
    }
    return array;
  }
  array.data.resize(n * sizeof(float));
  for (int64_t c = 0; c < n; ++c) {
    const float value = ElementToFloat(source(c), *stored);
    if (std::isinf(value) && stored->kind == 'f' && stored->size == 8 &&
        std::isfinite(std::bit_cast<double>(LoadBits(source(c), 8, stored->big_endian)))) {
      return error(absl::StrCat(
          "element ", c, " (", std::bit_cast<double>(LoadBits(source(c), 8, stored->big_endian)),
          ") is outside float32's range; float64 data is converted to float32"));
    }
    std::memcpy(array.data.data() + c * sizeof(float), &value, sizeof(float));
    if (walk) walk->Next();
  }
  return array;
}

// The first `limit` bytes of the file at `path` (fewer if it is shorter).
absl::StatusOr<std::string> ReadFilePrefix(const std::string& path, size_t limit) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  if (file == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  std::string bytes(limit, '\0');
  bytes.resize(std::fread(bytes.data(), 1, limit, file.get()));
  if (std::ferror(file.get())) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot read"));
  }
  return bytes;
}

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
    // An empty array's vector has no buffer: memcpy may not be given it.
    if (n > 0) std::memcpy(values.data(), data.data(), n * sizeof(float));
  } else if (dtype == NpyDtype::kBool) {
    for (int64_t i = 0; i < n; ++i) values[i] = data[i] != 0 ? 1.0f : 0.0f;
  } else {
    for (int64_t i = 0; i < n; ++i) values[i] = static_cast<unsigned char>(data[i]);
  }
  return values;
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, absl::string_view name,
                                  const NpyLimits& limits) {
  absl::StatusOr<SplitFile> split = Split(bytes, name, limits);
  if (!split.ok()) return split.status();
  return Decode(*split, name, limits, /*header_only=*/false);
}

absl::StatusOr<NpyArray> ReadNpyFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  if (!bytes.ok()) return bytes.status();
  return ParseNpy(*bytes, path);
}

absl::StatusOr<NpyArray> ReadNpyHeader(const std::string& path) {
  // Magic, version and a version 2.0/3.0 length: 12 bytes; then the header.
  absl::StatusOr<std::string> prefix = ReadFilePrefix(path, 12);
  if (!prefix.ok()) return prefix.status();
  uint64_t header_len = 0;
  if (prefix->size() == 12) {
    const size_t length_bytes = (*prefix)[6] == 1 ? 2 : 4;
    for (size_t i = 0; i < length_bytes; ++i) {
      header_len |= uint64_t{static_cast<unsigned char>((*prefix)[8 + i])} << (8 * i);
    }
  }
  // A header is small; a longer one is refused by Split.
  absl::StatusOr<std::string> bytes =
      ReadFilePrefix(path, 12 + std::min<uint64_t>(header_len, NpyLimits{}.max_header_bytes));
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<SplitFile> split = Split(*bytes, path, NpyLimits{});
  if (!split.ok()) return split.status();
  return Decode(*split, path, NpyLimits{}, /*header_only=*/true);
}

std::string NpyConversionNote(const NpyArray& array) {
  if (array.converted_from.empty()) return "";
  const char* to = array.dtype == NpyDtype::kFloat32 ? "float32"
                   : array.dtype == NpyDtype::kBool  ? "bool"
                                                     : "uint8";
  return absl::StrCat("converted ", array.converted_from, " -> ", to,
                      absl::StrContains(array.converted_from, "Fortran") ? ", C order" : "");
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

}  // namespace attnserve::cli
