// MaxPoolGrid against a direct max-pool of whole maps (in this test), fed in
// uneven chunks of query rows, with causal and key masks: every cell is the
// largest unmasked weight of its block, -1 where the mask removes all.
#include "server/explorer/max_pool_grid.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace attnserve::server {
namespace {

TEST(MaxPoolGrid, ChunksGiveTheMaxPoolOfTheWholeMapsAndMaskedBlocksAreMinusOne) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  for (const auto& [heads, s, grid] : {std::tuple<int64_t, int64_t, int64_t>{3, 10, 4},
                                       {2, 17, 5}, {1, 7, 7}, {2, 9, 16}, {4, 33, 1}}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << heads << " heads, S " << s << ", grid " << grid
                                        << (causal ? ", causal" : ""));
      std::vector<uint8_t> keys(static_cast<size_t>(s), 1);
      for (int64_t k = 0; k < s; k += 3) keys[static_cast<size_t>(k)] = 0;
      const CellMask mask(causal, keys);
      std::vector<float> maps(static_cast<size_t>(heads * s * s));
      for (float& w : maps) w = weight(rng);

      MaxPoolGrid pooled(heads, s, grid);
      const int64_t p = (s + grid - 1) / grid;
      const int64_t r = (s + p - 1) / p;
      ASSERT_EQ(pooled.pool(), p);
      ASSERT_EQ(pooled.rows(), r);
      ASSERT_EQ(pooled.cols(), r);
      // Uneven chunks: 1, 2, 3, ... rows.
      for (int64_t first = 0, n = 1; first < s; first += n, ++n) {
        const int64_t count = std::min(n, s - first);
        std::vector<int64_t> rows;
        std::vector<float> chunk;
        for (int64_t q = first; q < first + count; ++q) rows.push_back(q);
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t q : rows) {
            chunk.insert(chunk.end(), maps.begin() + (h * s + q) * s, maps.begin() + (h * s + q + 1) * s);
          }
        }
        pooled.AddRows(rows, chunk, mask);
      }
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < r; ++i) {
          for (int64_t j = 0; j < r; ++j) {
            float expected = -1;
            for (int64_t q = i * p; q < std::min(s, (i + 1) * p); ++q) {
              for (int64_t k = j * p; k < std::min(s, (j + 1) * p); ++k) {
                const bool masked = (causal && k > q) || keys[static_cast<size_t>(k)] == 0;
                if (!masked) expected = std::max(expected, maps[(h * s + q) * s + k]);
              }
            }
            EXPECT_EQ(pooled.cells()[(h * r + i) * r + j], expected) << h << " " << i << " " << j;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnserve::server
