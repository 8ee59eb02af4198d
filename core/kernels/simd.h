#ifndef ATTNSERVE_CORE_KERNELS_SIMD_H_
#define ATTNSERVE_CORE_KERNELS_SIMD_H_

// Private to core/: how the element-wise loops of the core get their vector
// versions.
//
// ATTNSERVE_CLONES on a function gives it an AVX-512 clone, an AVX2 clone and
// the baseline, chosen once by the dynamic loader (GCC's target_clones on
// ifunc). The clones are ISA levels (x86-64-v4: AVX-512 F/BW/CD/DQ/VL;
// x86-64-v3: AVX2, FMA, BMI1/2, F16C), which the resolver picks by the CPU's
// features. Not "arch=haswell"/"arch=skylake-avx512": for those GCC's
// resolver tests the CPU *model* (__builtin_cpu_is), so every AMD CPU, and
// every Intel one but those two models, ran the baseline. Sanitizer builds take the baseline: an ifunc resolver runs while the
// dynamic loader relocates, before the sanitizer's runtime is set up, and its
// instrumented code crashes there (seen under TSan).
//
// ATTNSERVE_SIMD_LOOP before a loop makes it `omp simd` so that it vectorizes
// at -O2 whatever the cost model says; simdlen(16) asks for full 512-bit
// vectors in the AVX-512 clone. clang with sanitizers cannot vectorize such
// loops and reports that as an error under -Werror, so it gets plain loops.

// ATTNSERVE_X86_INTRINSICS is defined where <immintrin.h> is included (x86-64
// with GCC or clang): the hand-written AVX-512 kernels, in functions with
// target attributes, chosen at run time (__builtin_cpu_supports).
#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_ps(),
// which -Wmaybe-uninitialized reports where they are inlined.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define ATTNSERVE_X86_INTRINSICS 1

// The two instruction sets of those kernels, as function attributes, and
// whether this CPU has them (checked once).
#define ATTNSERVE_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define ATTNSERVE_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
// AVX2 and FMA (x86-64-v3): every x86 server of the last decade, AVX-512 ones
// included.
#define ATTNSERVE_TARGET_AVX2_FMA __attribute__((target("avx2,fma")))

namespace attnserve::core::internal {

inline bool CpuHasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}

inline bool CpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

inline bool CpuHasAvx512Bf16() {
  static const bool has = CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

// The mask of the first min(n, 16) lanes (n >= 0).
ATTNSERVE_TARGET_AVX512 inline __mmask16 FirstLanes(int64_t n) {
  return n >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << n) - 1u);
}

}  // namespace attnserve::core::internal
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define ATTNSERVE_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTNSERVE_CLONES
#endif

#if defined(__clang__)
#define ATTNSERVE_SIMD_LOOP
#else
#define ATTNSERVE_SIMD_LOOP _Pragma("omp simd simdlen(16)")
#endif

#endif  // ATTNSERVE_CORE_KERNELS_SIMD_H_
