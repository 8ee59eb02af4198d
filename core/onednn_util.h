#ifndef ATTNSERVE_CORE_ONEDNN_UTIL_H_
#define ATTNSERVE_CORE_ONEDNN_UTIL_H_

// Private to core/: the oneDNN glue shared by the kernels.

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {

// The process's one CPU engine, created on first use. Thread-safe; a failure
// to create it is INTERNAL (and remembered).
absl::StatusOr<dnnl::engine> CpuEngine();

// INTERNAL with `what` and the oneDNN status and message.
absl::Status StatusFromDnnlError(const dnnl::error& error, absl::string_view what);

// Memory aligned to 64 bytes (a cache line, the widest vector) that only grows
// (in multiples of kScratchAlignment), so scratch buffers are allocated once
// per high-water mark. Not thread-safe.
class ScratchBuffer {
 public:
  // Makes data() hold at least `bytes` bytes; the contents are undefined after
  // a growth. RESOURCE_EXHAUSTED when the memory is not available.
  absl::Status Reserve(int64_t bytes);

  // Frees the memory (capacity 0).
  void Release() {
    data_.reset();
    capacity_ = 0;
  }
  void* data() const { return data_.get(); }
  float* floats() const { return static_cast<float*>(data_.get()); }
  int64_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_;
  int64_t capacity_ = 0;
};

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_ONEDNN_UTIL_H_
