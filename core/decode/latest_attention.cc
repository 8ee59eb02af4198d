#include "core/decode/latest_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/decode/decode_kernels.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "core/kernels/online_softmax.h"
#include "core/kernels/row_statistics.h"

namespace attnserve::core {

absl::Status LatestAttention(const LayerKvCache& cache, int num_heads, float scale,
                             absl::Span<float> maps, absl::Span<float> entropy,
                             absl::Span<float> max_weight) {
  const absl::Span<const float> query = cache.latest_query();
  if (query.empty()) {
    return absl::FailedPreconditionError(
        "the cache holds no query of its last token (none was kept, or it was truncated "
        "since); extend it by a token first");
  }
  const KvLayout& layout = cache.layout();
  const int64_t hd = layout.head_dim;
  if (num_heads < 1 || num_heads % layout.num_kv_heads != 0 ||
      static_cast<int64_t>(query.size()) != num_heads * hd) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads: ", num_heads, " is not a multiple of the cache's num_kv_heads ",
        layout.num_kv_heads, " whose heads of ", hd, " make the kept query's ", query.size(),
        " floats"));
  }
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale: must be finite and positive, got ", scale));
  }
  const int64_t length = cache.length();
  if (static_cast<int64_t>(maps.size()) != num_heads * length) {
    return absl::InvalidArgumentError(absl::StrCat("maps: has ", maps.size(),
                                                   " floats, expected num_heads * length = ",
                                                   num_heads * length));
  }
  for (const auto& [span, name] : {std::pair{entropy, "entropy"}, {max_weight, "max_weight"}}) {
    if (!span.empty() && static_cast<int64_t>(span.size()) != num_heads) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": has ", span.size(),
                                                     " floats, expected num_heads = ",
                                                     num_heads, " (or none)"));
    }
  }
  const int64_t group = num_heads / layout.num_kv_heads;
  const int64_t block_tokens = cache.block_tokens();
  const bool bf16 = layout.precision == KvPrecision::kBf16;
  for (int64_t h = 0; h < num_heads; ++h) {
    const int g = static_cast<int>(h / group);
    const float* q = query.data() + h * hd;
    float* row = maps.data() + h * length;
    // Raw scores q . k, block by block (a block's first rows hold tokens).
    for (int64_t block = 0; block * block_tokens < length; ++block) {
      const int64_t keys = std::min(block_tokens, length - block * block_tokens);
      const std::byte* k = cache.key_rows(block, g);
      float* s = row + block * block_tokens;
      if (bf16) {
        internal::DecodeScores(q, reinterpret_cast<const Bf16*>(k), keys, hd, s);
      } else {
        internal::DecodeScores(q, reinterpret_cast<const float*>(k), keys, hd, s);
      }
    }
    // softmax(s * scale) with the max subtracted.
    const float m = *std::max_element(row, row + length);
    double sum = 0.0;
    for (int64_t j = 0; j < length; ++j) {
      row[j] = internal::FastExp((row[j] - m) * scale);
      sum += row[j];
    }
    const double inv = 1.0 / sum;
    for (int64_t j = 0; j < length; ++j) row[j] = static_cast<float>(row[j] * inv);
    const internal::RowStatistics stats = internal::StatisticsOfRow(absl::MakeConstSpan(row, length));
    if (!entropy.empty()) entropy[h] = static_cast<float>(stats.entropy);
    if (!max_weight.empty()) max_weight[h] = stats.max_weight;
  }
  return absl::OkStatus();
}

}  // namespace attnserve::core
