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

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_WORKSPACE_H_
