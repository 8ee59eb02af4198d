#include "core/head_contributions.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attnserve::core::internal {

std::vector<double> OutputGram(const HeadConfig& config, const std::vector<float>& w_o) {
  const int64_t heads = config.num_heads;
  const int64_t hd = config.head_dim;
  const int64_t d = config.d_model;
  // Gram_h[a][b] = sum_k W_o[h*hd + a][k] W_o[h*hd + b][k].
  std::vector<double> gram(static_cast<size_t>(heads * hd * hd));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < heads * hd; ++row) {
    const int64_t h = row / hd;
    const float* const wa = w_o.data() + row * d;
    for (int64_t bcol = 0; bcol < hd; ++bcol) {
      const float* const wb = w_o.data() + (h * hd + bcol) * d;
      double sum = 0.0;
      for (int64_t k = 0; k < d; ++k) sum += static_cast<double>(wa[k]) * wb[k];
      gram[row * hd + bcol] = sum;
    }
  }
  return gram;
}

void HeadContributions(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
                       const float* context_heads, const std::vector<double>* gram,
                       const std::vector<float>& w_o, absl::Span<float> out) {
  const int64_t heads = config.num_heads;
  const int64_t hd = config.head_dim;
  const int64_t d = config.d_model;
  const int64_t s = call.q_len;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < n * heads; ++item) {
    const int64_t c = item / heads;
    const int64_t h = item % heads;
    const int64_t b = first + c;
    double sum = 0.0;
    for (int64_t pos = 0; pos < call.q_lengths[b]; ++pos) {
      const float* const x = context_heads + (item * s + pos) * hd;
      if (gram != nullptr) {
        // ||x W^O_h||^2 = x Gram_h x^T.
        const double* const g = gram->data() + h * hd * hd;
        for (int64_t a = 0; a < hd; ++a) {
          double row = 0.0;
          for (int64_t k = 0; k < hd; ++k) row += g[a * hd + k] * x[k];
          sum += row * x[a];
        }
      } else {
        // ||x W^O_h||^2 column by column.
        const float* const w = w_o.data() + h * hd * d;
        for (int64_t k = 0; k < d; ++k) {
          double y = 0.0;
          for (int64_t a = 0; a < hd; ++a) y += static_cast<double>(x[a]) * w[a * d + k];
          sum += y * y;
        }
      }
    }
    out[b * heads + h] = static_cast<float>(std::sqrt(std::max(sum, 0.0)));
  }
}

}  // namespace attnserve::core::internal
