#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <set>
#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/bf16.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace attnserve::core {
namespace {

using Json = nlohmann::json;

// Nesting deeper than this is not a safetensors header (its deepest value,
// a shape or offsets list, is at depth 3); refused while parsing so no deep
// structure is ever built.
constexpr int kMaxJsonDepth = 8;
// A header's lists are shapes (at most kMaxRank) and offsets (2); a longer
// list is refused while parsing (checks after parsing name the shape's rank).
constexpr int64_t kMaxJsonArrayElements = 64;
// More dimensions than any real tensor.
constexpr size_t kMaxRank = 16;

struct DtypeInfo {
  absl::string_view name;
  SafetensorsDtype dtype;
  int64_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", SafetensorsDtype::kF64, 8},       {"F32", SafetensorsDtype::kF32, 4},
    {"F16", SafetensorsDtype::kF16, 2},       {"BF16", SafetensorsDtype::kBF16, 2},
    {"I64", SafetensorsDtype::kI64, 8},       {"I32", SafetensorsDtype::kI32, 4},
    {"I16", SafetensorsDtype::kI16, 2},       {"I8", SafetensorsDtype::kI8, 1},
    {"U64", SafetensorsDtype::kU64, 8},       {"U32", SafetensorsDtype::kU32, 4},
    {"U16", SafetensorsDtype::kU16, 2},       {"U8", SafetensorsDtype::kU8, 1},
    {"BOOL", SafetensorsDtype::kBool, 1},     {"F8_E5M2", SafetensorsDtype::kF8E5M2, 1},
    {"F8_E4M3", SafetensorsDtype::kF8E4M3, 1},
};

std::optional<SafetensorsDtype> ParseDtype(absl::string_view name) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

// The tensor name as it may appear in a message: bounded and printable.
std::string Printable(absl::string_view name) {
  std::string out;
  for (char c : name.substr(0, 120)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (name.size() > 120) out += "...";
  return out;
}

// Builds a header's JSON value as nlohmann's own DOM parser does (its
// callback parser is not used: it scans the enclosing object each time an
// object closes, quadratic in a header's entries), refusing before each
// value is built: nesting deeper than kMaxJsonDepth, an array of more than
// kMaxJsonArrayElements, more than kMaxSafetensorsHeaderValues values in all,
// and a top-level name given twice. So the parsed header's memory is bounded
// by its value count, not by what its text may unfold into.
class BoundedJsonBuilder {
 public:
  explicit BoundedJsonBuilder(Json& root) : dom_(root, /*allow_exceptions=*/false) {}

  bool null() { return Value() && dom_.null(); }
  bool boolean(bool v) { return Value() && dom_.boolean(v); }
  bool number_integer(Json::number_integer_t v) { return Value() && dom_.number_integer(v); }
  bool number_unsigned(Json::number_unsigned_t v) { return Value() && dom_.number_unsigned(v); }
  bool number_float(Json::number_float_t v, const std::string& text) {
    return Value() && dom_.number_float(v, text);
  }
  bool string(std::string& v) { return Value() && dom_.string(v); }
  bool binary(Json::binary_t& v) { return Value() && dom_.binary(v); }
  bool start_object(std::size_t size) { return Open(false) && dom_.start_object(size); }
  bool end_object() {
    open_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t size) { return Open(true) && dom_.start_array(size); }
  bool end_array() {
    open_.pop_back();
    return dom_.end_array();
  }
  bool key(std::string& name) {
    if (!Count()) return false;
    if (open_.size() == 1 && !top_names_.insert(name).second) {
      error_ = absl::StrCat("header names '", Printable(name), "' twice");
      return false;
    }
    return dom_.key(name);
  }
  template <class Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/, const Exception& e) {
    error_ = absl::StrCat("header is not valid JSON: ", Printable(e.what()));
    return false;
  }

  // Why parsing stopped.
  const std::string& error() const { return error_; }

 private:
  struct Container {
    bool array;
    int64_t elements;
  };
  // One more value or name.
  bool Count() {
    if (++values_ > kMaxSafetensorsHeaderValues) {
      error_ = absl::StrCat("header holds more than ", kMaxSafetensorsHeaderValues,
                            " JSON values and names");
      return false;
    }
    return true;
  }
  // One more value, in its container.
  bool Value() {
    if (!Count()) return false;
    if (!open_.empty() && open_.back().array && ++open_.back().elements > kMaxJsonArrayElements) {
      error_ = absl::StrCat("header has a list of more than ", kMaxJsonArrayElements, " elements");
      return false;
    }
    return true;
  }
  bool Open(bool array) {
    if (!Value()) return false;
    if (static_cast<int>(open_.size()) >= kMaxJsonDepth) {
      error_ = absl::StrCat("header nests deeper than ", kMaxJsonDepth, " levels");
      return false;
    }
    open_.push_back({array, 0});
    return true;
  }

  nlohmann::detail::json_sax_dom_parser<Json> dom_;
  std::vector<Container> open_;
  std::set<std::string, std::less<>> top_names_;
  int64_t values_ = 0;
  std::string error_;
};

// A non-negative JSON integer as int64, or nullopt.
std::optional<int64_t> NonNegativeInt(const Json& value) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return static_cast<int64_t>(v);
}

