#ifndef ATTNSERVE_CORE_KERNELS_PRIMITIVES_H_
#define ATTNSERVE_CORE_KERNELS_PRIMITIVES_H_

// Private to core/: oneDNN primitives, built once per shape and cached, and
// the steps every route shares (the projections' matmul, BF16 conversion).

#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {

struct WorkspaceState;

// One primitive and the scratchpad it needs.
struct Step {
  dnnl::primitive primitive;
  dnnl::memory::desc scratchpad;
};

// Primitives by shape key, the least recently used evicted past a bound (a
// rebuild is cheap only while oneDNN's own cache still holds the primitive;
// the server turns that cache off: SetOneDnnPrimitiveCacheCapacityUnlessSet
// in core/workspace.h). A key holds
// everything the primitive depends on (kind, shapes, data types, strides,
// scale), so one cache serves every layer. Not thread-safe.
class PrimitiveCache {
 public:
  using Key = std::vector<int64_t>;
  // Cache key kinds (the first element of a key).
  enum Kind : int64_t { kLinear, kScores, kSoftmax, kToBf16, kContext, kBlockScores, kBlockValues };

  // The cached step for `key`, made from make() (a primitive_desc) on a miss.
  template <typename Primitive, typename MakeDesc>
  Step Get(const Key& key, MakeDesc make);

  size_t size() const { return steps_.size(); }

 private:
  static constexpr size_t kMaxSteps = 256;
  struct Entry {
    Step step;
    uint64_t last_use = 0;
  };
  std::map<Key, Entry> steps_;
  uint64_t clock_ = 0;
};

template <typename Primitive, typename MakeDesc>
Step PrimitiveCache::Get(const Key& key, MakeDesc make) {
  auto it = steps_.find(key);
  if (it == steps_.end()) {
    if (steps_.size() >= kMaxSteps) {
      auto oldest = steps_.begin();
      for (auto e = steps_.begin(); e != steps_.end(); ++e) {
        if (e->second.last_use < oldest->second.last_use) oldest = e;
      }
      steps_.erase(oldest);
    }
    const typename Primitive::primitive_desc pd = make();
    it = steps_.emplace(key, Entry{Step{Primitive(pd), pd.scratchpad_desc()}, 0}).first;
  }
  it->second.last_use = ++clock_;
  return it->second.step;
}

using Args = std::unordered_map<int, dnnl::memory>;

inline dnnl::memory::data_type OperandType(bool bf16) {
  return bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
}

// An attribute asking for the scratchpad to come from the caller (RunStep).
dnnl::primitive_attr UserScratchpad();

// Executes `step` on the workspace's stream, its scratchpad in the
// workspace's. RESOURCE_EXHAUSTED when that memory is not available.
absl::Status RunStep(WorkspaceState& workspace, const Step& step, Args args);

// A memory object over `data` (only read when it is an input).
dnnl::memory Memory(const WorkspaceState& workspace, const dnnl::memory::desc& desc,
                    const void* data);

// y [rows, out] = x [rows, in] w [in, out] + b [out], row-major, w with a row
// stride of w_stride >= out elements (a column block of a wider matrix) and y
// with one of y_stride >= out; x and w are FP32 or (bf16) BF16, b FP32, y
// FP32 or (y_bf16) BF16. One FP32 row through large weights runs RowLinear
// (core/kernels/row_linear.h), the rest oneDNN's matmul.
absl::Status Linear(WorkspaceState& workspace, int64_t rows, int64_t in, int64_t out,
                    int64_t w_stride, bool bf16, const void* x, const void* w, const float* b,
                    void* y, int64_t y_stride, bool y_bf16);

// to[i] = FloatToBf16(from[i]) for i < n, on the OpenMP threads.
void ConvertToBf16(const float* from, int64_t n, Bf16* to);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_PRIMITIVES_H_
