// Each implementation of the decode row loops that runs here (AVX-512 with
// and without AVX512_BF16, AVX2+FMA intrinsics, portable) against double
// precision, over head_dims and key counts around the vector widths (tails of
// dimensions and of keys). Tolerance: |error| <= 1e-5 * the sum of the terms'
// magnitudes (sum_d |q_d k_jd| for a score, |alpha acc_d| + sum_j |p_j v_jd|
// for a value), the scale of FP32 summation error (about n 2^-24 of it for n
// <= 131 terms), which also holds the VDPBF16PS scores of BF16 rows (their
// query rows split into BF16 hi + lo: within 2^-17 of each q_d, plus the
// summation); a bound relative to the result alone fails on sums that cancel.
#include "core/decode/decode_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/reference_attention.h"

namespace attnserve::core::internal {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::SeedTrace;

constexpr double kTolerance = 1e-5;

std::vector<DecodeKernel> Kernels() {
  std::vector<DecodeKernel> kernels;
  for (DecodeKernel kernel : {DecodeKernel::kPortable, DecodeKernel::kAvx2, DecodeKernel::kAvx512,
                              DecodeKernel::kAvx512Bf16}) {
    if (DecodeKernelRuns(kernel)) kernels.push_back(kernel);
  }
  return kernels;
}

TEST(DecodeKernels, EachKernelRunsWhereTheCpuHasItsInstructions) {
  EXPECT_TRUE(DecodeKernelRuns(DecodeKernel::kPortable));
  const std::set<std::string> flags = ::attnserve::testing::CpuInfoFlags();
  const bool avx2 = flags.count("avx2") && flags.count("fma");
  EXPECT_EQ(DecodeKernelRuns(DecodeKernel::kAvx2), avx2);
  const bool avx512 = avx2 && flags.count("avx512f") && flags.count("avx512bw") &&
                     flags.count("avx512dq") && flags.count("avx512vl");
  EXPECT_EQ(DecodeKernelRuns(DecodeKernel::kAvx512), avx512);
  EXPECT_EQ(DecodeKernelRuns(DecodeKernel::kAvx512Bf16), avx512 && flags.count("avx512_bf16"));
}

// k and v rows [keys, head_dim] in FP32 and as BF16 (the BF16 ones widened
// back, for the reference).
struct Rows {
  std::vector<float> fp32, bf16_widened;
  std::vector<Bf16> bf16;
  Rows(size_t n, std::mt19937_64& rng) : fp32(RandomNormal(n, rng)) {
    for (float x : fp32) {
      bf16.push_back(FloatToBf16(x));
      bf16_widened.push_back(Bfloat16ToFloat(bf16.back()));
    }
  }
};

TEST(DecodeKernels, ScoresAndValuesMatchDoublePrecision) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (const DecodeKernel kernel : Kernels()) {
    for (int64_t hd : {1, 7, 8, 16, 17, 32, 40, 64, 72, 96, 128, 130}) {
      for (int64_t keys : {1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33}) {
        SCOPED_TRACE(::testing::Message() << "kernel " << static_cast<int>(kernel) << ", head_dim "
                                        << hd << ", keys " << keys);
        const std::vector<float> q = RandomNormal(static_cast<size_t>(hd), rng);
        const std::vector<float> p = RandomNormal(static_cast<size_t>(keys), rng);
        const std::vector<float> acc0 = RandomNormal(static_cast<size_t>(hd), rng);
        const Rows rows(static_cast<size_t>(keys * hd), rng);
        const float alpha = 0.75f;
        for (bool bf16 : {false, true}) {
          const std::vector<float>& kv = bf16 ? rows.bf16_widened : rows.fp32;
          std::vector<double> scores(static_cast<size_t>(keys)), values(acc0.begin(), acc0.end());
          std::vector<double> score_terms(scores.size()), value_terms(values.size());
          for (size_t d = 0; d < values.size(); ++d) {
            values[d] *= alpha;
            value_terms[d] = std::abs(values[d]);
          }
          for (int64_t j = 0; j < keys; ++j) {
            for (int64_t d = 0; d < hd; ++d) {
              scores[j] += double{q[d]} * kv[j * hd + d];
              score_terms[j] += std::abs(double{q[d]} * kv[j * hd + d]);
              values[d] += double{p[j]} * kv[j * hd + d];
              value_terms[d] += std::abs(double{p[j]} * kv[j * hd + d]);
            }
          }
          std::vector<float> s(static_cast<size_t>(keys)), acc = acc0;
          if (bf16) {
            DecodeScoresOn(kernel, q.data(), rows.bf16.data(), keys, hd, s.data());
            DecodeValuesOn(kernel, p.data(), rows.bf16.data(), keys, hd, alpha, acc.data());
          } else {
            DecodeScoresOn(kernel, q.data(), rows.fp32.data(), keys, hd, s.data());
            DecodeValuesOn(kernel, p.data(), rows.fp32.data(), keys, hd, alpha, acc.data());
          }
          for (int64_t j = 0; j < keys; ++j) {
            EXPECT_LE(std::abs(s[j] - scores[j]), kTolerance * score_terms[j])
                << "bf16 " << bf16 << ", key " << j;
          }
          for (int64_t d = 0; d < hd; ++d) {
            EXPECT_LE(std::abs(acc[d] - values[d]), kTolerance * value_terms[d])
                << "bf16 " << bf16 << ", dimension " << d;
          }
        }
      }
    }
  }
}