absl::Status ParseEntry(absl::string_view display_name, const std::string& name, const Json& entry,
                        int64_t data_size, SafetensorsTensor* tensor) {
  const std::string where = absl::StrCat(display_name, ": tensor '", Printable(name), "'");
  if (!entry.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not an object"));
  for (const auto& [key, unused] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown field '", Printable(key), "'"));
    }
  }
  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": dtype missing or not a string"));
  }
  const std::optional<SafetensorsDtype> parsed_dtype = ParseDtype(dtype->get_ref<const std::string&>());
  if (!parsed_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": unknown dtype '", Printable(dtype->get_ref<const std::string&>()), "'"));
  }
  tensor->dtype = *parsed_dtype;

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": shape missing or not a list"));
  }
  if (shape->size() > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shape has ", shape->size(), " dimensions (at most ", kMaxRank, ")"));
  }
  tensor->shape.clear();
  for (const Json& dim : *shape) {
    const std::optional<int64_t> d = NonNegativeInt(dim);
    if (!d) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape holds '", Printable(dim.dump()),
                       "', not a non-negative 64-bit integer"));
    }
    tensor->shape.push_back(*d);
  }
  const std::optional<int64_t> elements = CheckedProduct(tensor->shape);
  const std::optional<int64_t> bytes =
      elements ? CheckedMul(*elements, DtypeSize(tensor->dtype)) : std::nullopt;
  if (!bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": shape [", absl::StrJoin(tensor->shape, ", "), "] overflows"));
  }

  const auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets missing or not [begin, end]"));
  }
  const std::optional<int64_t> begin = NonNegativeInt((*offsets)[0]);
  const std::optional<int64_t> end = NonNegativeInt((*offsets)[1]);
  if (!begin || !end || *begin > *end) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": data_offsets ", Printable(offsets->dump()),
        " are not non-negative integers with begin <= end"));
  }
  if (*end > data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets [", *begin, ", ", *end,
                     "] pass the end of the data section (", data_size,
                     " bytes): out of range, or the file is truncated"));
  }
  if (*end - *begin != *bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": data_offsets [", *begin, ", ", *end, "] hold ", *end - *begin,
        " bytes, but shape [", absl::StrJoin(tensor->shape, ", "), "] of ",
        DtypeName(tensor->dtype), " needs ", *bytes));
  }
  tensor->begin = *begin;
  tensor->end = *end;
  return absl::OkStatus();
}

// Reads exactly `size` bytes at `offset`, retrying short reads and EINTR.
absl::Status ReadAt(int fd, int64_t offset, int64_t size, char* out, absl::string_view display_name) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, static_cast<size_t>(size), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InvalidArgumentError(
          absl::StrCat(display_name, ": read failed at byte ", offset, ": ", std::strerror(errno)));
    }
    if (n == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          display_name, ": unexpected end of file at byte ", offset, " (truncated)"));
    }
    out += n;
    offset += n;
    size -= n;
  }
  return absl::OkStatus();
}

}  // namespace

