#include "core/onednn_util.h"

#include <cstdint>
#include <cstdlib>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/route.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {

absl::StatusOr<dnnl::engine> CpuEngine() {
  // A function-local static: created once, thread-safe, never destroyed
  // (primitives may outlive any other owner at exit).
  static const auto* const engine = []() -> absl::StatusOr<dnnl::engine>* {
    try {
      return new absl::StatusOr<dnnl::engine>(dnnl::engine(dnnl::engine::kind::cpu, 0));
    } catch (const dnnl::error& e) {
      return new absl::StatusOr<dnnl::engine>(
          StatusFromDnnlError(e, "creating the oneDNN CPU engine"));
    }
  }();
  return *engine;
}

absl::Status StatusFromDnnlError(const dnnl::error& error, absl::string_view what) {
  return absl::InternalError(absl::StrCat("oneDNN failed ", what, " (dnnl_status ",
                                          static_cast<int>(error.status), "): ", error.what()));
}

void ScratchBuffer::Free::operator()(void* p) const { std::free(p); }

absl::Status ScratchBuffer::Reserve(int64_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  if (bytes > INT64_MAX - kScratchAlignment) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  // std::aligned_alloc wants a multiple of the alignment.
  const int64_t rounded = (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
  data_.reset();
  capacity_ = 0;
  void* p = std::aligned_alloc(kScratchAlignment, static_cast<size_t>(rounded));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", rounded, " bytes of scratch memory"));
  }
  data_.reset(p);
  capacity_ = rounded;
  return absl::OkStatus();
}

}  // namespace attnserve::core::internal
