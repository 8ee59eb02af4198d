#include "tests/core/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::testing {
namespace {

// y [rows, out] = x [rows, in] w [in, out] + b [out], all row-major.
std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<float>& w, const std::vector<float>& b, int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r) {
    double* y_row = &y[r * out];
    for (int64_t j = 0; j < out; ++j) y_row[j] = b[j];
    for (int64_t i = 0; i < in; ++i) {
      const double x_ri = x[r * in + i];
      const float* w_row = &w[i * out];
      for (int64_t j = 0; j < out; ++j) y_row[j] += x_ri * static_cast<double>(w_row[j]);
    }
  }
  return y;
}

}  // namespace

ReferenceResult ReferenceAttention(const core::HeadConfig& config,
                                   const core::AttentionWeights& weights,
                                   absl::Span<const float> hidden_states,
                                   core::AttentionShape shape) {
  const int64_t batch = shape.batch;
  const int64_t seq = shape.seq_len;
  const int64_t d_model = config.d_model;
  const int64_t heads = config.num_heads;
  const int64_t head_dim = config.head_dim;
  const int64_t group = config.num_heads / config.num_kv_heads;
  const int64_t q_width = heads * head_dim;
  const int64_t kv_width = config.num_kv_heads * head_dim;
  const int64_t tokens = batch * seq;
  const double scale = config.scale;

  const std::vector<double> x(hidden_states.begin(), hidden_states.end());
  const std::vector<double> q = Linear(x, tokens, d_model, weights.w_q, weights.b_q, q_width);
  const std::vector<double> k = Linear(x, tokens, d_model, weights.w_k, weights.b_k, kv_width);
  const std::vector<double> v = Linear(x, tokens, d_model, weights.w_v, weights.b_v, kv_width);

  ReferenceResult result;
  result.per_head_maps.assign(static_cast<size_t>(batch * heads * seq * seq), 0.0);
  result.mean_maps.assign(static_cast<size_t>(batch * seq * seq), 0.0);
  std::vector<double> context(static_cast<size_t>(tokens * q_width), 0.0);
  std::vector<double> scores(static_cast<size_t>(seq));

  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < seq; ++i) {
        const double* q_i = &q[(b * seq + i) * q_width + h * head_dim];
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < seq; ++j) {
          const double* k_j = &k[(b * seq + j) * kv_width + g * head_dim];
          double dot = 0.0;
          for (int64_t d = 0; d < head_dim; ++d) dot += q_i[d] * k_j[d];
          scores[j] = dot * scale;
          max_score = std::max(max_score, scores[j]);
        }
        double sum = 0.0;
        for (int64_t j = 0; j < seq; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        double* p_row = &result.per_head_maps[((b * heads + h) * seq + i) * seq];
        double* mean_row = &result.mean_maps[(b * seq + i) * seq];
        double* context_i = &context[(b * seq + i) * q_width + h * head_dim];
        for (int64_t j = 0; j < seq; ++j) {
          const double p = scores[j] / sum;
          p_row[j] = p;
          mean_row[j] += p / static_cast<double>(heads);
          const double* v_j = &v[(b * seq + j) * kv_width + g * head_dim];
          for (int64_t d = 0; d < head_dim; ++d) context_i[d] += p * v_j[d];
        }
      }
    }
  }
  result.output = Linear(context, tokens, q_width, weights.w_o, weights.b_o, d_model);
  return result;
}

double RelativeFrobeniusError(absl::Span<const float> actual, absl::Span<const double> expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return std::numeric_limits<double>::infinity();
    const double e = static_cast<double>(actual[i]) - expected[i];
    diff += e * e;
    norm += expected[i] * expected[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

double MaxRowSumError(absl::Span<const float> maps, int64_t row_length) {
  double worst = 0.0;
  for (size_t start = 0; start + static_cast<size_t>(row_length) <= maps.size();
       start += static_cast<size_t>(row_length)) {
    double sum = 0.0;
    for (int64_t j = 0; j < row_length; ++j) sum += maps[start + j];
    worst = std::max(
        worst, std::isfinite(sum) ? std::abs(sum - 1.0) : std::numeric_limits<double>::infinity());
  }
  return worst;
}

}  // namespace attnserve::testing
