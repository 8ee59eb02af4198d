#include "server/explorer/npy_reader.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"

namespace attnserve::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the .npy data is read as little-endian by memcpy");

constexpr absl::string_view kMagic = "\x93NUMPY";

absl::Status Refuse(absl::string_view field, absl::string_view part, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", part, ": ", what));
}

// Text for a message: printable ASCII kept, the rest escaped, at most 40
// characters (a header is the client's text).
std::string Quote(absl::string_view text) {
  std::string out = "'";
  for (size_t i = 0; i < text.size() && i < 40; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (text.size() > 40) out += "...";
  return out + "'";
}

// The header's Python dict literal:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// followed by spaces and a newline. Only the three keys, each once; string
// values in single or double quotes without escapes; integers in decimal.
class HeaderParser {
 public:
  HeaderParser(absl::string_view text, absl::string_view field, int max_dims)
      : text_(text), field_(field), max_dims_(max_dims) {}

  absl::Status Parse() {
    SkipSpace();
    if (!Eat('{')) return Malformed("expected '{' at its start");
    while (true) {
      SkipSpace();
      if (Eat('}')) break;
      std::optional<std::string> key = String();
      if (!key) return Malformed("expected a quoted key or '}'");
      SkipSpace();
      if (!Eat(':')) return Malformed(absl::StrCat("expected ':' after the key ", Quote(*key)));
      SkipSpace();
      if (*key == "descr") {
        if (descr_) return Malformed("the key 'descr' appears twice");
        descr_ = String();
        if (!descr_) return Malformed("descr: expected a quoted dtype such as '<f4'");
      } else if (*key == "fortran_order") {
        if (fortran_order_) return Malformed("the key 'fortran_order' appears twice");
        if (EatWord("True")) fortran_order_ = true;
        else if (EatWord("False")) fortran_order_ = false;
        else return Malformed("fortran_order: expected True or False");
      } else if (*key == "shape") {
        if (shape_) return Malformed("the key 'shape' appears twice");
        absl::Status status = Shape();
        if (!status.ok()) return status;
      } else {
        return Malformed(absl::StrCat("unknown key ", Quote(*key),
                                      ", expected only 'descr', 'fortran_order' and 'shape'"));
      }
      SkipSpace();
      if (Eat(',')) continue;
      SkipSpace();
      if (Eat('}')) break;
      return Malformed("expected ',' or '}' after a value");
    }
    SkipSpace();
    if (pos_ != text_.size()) return Malformed("text after the closing '}'");
    if (!descr_) return Malformed("the key 'descr' is missing");
    if (!fortran_order_) return Malformed("the key 'fortran_order' is missing");
    if (!shape_) return Malformed("the key 'shape' is missing");
    return absl::OkStatus();
  }

  const std::string& descr() const { return *descr_; }
  bool fortran_order() const { return *fortran_order_; }
  const std::vector<int64_t>& shape() const { return *shape_; }

 private:
  absl::Status Malformed(absl::string_view what) const {
    return Refuse(field_, "header", absl::StrCat(what, " (at byte ", pos_, " of the header)"));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Eat(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool EatWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  std::optional<std::string> String() {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) return std::nullopt;
    const char quote = text_[pos_];
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == absl::string_view::npos) return std::nullopt;
    std::string value(text_.substr(pos_ + 1, end - pos_ - 1));
    if (value.find('\\') != std::string::npos) return std::nullopt;
    pos_ = end + 1;
    return value;
  }
  // A tuple of non-negative decimal integers: (), (5,), (3, 4), (3, 4,).
  absl::Status Shape() {
    if (!Eat('(')) return Malformed("shape: expected a tuple such as (3, 4)");
    std::vector<int64_t> dims;
    while (true) {
      SkipSpace();
      if (Eat(')')) break;
      if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') {
        return Malformed("shape: expected a non-negative integer or ')'");
      }
      int64_t value = 0;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        std::optional<int64_t> next = core::CheckedMul(value, 10);
        if (next) next = core::CheckedAdd(*next, text_[pos_] - '0');
        if (!next) return Refuse(field_, "shape", "a dimension is larger than int64");
        value = *next;
        ++pos_;
      }
      if (pos_ < text_.size() && text_[pos_] == 'L') ++pos_;  // Python 2's long
      dims.push_back(value);
      if (static_cast<int>(dims.size()) > max_dims_) {
        return Refuse(field_, "shape", absl::StrCat("more than ", max_dims_, " dimensions"));
      }
      SkipSpace();
      if (Eat(',')) continue;
      SkipSpace();
      if (Eat(')')) break;
      return Malformed("shape: expected ',' or ')' after a dimension");
    }
    shape_ = std::move(dims);
    return absl::OkStatus();
  }

  const absl::string_view text_;
  const absl::string_view field_;
  const int max_dims_;
  size_t pos_ = 0;
  std::optional<std::string> descr_;
  std::optional<bool> fortran_order_;
  std::optional<std::vector<int64_t>> shape_;
};