// The group kernels (G query heads over one KV head's rows spread over
// blocks) against double precision, the same tolerance as above: every
// implementation that runs here, FP32 and BF16 rows, head_dims around the
// vector widths and the BF16 even/odd ones (32 ... 128), G 1 ... 8 (passes of
// 4, 2 and 1 heads), key counts around 4/16/32 and blocks of 7 and 32 rows
// (keys ending inside a block). Each block is its own allocation, so that
// the kernel must follow the block pointers; scores past `keys` in each row
// and accumulators of other rows must stay untouched.
TEST(DecodeKernels, GroupKernelsMatchDoublePrecision) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (const DecodeKernel kernel : Kernels()) {
    for (int64_t hd : {1, 17, 32, 64, 96, 128, 130}) {
      for (int64_t group : {1, 2, 3, 4, 8}) {
        for (int64_t keys : {1, 4, 15, 16, 17, 31, 32, 33, 70}) {
          for (int64_t block_rows : {7, 32}) {
            SCOPED_TRACE(::testing::Message()
                         << "kernel " << static_cast<int>(kernel) << ", head_dim " << hd
                         << ", group " << group << ", keys " << keys << ", block_rows "
                         << block_rows);
            const int64_t nblocks = (keys + block_rows - 1) / block_rows;
            std::vector<Rows> k_blocks, v_blocks;
            for (int64_t b = 0; b < nblocks; ++b) {
              k_blocks.emplace_back(static_cast<size_t>(block_rows * hd), rng);
              v_blocks.emplace_back(static_cast<size_t>(block_rows * hd), rng);
            }
            // The next span (prefetched as this one is read; it changes no
            // result): a block and a part, each its own allocation.
            const int64_t next_keys = block_rows + 3;
            std::vector<Rows> next_k, next_v;
            for (int b = 0; b < 2; ++b) {
              next_k.emplace_back(static_cast<size_t>(block_rows * hd), rng);
              next_v.emplace_back(static_cast<size_t>(block_rows * hd), rng);
            }
            const int64_t stride = keys + 3;  // score and p rows, padded
            const std::vector<float> q = RandomNormal(static_cast<size_t>(group * hd), rng);
            const std::vector<float> p = RandomNormal(static_cast<size_t>(group * stride), rng);
            const std::vector<float> acc0 = RandomNormal(static_cast<size_t>(group * hd), rng);
            std::vector<float> alpha(static_cast<size_t>(group));
            for (int64_t h = 0; h < group; ++h) alpha[h] = h % 2 ? 1.0f : 0.5f + 0.1f * h;
            for (bool bf16 : {false, true}) {
              auto kv = [&](const std::vector<Rows>& blocks, int64_t j, int64_t d) -> double {
                const Rows& rows = blocks[static_cast<size_t>(j / block_rows)];
                const size_t at = static_cast<size_t>((j % block_rows) * hd + d);
                return bf16 ? rows.bf16_widened[at] : rows.fp32[at];
              };
              std::vector<float> s(static_cast<size_t>(group * stride), -7.0f);
              // The rows' accumulators between guards that must stay untouched.
              constexpr int64_t kGuard = 32;
              std::vector<float> guarded(static_cast<size_t>(group * hd + 2 * kGuard), -9.0f);
              std::copy(acc0.begin(), acc0.end(), guarded.begin() + kGuard);
              float* const acc = guarded.data() + kGuard;
              // Both kernels over one precision's rows (`pick` gives a block's).
              auto run = [&](auto pick) {
                using T = std::remove_const_t<std::remove_pointer_t<decltype(pick(k_blocks[0]))>>;
                std::vector<const T*> kb, vb, nk, nv;
                for (int64_t b = 0; b < nblocks; ++b) {
                  kb.push_back(pick(k_blocks[b]));
                  vb.push_back(pick(v_blocks[b]));
                }
                for (int b = 0; b < 2; ++b) {
                  nk.push_back(pick(next_k[b]));
                  nv.push_back(pick(next_v[b]));
                }
                DecodeGroupScoresOn(kernel, q.data(), group,
                                    BlockRows<T>{kb.data(), block_rows, nk.data(), next_keys}, keys,
                                    hd, s.data(), stride);
                DecodeGroupValuesOn(kernel, p.data(), stride, group,
                                    BlockRows<T>{vb.data(), block_rows, nv.data(), next_keys}, keys,
                                    hd, alpha.data(), acc);
              };
              if (bf16) {
                run([](const Rows& rows) { return rows.bf16.data(); });
              } else {
                run([](const Rows& rows) { return rows.fp32.data(); });
              }
              for (int64_t g = 0; g < kGuard; ++g) {
                ASSERT_EQ(guarded[static_cast<size_t>(g)], -9.0f) << "before the rows";
                ASSERT_EQ(guarded[guarded.size() - 1 - static_cast<size_t>(g)], -9.0f)
                    << "after the rows";
              }
              for (int64_t h = 0; h < group; ++h) {
                for (int64_t j = 0; j < keys; ++j) {
                  double score = 0.0, terms = 0.0;
                  for (int64_t d = 0; d < hd; ++d) {
                    score += double{q[h * hd + d]} * kv(k_blocks, j, d);
                    terms += std::abs(double{q[h * hd + d]} * kv(k_blocks, j, d));
                  }
                  ASSERT_LE(std::abs(s[h * stride + j] - score), kTolerance * terms)
                      << "bf16 " << bf16 << ", head " << h << ", key " << j;
                }
                for (int64_t j = keys; j < stride; ++j) {
                  ASSERT_EQ(s[h * stride + j], -7.0f) << "bf16 " << bf16 << ", past key " << j;
                }
                for (int64_t d = 0; d < hd; ++d) {
                  double value = double{acc0[h * hd + d]} * alpha[h];
                  double terms = std::abs(value);
                  for (int64_t j = 0; j < keys; ++j) {
                    value += double{p[h * stride + j]} * kv(v_blocks, j, d);
                    terms += std::abs(double{p[h * stride + j]} * kv(v_blocks, j, d));
                  }
                  ASSERT_LE(std::abs(acc[h * hd + d] - value), kTolerance * terms)
                      << "bf16 " << bf16 << ", head " << h << ", dimension " << d;
                }
              }
            }
          }
        }
      }
    }
  }
}