int64_t DtypeSize(SafetensorsDtype dtype) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == dtype) return info.size;
  }
  return 1;
}

absl::string_view DtypeName(SafetensorsDtype dtype) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "?";
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t out;
  if (exponent == 0x1f) {  // inf / NaN
    out = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    out = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // zero
    out = sign;
  } else {  // subnormal: normalize
    uint32_t e = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}

absl::Status ParseSafetensorsHeader(
    absl::string_view header, int64_t data_size, absl::string_view display_name,
    std::map<std::string, SafetensorsTensor, std::less<>>* tensors,
    std::map<std::string, std::string, std::less<>>* metadata) {
  Json root;
  BoundedJsonBuilder builder(root);
  bool parsed = false;
  try {
    parsed = Json::sax_parse(header.begin(), header.end(), &builder);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(display_name, ": out of memory parsing the header"));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(display_name, ": header is not valid JSON: ", Printable(e.what())));
  }
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrCat(
        display_name, ": ", builder.error().empty() ? "header is not valid JSON" : builder.error()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(display_name, ": header is JSON but not an object"));
  }
  tensors->clear();
  metadata->clear();
  try {
    for (auto& [name, entry] : root.get_ref<Json::object_t&>()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) {
          return absl::InvalidArgumentError(
              absl::StrCat(display_name, ": __metadata__ is not an object"));
        }
        for (auto& [key, value] : entry.get_ref<Json::object_t&>()) {
          if (!value.is_string()) {
            return absl::InvalidArgumentError(absl::StrCat(
                display_name, ": __metadata__ '", Printable(key), "' is not a string"));
          }
          // Moved, not copied: a header's strings are held once.
          (*metadata)[key] = std::move(value.get_ref<std::string&>());
        }
        continue;
      }
      SafetensorsTensor tensor;
      ATTNSERVE_RETURN_IF_ERROR(ParseEntry(display_name, name, entry, data_size, &tensor));
      tensors->emplace(name, std::move(tensor));
    }
  } catch (const std::exception& e) {  // nlohmann type errors: not expected after the checks
    return absl::InvalidArgumentError(
        absl::StrCat(display_name, ": malformed header: ", e.what()));
  }
  // No two tensors may share bytes (empty tensors occupy none).
  std::vector<std::pair<const std::string*, const SafetensorsTensor*>> by_offset;
  for (const auto& [name, tensor] : *tensors) {
    if (tensor.end > tensor.begin) by_offset.emplace_back(&name, &tensor);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i].second->begin < by_offset[i - 1].second->end) {
      return absl::InvalidArgumentError(absl::StrCat(
          display_name, ": tensors '", Printable(*by_offset[i - 1].first), "' [",
          by_offset[i - 1].second->begin, ", ", by_offset[i - 1].second->end, ") and '",
          Printable(*by_offset[i].first), "' [", by_offset[i].second->begin, ", ",
          by_offset[i].second->end, ") overlap"));
    }
  }
  return absl::OkStatus();
}

SafetensorsFile::SafetensorsFile(int fd, std::string display_name)
    : fd_(fd), display_name_(std::move(display_name)) {}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      display_name_(std::move(other.display_name_)),
      file_size_(other.file_size_),
      data_start_(other.data_start_),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    display_name_ = std::move(other.display_name_);
    file_size_ = other.file_size_;
    data_start_ = other.data_start_;
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromFd(int fd, std::string display_name) {
  SafetensorsFile file(fd, std::move(display_name));  // owns fd from here on
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(file.display_name_, ": not an open file"));
  }
  ATTNSERVE_RETURN_IF_ERROR(file.ParseHeader());
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  return FromFd(fd, path);
}

