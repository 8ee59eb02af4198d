#ifndef ATTNSERVE_CORE_HEAD_CONTRIBUTIONS_H_
#define ATTNSERVE_CORE_HEAD_CONTRIBUTIONS_H_

// Private to core/: the layer's per-head contribution statistic,
//   contribution[b, h] = ||head_h W^O_h||_F over sequence b's valid rows,
// how much the sequence's output changes when head h is removed.

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/head_config.h"
#include "core/kernels/sdpa_call.h"

namespace attnserve::core::internal {

// Gram_h = W^O_h (W^O_h)^T, [Hq, hd, hd] in double, from w_o [Hq hd, d_model]:
// ||x W^O_h||^2 = x Gram_h x^T is the cheaper way when head_dim <= d_model.
std::vector<double> OutputGram(const HeadConfig& config, const std::vector<float>& w_o);

// out[b * Hq + h] for the chunk's sequences [first, first + n) of `call`,
// from their context heads [n, Hq, S, hd] FP32; through `gram` (OutputGram)
// when it is not null, else by multiplying with w_o column by column.
void HeadContributions(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
                       const float* context_heads, const std::vector<double>* gram,
                       const std::vector<float>& w_o, absl::Span<float> out);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_HEAD_CONTRIBUTIONS_H_
