#ifndef ATTNSERVE_CORE_SIMD_H_
#define ATTNSERVE_CORE_SIMD_H_

// Private to core/: how the element-wise loops of the core get their vector
// versions.
//
// ATTNSERVE_CLONES on a function gives it an AVX-512 clone, an AVX2 clone and
// the baseline, chosen once by the dynamic loader (GCC's target_clones on
// ifunc). Sanitizer builds take the baseline: an ifunc resolver runs while the
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
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define ATTNSERVE_CLONES \
  __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define ATTNSERVE_CLONES
#endif

#if defined(__clang__)
#define ATTNSERVE_SIMD_LOOP
#else
#define ATTNSERVE_SIMD_LOOP _Pragma("omp simd simdlen(16)")
#endif

#endif  // ATTNSERVE_CORE_SIMD_H_