absl::Status SafetensorsFile::ParseHeader() {
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(display_name_, ": cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(display_name_, ": not a regular file"));
  }
  file_size_ = st.st_size;
  if (file_size_ < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        display_name_, ": ", file_size_, " bytes, shorter than the 8-byte header length"));
  }
  unsigned char length_bytes[8];
  ATTNSERVE_RETURN_IF_ERROR(
      ReadAt(fd_, 0, 8, reinterpret_cast<char*>(length_bytes), display_name_));
  uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  if (header_length > static_cast<uint64_t>(file_size_ - 8)) {
    return absl::InvalidArgumentError(
        absl::StrCat(display_name_, ": header length ", header_length, " passes the end of the file (",
                     file_size_, " bytes)"));
  }
  if (header_length > static_cast<uint64_t>(kMaxSafetensorsHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(display_name_, ": header length ", header_length,
                                                   " exceeds the limit ",
                                                   kMaxSafetensorsHeaderBytes));
  }
  std::string header(header_length, '\0');  // bounded by the file size and the limit above
  ATTNSERVE_RETURN_IF_ERROR(
      ReadAt(fd_, 8, static_cast<int64_t>(header_length), header.data(), display_name_));
  data_start_ = 8 + static_cast<int64_t>(header_length);
  return ParseSafetensorsHeader(header, file_size_ - data_start_, display_name_, &tensors_,
                                &metadata_);
}

absl::StatusOr<const SafetensorsTensor*> SafetensorsFile::Find(absl::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat(display_name_, ": no tensor named '", Printable(name), "'"));
  }
  return &it->second;
}

absl::Status SafetensorsFile::CheckFloat(absl::string_view name) const {
  ATTNSERVE_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, Find(name));
  switch (tensor->dtype) {
    case SafetensorsDtype::kF32:
    case SafetensorsDtype::kBF16:
    case SafetensorsDtype::kF16:
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          display_name_, ": tensor '", Printable(name), "' has dtype ", DtypeName(tensor->dtype),
          "; weights must be F32, BF16 or F16"));
  }
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloat(absl::string_view name) const {
  ATTNSERVE_RETURN_IF_ERROR(CheckFloat(name));
  const SafetensorsTensor* tensor = &tensors_.find(name)->second;
  const bool f32 = tensor->dtype == SafetensorsDtype::kF32;
  const bool bf16 = tensor->dtype == SafetensorsDtype::kBF16;
  const int64_t bytes = tensor->end - tensor->begin;
  const int64_t elements = bytes / DtypeSize(tensor->dtype);
  // The one allocation, of the size the header declared (checked against the
  // file's size by Open; callers bound it beforehand, e.g. LoadCheckpointWeights
  // against its budget). Running out of memory is this call's error, not an
  // exception.
  auto out_of_memory = [&] {
    return absl::ResourceExhaustedError(
        absl::StrCat(display_name_, ": out of memory reading tensor '", Printable(name), "' (",
                     elements * int64_t{sizeof(float)}, " bytes as FP32)"));
  };
  std::vector<float> out;
  try {
    out.resize(static_cast<size_t>(elements));
  } catch (const std::bad_alloc&) {
    return out_of_memory();
  } catch (const std::length_error&) {
    return out_of_memory();
  }
  char* const out_bytes = reinterpret_cast<char*>(out.data());
  if (f32) {
    ATTNSERVE_RETURN_IF_ERROR(
        ReadAt(fd_, data_start_ + tensor->begin, bytes, out_bytes, display_name_));
    // The format is little-endian, as is every platform this builds on.
    static_assert(std::endian::native == std::endian::little);
    return out;
  }
  // BF16 and F16 are widened in place, with no second buffer: the n 2-byte
  // values are read into the upper half of the n floats' bytes and widened
  // front to back, so float i (bytes [4i, 4i + 4)) never overwrites a value
  // not yet widened (value j > i is at bytes [2n + 2j, 2n + 2j + 2)).
  const char* const raw = out_bytes + bytes;
  ATTNSERVE_RETURN_IF_ERROR(
      ReadAt(fd_, data_start_ + tensor->begin, bytes, out_bytes + bytes, display_name_));
  for (int64_t i = 0; i < elements; ++i) {
    uint16_t bits;
    std::memcpy(&bits, raw + 2 * i, sizeof(bits));
    out[i] = bf16 ? Bfloat16ToFloat(bits) : HalfToFloat(bits);
  }
  return out;
}

}  // namespace attnserve::core
