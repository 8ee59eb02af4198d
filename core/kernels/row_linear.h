#ifndef ATTNSERVE_CORE_KERNELS_ROW_LINEAR_H_
#define ATTNSERVE_CORE_KERNELS_ROW_LINEAR_H_

// Private to core/: one row through a linear layer, y = x w + b, for Linear
// (core/kernels/primitives.h) when a decode step of one sequence projects one
// token. There the weights are the step's largest read after the KV cache
// (16.8 MB of FP32 weights for d_model 1024), read once a step: the row's
// time is the weights' bytes over the memory's bandwidth, which oneDNN's
// matmul of one row reached about half of on the Zen 5 (docs/measurements.md,
// "One token's projections").

#include <cstdint>

namespace attnserve::core::internal {

// Whether RowLinear runs on this CPU (AVX-512) and pays for a layer of
// `in` x `out` weights: large enough to come from memory.
bool RowLinearTakes(int64_t in, int64_t out);

// y [out] = x [in] w [in, out] + b [out], FP32; w row-major with a row stride
// of w_stride >= out elements. The OpenMP threads each stream a contiguous
// run of w's rows into their own partial sums, added at the end: `partials`
// holds (omp_get_max_threads() - 1) * out floats. Only where RowLinearTakes.
void RowLinear(const float* x, int64_t in, int64_t out, const float* w, int64_t w_stride,
               const float* b, float* y, float* partials);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_ROW_LINEAR_H_
