#ifndef ATTNSERVE_CORE_KERNELS_WORKSPACE_STATE_H_
#define ATTNSERVE_CORE_KERNELS_WORKSPACE_STATE_H_

// Private to core/: what a Workspace holds -- the oneDNN stream and
// primitives a forward runs, and the scratch buffers its route sizes.

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/kernels/primitives.h"
#include "core/onednn_util.h"
#include "core/route.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {

// The oneDNN blocks' memory objects and argument arrays of one thread for one
// block shape ([last query block][last key block]), kept while the block
// shapes stay the same, so that a block only moves data handles.
struct OneDnnBlockArgs {
  dnnl::memory q, k_t, s, p, v, pv, scores_pad, values_pad;
  dnnl_exec_arg_t scores_args[4] = {};
  dnnl_exec_arg_t values_args[4] = {};
  int scores_count = 3;
  int values_count = 3;
};
struct OneDnnBlockArgsSet {
  // bq, bk, last mq, last mk, head_dim, bf16, the row strides of q, k, v.
  std::array<int64_t, 9> key = {};
  OneDnnBlockArgs args[2][2];
};

// Not thread-safe: one forward at a time.
struct WorkspaceState {
  explicit WorkspaceState(dnnl::engine engine_in)
      : engine(std::move(engine_in)), stream(engine) {}

  // Grows every buffer to at least the route's size (never shrinks).
  // RESOURCE_EXHAUSTED when the memory is not available.
  absl::Status Reserve(const Route& route);
  ScratchBuffer& buffer(Scratch which) { return buffers[static_cast<int>(which)]; }
  template <typename T>
  T* data(Scratch which) {
    return static_cast<T*>(buffer(which).data());
  }

  const dnnl::engine engine;
  dnnl::stream stream;
  PrimitiveCache primitives;
  std::array<ScratchBuffer, kScratchCount> buffers;
  // oneDNN's scratchpads: of the primitives run on `stream`, and the blocked
  // path's one per thread. Sized by the primitives, not by the route.
  ScratchBuffer scratchpad;
  ScratchBuffer block_scratchpads;
  std::vector<dnnl::stream> block_streams;
  std::vector<OneDnnBlockArgsSet> block_args;
};

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_WORKSPACE_STATE_H_