// Where the CPU has AVX512_BF16, kAvx512Bf16's group scores of BF16 rows are
// not kAvx512's widening kernel under another name: the two sum in different
// orders, so over 64 random scores some differ in their last bits (each
// within the tolerance above, which the test before checks), while the FP32
// rows' scores, which both take through the same kernel, agree bit for bit.
TEST(DecodeKernels, Avx512Bf16TakesItsOwnPathForBf16GroupScores) {
  if (!DecodeKernelRuns(DecodeKernel::kAvx512Bf16)) {
    GTEST_SKIP() << "this CPU has no AVX512_BF16";
  }
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  constexpr int64_t kHd = 64, kGroup = 4, kKeys = 16;
  const Rows k(static_cast<size_t>(kKeys * kHd), rng);
  const std::vector<float> q = RandomNormal(static_cast<size_t>(kGroup * kHd), rng);
  auto scores = [&](DecodeKernel kernel, auto* rows) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(rows)>>;
    const T* blocks[] = {rows};
    std::vector<float> s(static_cast<size_t>(kGroup * kKeys));
    DecodeGroupScoresOn(kernel, q.data(), kGroup, BlockRows<T>{blocks, kKeys, nullptr, 0}, kKeys,
                        kHd, s.data(), kKeys);
    return s;
  };
  EXPECT_NE(scores(DecodeKernel::kAvx512Bf16, k.bf16.data()),
            scores(DecodeKernel::kAvx512, k.bf16.data()));
  EXPECT_EQ(scores(DecodeKernel::kAvx512Bf16, k.fp32.data()),
            scores(DecodeKernel::kAvx512, k.fp32.data()));
}

}  // namespace
}  // namespace attnserve::core::internal
