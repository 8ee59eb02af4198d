#include "core/kernels/row_linear.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "core/kernels/simd.h"

#if defined(ATTNSERVE_X86_INTRINSICS)
#include <immintrin.h>
#endif

namespace attnserve::core::internal {
namespace {

// Weights from this many floats (1 MiB) on: past the caches a step keeps warm.
constexpr int64_t kMinWeights = int64_t{1} << 18;

#if defined(ATTNSERVE_X86_INTRINSICS)
// acc [out] += sum over k in [first, last) of x[k] w[k, :]: four rows of w a
// pass, so that acc is loaded and stored once for four rows' products.
ATTNSERVE_TARGET_AVX512 void AccumulateRows(const float* x, const float* w, int64_t w_stride,
                                            int64_t first, int64_t last, int64_t out,
                                            float* acc) {
  const int64_t whole = out / 16 * 16;
  const __mmask16 tail = FirstLanes(out - whole);
  int64_t k = first;
  for (; k + 4 <= last; k += 4) {
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    const __m512 x2 = _mm512_set1_ps(x[k + 2]), x3 = _mm512_set1_ps(x[k + 3]);
    const float* const w0 = w + k * w_stride;
    const float* const w1 = w0 + w_stride;
    const float* const w2 = w1 + w_stride;
    const float* const w3 = w2 + w_stride;
    for (int64_t o = 0; o < whole; o += 16) {
      __m512 a = _mm512_loadu_ps(acc + o);
      a = _mm512_fmadd_ps(x0, _mm512_loadu_ps(w0 + o), a);
      a = _mm512_fmadd_ps(x1, _mm512_loadu_ps(w1 + o), a);
      a = _mm512_fmadd_ps(x2, _mm512_loadu_ps(w2 + o), a);
      a = _mm512_fmadd_ps(x3, _mm512_loadu_ps(w3 + o), a);
      _mm512_storeu_ps(acc + o, a);
    }
    if (whole < out) {
      __m512 a = _mm512_maskz_loadu_ps(tail, acc + whole);
      a = _mm512_fmadd_ps(x0, _mm512_maskz_loadu_ps(tail, w0 + whole), a);
      a = _mm512_fmadd_ps(x1, _mm512_maskz_loadu_ps(tail, w1 + whole), a);
      a = _mm512_fmadd_ps(x2, _mm512_maskz_loadu_ps(tail, w2 + whole), a);
      a = _mm512_fmadd_ps(x3, _mm512_maskz_loadu_ps(tail, w3 + whole), a);
      _mm512_mask_storeu_ps(acc + whole, tail, a);
    }
  }
  for (; k < last; ++k) {
    const __m512 xk = _mm512_set1_ps(x[k]);
    const float* const wk = w + k * w_stride;
    for (int64_t o = 0; o < whole; o += 16) {
      _mm512_storeu_ps(acc + o,
                       _mm512_fmadd_ps(xk, _mm512_loadu_ps(wk + o), _mm512_loadu_ps(acc + o)));
    }
    if (whole < out) {
      const __m512 a = _mm512_fmadd_ps(xk, _mm512_maskz_loadu_ps(tail, wk + whole),
                                       _mm512_maskz_loadu_ps(tail, acc + whole));
      _mm512_mask_storeu_ps(acc + whole, tail, a);
    }
  }
}
#endif

}  // namespace

bool RowLinearTakes(int64_t in, int64_t out) {
#if defined(ATTNSERVE_X86_INTRINSICS)
  return CpuHasAvx512() && in * out >= kMinWeights;
#else
  (void)in;
  (void)out;
  return false;
#endif
}

void RowLinear(const float* x, int64_t in, int64_t out, const float* w, int64_t w_stride,
               const float* b, float* y, float* partials) {
#if defined(ATTNSERVE_X86_INTRINSICS)
  int threads = 1;
#pragma omp parallel
  {
    const int t = omp_get_thread_num();
    const int n = omp_get_num_threads();
    if (t == 0) threads = n;
    // Rows in runs of 4, shared out evenly.
    const int64_t quads = (in + 3) / 4;
    const int64_t first = std::min(in, quads * t / n * 4);
    const int64_t last = std::min(in, quads * (t + 1) / n * 4);
    float* const acc = t == 0 ? y : partials + (t - 1) * out;
    std::fill(acc, acc + out, 0.0f);
    AccumulateRows(x, w, w_stride, first, last, out, acc);
  }
  for (int t = 1; t < threads; ++t) {
    const float* const part = partials + (t - 1) * out;
    for (int64_t o = 0; o < out; ++o) y[o] += part[o];
  }
  for (int64_t o = 0; o < out; ++o) y[o] += b[o];
#else
  (void)x, (void)in, (void)out, (void)w, (void)w_stride, (void)b, (void)y, (void)partials;
#endif
}

}  // namespace attnserve::core::internal
