#ifndef ATTNSERVE_CORE_KERNELS_ONLINE_SOFTMAX_H_
#define ATTNSERVE_CORE_KERNELS_ONLINE_SOFTMAX_H_

// Private to core/: the row kernels of the blocked (flash-style) attention
// path. The online softmax has AVX-512 and AVX2 versions in intrinsics,
// chosen at run time by the CPU's features: strips of up to 8 rows where the
// CPU has AVX512-BF16 (a single row is a strip of one), a row kernel where it
// has AVX-512 F/BW/DQ/VL only, an FP32 row kernel where it has AVX2 and FMA,
// and a portable row elsewhere. The others are plain C++ that GCC vectorizes, with
// AVX-512 and AVX2 clones picked at load time (target_clones). The baseline
// build runs on any x86-64.

#include <cstdint>

namespace attnserve::core::internal {

// exp(x) for x <= 0 in FP32: 2^(x log2 e) as 2^round * p(frac), p a degree-7
// Taylor polynomial of 2^f on [-1/2, 1/2]. Relative error below
// 4e-7 + 7e-8 |x| (the polynomial, and x log2 e rounded to FP32) where
// exp(x) >= 2^-124; 0 for x < -87; NaN stays NaN.
float FastExp(float x);

// One step of the online softmax over one row of a key block:
//   x [width] holds the masked scores of keys [0, limit) of the block, to be
//   multiplied by scale > 0 (entries past limit are ignored); m is the
//   running max in the units of x.
//   m_new = max(m, max_j<limit x_j),  alpha = exp(scale (m - m_new)),
//   p_j = exp(scale (x_j - m_new)) for j < limit, 0 for limit <= j < width,
//   l = l * alpha + sum_j p_j,  m = m_new.
// p goes to x in place (p_bf16 == nullptr) or, rounded to BF16, to
// p_bf16 [width] (x is then left as it was). BF16 on a CPU with AVX512-BF16
// takes exp from a degree-4 polynomial (relative error 4.2e-5, against
// BF16's 3.9e-3 rounding), FP32 from FastExp's. Scores of any finite size
// hold these errors (a mask's -1e10 or -3e38 on every key gives p = 1 for
// each): no implementation lets the size of m into the exponent's error
// beyond 2^-16. -inf scores give p = 0. Returns alpha (1 when the row has
// nothing visible yet: m stays -inf and p is 0). Not thread-safe on the same
// row.
float OnlineSoftmaxRow(float* x, int64_t limit, int64_t width, float scale, float& m, float& l,
                       uint16_t* p_bf16);

// The implementations of the row step; OnlineSoftmaxRow takes the first
// that runs on this CPU of kAvx512Bf16 (a strip of one row), kAvx512 (FP32
// and BF16 rounded in integer lanes, degree-7 exponential), kAvx2 (AVX2+FMA:
// FP32 in 8 lanes, degree-7 exponential; BF16 as kPortable) and kPortable.
// Tests run each one that runs here through OnlineSoftmaxRowOn.
enum class SoftmaxKernel { kPortable, kAvx512, kAvx512Bf16, kAvx2 };
bool SoftmaxKernelRuns(SoftmaxKernel kernel);
float OnlineSoftmaxRowOn(SoftmaxKernel kernel, float* x, int64_t limit, int64_t width, float scale,
                         float& m, float& l, uint16_t* p_bf16);

// OnlineSoftmaxRow for rows [0, rows) of a strip, row r at x + r * stride
// with limits[r] visible keys and its state m[r], l[r]; alpha[r] gets its
// alpha; BF16 probabilities go to p_bf16 + r * stride. The same results as
// the rows one by one (on CPUs with AVX512-BF16 computed together, up to 8
// rows, for their independent dependency chains).
void OnlineSoftmaxStrip(float* x, int64_t stride, int64_t rows, const int64_t* limits,
                        int64_t width, float scale, float* m, float* l, float* alpha,
                        uint16_t* p_bf16);

// o [n] = o * alpha + add [n] (first == false), or o = add (first == true).
void ScaleAndAdd(float* o, const float* add, int64_t n, float alpha, bool first);

// to [n] = from [n] * factor.
void ScaleInto(const float* from, int64_t n, float factor, float* to);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_ONLINE_SOFTMAX_H_
