#ifndef ATTNSERVE_CORE_SAFETENSORS_H_
#define ATTNSERVE_CORE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::core {

// The element types the safetensors format names. Only F32, BF16 and F16 can
// be read as weights; the others are parsed (their sizes checked) so a
// checkpoint holding e.g. an I64 buffer beside its weights still opens.
enum class SafetensorsDtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU64, kU32, kU16, kU8,
                              kBool, kF8E5M2, kF8E4M3 };

// Bytes per element of `dtype`.
int64_t DtypeSize(SafetensorsDtype dtype);
// The format's name of `dtype` ("F32", "BF16", ...).
absl::string_view DtypeName(SafetensorsDtype dtype);

// One tensor's entry in a safetensors header.
struct SafetensorsTensor {
  SafetensorsDtype dtype;
  std::vector<int64_t> shape;
  // Byte range in the data section (after the 8-byte length and the header).
  int64_t begin = 0;
  int64_t end = 0;
};

// The largest header accepted (the format's reference implementation uses the
// same bound): a header length above it is refused before anything is read.
inline constexpr int64_t kMaxSafetensorsHeaderBytes = int64_t{100} << 20;
// The most JSON values and names a header may hold (a tensor's entry takes
// about 12; a checkpoint of 80,000 tensors fits), refused while parsing: the
// parsed header's memory is bounded by it (about 100 MiB), whatever its text
// would unfold into (a list of 50 million zeros, millions of empty objects).
inline constexpr int64_t kMaxSafetensorsHeaderValues = int64_t{1} << 20;

// A safetensors file (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON header (an object mapping
// tensor names to {"dtype", "shape", "data_offsets": [begin, end]}, plus an
// optional "__metadata__" object of strings), then the data section.
//
// Open parses and checks the whole header before any tensor is read: N within
// the file and kMaxSafetensorsHeaderBytes, the header valid JSON (nesting at
// most 8 deep, lists of at most 64 elements, at most
// kMaxSafetensorsHeaderValues values, each refused as it is parsed) and an
// object naming no tensor twice, every entry's dtype known, shape a list of non-negative integers
// whose element count (and byte size) does not overflow, offsets ordered,
// inside the data section and not overlapping another tensor's, and
// end - begin == elements x dtype size. Tensors are read later with bounded
// reads (pread) of their checked ranges only, so a 12-layer checkpoint is not
// read whole to load one layer, and nothing is allocated from an unchecked
// size.
//
// Errors are INVALID_ARGUMENT (malformed file), NOT_FOUND (no such tensor) or
// RESOURCE_EXHAUSTED (memory ran out), and name the file (as given in
// `display_name`) and the tensor.
//
// Thread-compatible: const methods may run concurrently (reads use pread);
// moving or destroying needs external synchronization.
class SafetensorsFile {
 public:
  // Takes ownership of `fd` (a regular file opened for reading; closed by the
  // destructor, and on error). `display_name` names the file in messages.
  static absl::StatusOr<SafetensorsFile> FromFd(int fd, std::string display_name);
  // Opens `path` (O_RDONLY | O_CLOEXEC | O_NONBLOCK, so a FIFO never blocks
  // the open; FromFd then refuses anything but a regular file) and parses it. For tests and tools:
  // the server opens files through server/models/model_repository.h's checks.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& display_name() const { return display_name_; }
  // Every tensor's entry, by name.
  const std::map<std::string, SafetensorsTensor, std::less<>>& tensors() const { return tensors_; }
  // "__metadata__", when the header has it.
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }

  // The entry of `name`, or NOT_FOUND naming the file and the tensor.
  absl::StatusOr<const SafetensorsTensor*> Find(absl::string_view name) const;

  // OK when ReadFloat can read tensor `name`: it exists and is F32, BF16 or
  // F16. NOT_FOUND or INVALID_ARGUMENT as ReadFloat's otherwise. Reads
  // nothing.
  absl::Status CheckFloat(absl::string_view name) const;

  // Reads tensor `name` and converts it to FP32 (row-major, as stored),
  // allocating only the result (elements x 4 bytes, as the header declares:
  // bound it before calling, e.g. with core/checkpoint_layouts.h's
  // CheckpointWeightBytes). NOT_FOUND when absent; INVALID_ARGUMENT when its
  // dtype is not F32, BF16 or F16, or the file is shorter than its header said
  // (truncated after Open); RESOURCE_EXHAUSTED when memory runs out.
  absl::StatusOr<std::vector<float>> ReadFloat(absl::string_view name) const;

 private:
  SafetensorsFile(int fd, std::string display_name);
  absl::Status ParseHeader();

  int fd_ = -1;
  std::string display_name_;
  int64_t file_size_ = 0;
  int64_t data_start_ = 0;  // 8 + header length
  std::map<std::string, SafetensorsTensor, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

// Parses a safetensors header (the JSON text alone) against a data section of
// `data_size` bytes, with the checks of SafetensorsFile. `display_name` names
// the file in messages. Exposed for the header fuzz target
// (tests/fuzz/safetensors_header_fuzzer.cc).
absl::Status ParseSafetensorsHeader(
    absl::string_view header, int64_t data_size, absl::string_view display_name,
    std::map<std::string, SafetensorsTensor, std::less<>>* tensors,
    std::map<std::string, std::string, std::less<>>* metadata);

// IEEE binary16 bits to float (exact); bfloat16: core/bf16.h.
float HalfToFloat(uint16_t bits);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_SAFETENSORS_H_
