#include "core/workspace.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/kernels/workspace_state.h"
#include "core/onednn_util.h"
#include "core/status_macros.h"

namespace attnserve::core {

namespace internal {

absl::Status WorkspaceState::Reserve(const Route& route) {
  for (int i = 0; i < kScratchCount; ++i) {
    ATTNSERVE_RETURN_IF_ERROR(buffers[i].Reserve(route.bytes[i]));
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<Workspace>> Workspace::Create() {
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::engine engine, internal::CpuEngine());
  try {
    return std::unique_ptr<Workspace>(
        new Workspace(std::make_unique<internal::WorkspaceState>(std::move(engine))));
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "creating a workspace");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory creating a workspace");
  }
}

Workspace::Workspace(std::unique_ptr<internal::WorkspaceState> state) : state_(std::move(state)) {}

Workspace::~Workspace() = default;

int64_t Workspace::route_bytes() const {
  int64_t total = 0;
  for (const internal::ScratchBuffer& buffer : state_->buffers) total += buffer.capacity();
  return total;
}

int64_t Workspace::bytes() const {
  return route_bytes() + state_->scratchpad.capacity() + state_->block_scratchpads.capacity();
}

absl::StatusOr<int> SetOneDnnPrimitiveCacheCapacityUnlessSet(int capacity) {
  if (capacity < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("oneDNN's primitive cache capacity: ", capacity, " is negative"));
  }
  if (std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == nullptr &&
      std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY") == nullptr) {
    try {
      dnnl::set_primitive_cache_capacity(capacity);
    } catch (const dnnl::error& e) {
      return internal::StatusFromDnnlError(e, "setting its primitive cache's capacity");
    }
  }
  return OneDnnPrimitiveCacheCapacity();
}

int OneDnnPrimitiveCacheCapacity() {
  int capacity = 0;
  // Cannot fail: the C call only reads a value.
  dnnl_get_primitive_cache_capacity(&capacity);
  return capacity;
}

void Workspace::Release() {
  for (internal::ScratchBuffer& buffer : state_->buffers) buffer.Release();
  state_->scratchpad.Release();
  state_->block_scratchpads.Release();
}

}  // namespace attnserve::core
