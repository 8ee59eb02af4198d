#ifndef ATTNSERVE_CORE_WORKSPACE_H_
#define ATTNSERVE_CORE_WORKSPACE_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace attnserve::core {

namespace internal {
struct WorkspaceState;
}

// Where forwards run: a oneDNN stream, the primitives built for the shapes
// seen (one cache for every layer), and the scratch buffers a route sizes
// (see Route; they grow to the largest route run and are kept for the next
// forward until Release). A layer or core holds only its weights; the memory a
// forward computes in is the workspace's, so one workspace serves any number
// of models.
//
// Not thread-safe: one forward at a time per workspace (a server's compute
// worker owns one). Forwards given no workspace make one for the call.
class Workspace {
 public:
  // INTERNAL when oneDNN's CPU engine cannot be created.
  static absl::StatusOr<std::unique_ptr<Workspace>> Create();
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Bytes of the scratch buffers held (the route-sized ones and oneDNN's
  // scratchpads).
  int64_t bytes() const;
  // Bytes held of the buffers a route sizes (Route::scratch_bytes counts
  // these): after a forward on a new workspace, equal to its route's
  // scratch_bytes.
  int64_t route_bytes() const;
  // Frees the scratch buffers (the primitives stay); the next forward
  // allocates what its route needs.
  void Release();

  internal::WorkspaceState& state() { return *state_; }

 private:
  explicit Workspace(std::unique_ptr<internal::WorkspaceState> state);
  std::unique_ptr<internal::WorkspaceState> state_;
};

// oneDNN keeps a process-wide cache of its own (1024 primitives unless
// ONEDNN_PRIMITIVE_CACHE_CAPACITY says otherwise) beside each workspace's
// (a bounded number, least recently used evicted). It only saves work when a
// primitive is built again: by a workspace that evicted it, or by forwards
// given no workspace (each makes its own). A process whose forwards all run on
// a few long-lived workspaces (a server's compute worker) mostly keeps in it
// a second reference to what the workspaces hold, and up to its capacity of
// shapes they evicted: memory that grows as new shapes arrive.
//
// Sets that capacity (0: oneDNN keeps no primitive of its own) unless the
// environment sets it (ONEDNN_PRIMITIVE_CACHE_CAPACITY or the older
// DNNL_PRIMITIVE_CACHE_CAPACITY: a deployment's choice wins). Returns the
// capacity in force. INVALID_ARGUMENT for a negative capacity. Thread-safe.
absl::StatusOr<int> SetOneDnnPrimitiveCacheCapacityUnlessSet(int capacity);

// The capacity of oneDNN's own primitive cache in force. Thread-safe.
int OneDnnPrimitiveCacheCapacity();

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_WORKSPACE_H_