std::string ShapeText(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

}  // namespace

absl::StatusOr<NpyArray> ReadNpy(absl::string_view bytes, absl::string_view field,
                                 const NpyReadLimits& limits) {
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic) {
    return Refuse(field, "magic",
                  absl::StrCat("the file does not start with \"\\x93NUMPY\" (got ",
                               Quote(bytes.substr(0, kMagic.size())), "); expected a .npy file"));
  }
  if (bytes.size() < 8) return Refuse(field, "version", "the file ends before its version");
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  if (major < 1 || major > 3 || minor != 0) {
    return Refuse(field, "version",
                  absl::StrCat(major, ".", minor, " is not supported, expected 1.0, 2.0 or 3.0"));
  }
  // Version 1.0: a 2-byte header length; 2.0 and 3.0: 4 bytes (little-endian).
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t prefix = 8 + length_bytes;
  if (bytes.size() < prefix) {
    return Refuse(field, "header length", "the file ends before the header's length");
  }
  uint64_t header_length = 0;
  for (size_t i = 0; i < length_bytes; ++i) {
    header_length |= uint64_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
  }
  if (header_length > static_cast<uint64_t>(limits.max_header_bytes)) {
    return Refuse(field, "header length",
                  absl::StrCat(header_length, " bytes is over the limit of ",
                               limits.max_header_bytes));
  }
  if (header_length > bytes.size() - prefix) {
    return Refuse(field, "header length",
                  absl::StrCat(header_length, " bytes, but the file has only ",
                               bytes.size() - prefix, " after the length field"));
  }
  const absl::string_view header = bytes.substr(prefix, header_length);
  if (header.empty() || header.back() != '\n') {
    return Refuse(field, "header", "expected it to end with a newline");
  }
  for (char c : header) {
    if (static_cast<unsigned char>(c) >= 0x80 || c == '\0') {
      return Refuse(field, "header", "expected ASCII text (a Python dict literal)");
    }
  }
  HeaderParser parser(header, field, limits.max_dims);
  if (absl::Status status = parser.Parse(); !status.ok()) return status;

  int64_t item_bytes = 0;
  if (parser.descr() == "<f4") {
    item_bytes = 4;
  } else if (parser.descr() == "<f8") {
    item_bytes = 8;
  } else {
    return Refuse(field, "descr",
                  absl::StrCat(Quote(parser.descr()),
                               " is not supported, expected '<f4' (float32) or '<f8' (float64), "
                               "little-endian"));
  }
  if (parser.fortran_order()) {
    return Refuse(field, "fortran_order",
                  "True is not supported, expected False (C order; numpy.ascontiguousarray)");
  }
  const std::vector<int64_t>& shape = parser.shape();
  const std::optional<int64_t> elements = core::CheckedProduct(shape);
  if (!elements || *elements > limits.max_elements) {
    return Refuse(field, "shape",
                  absl::StrCat(ShapeText(shape), " has ",
                               elements ? absl::StrCat(*elements) : "more than int64",
                               " elements, over the limit of ", limits.max_elements));
  }
  const int64_t data_bytes = *elements * item_bytes;  // no overflow: bounded above
  const absl::string_view data = bytes.substr(prefix + header_length);
  if (static_cast<int64_t>(data.size()) != data_bytes) {
    return Refuse(field, "data",
                  absl::StrCat(data.size(), " bytes, expected ", data_bytes, " for shape ",
                               ShapeText(shape), " of ", parser.descr()));
  }

  NpyArray array;
  array.shape = shape;
  array.descr = parser.descr();
  array.values.resize(static_cast<size_t>(*elements));
  for (int64_t i = 0; i < *elements; ++i) {
    double value;
    if (item_bytes == 4) {
      float f;
      std::memcpy(&f, data.data() + i * 4, 4);
      value = f;
    } else {
      std::memcpy(&value, data.data() + i * 8, 8);
    }
    const float stored = static_cast<float>(value);
    if (!std::isfinite(stored)) {
      return Refuse(field, "data",
                    absl::StrCat("element ", i, " is ", value,
                                 std::isfinite(value) ? " (beyond float32's range)" : "",
                                 "; expected finite values"));
    }
    array.values[static_cast<size_t>(i)] = stored;
  }
  return array;
}

}  // namespace attnserve::server
