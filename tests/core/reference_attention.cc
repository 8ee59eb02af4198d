#include "tests/core/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/head_config.h"

namespace attnserve::testing {
namespace {

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

// y [rows, out] = x [rows, in] w [in, out] + b [out], row-major, in double.
std::vector<double> Linear(absl::Span<const float> x, int64_t rows, int64_t in,
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

// Rows of a layout's projections, padded and head-major: [batch, heads, len, hd],
// optionally rotated (Llama "rotate half") at first_positions[b] + i.
std::vector<double> HeadMajor(const std::vector<double>& projected,
                              const core::SequenceLayout& layout, int64_t heads, int64_t hd,
                              const core::RotaryConfig& rotary,
                              absl::Span<const int64_t> first_positions) {
  const int64_t batch = layout.batch();
  const int64_t len = layout.max_length();
  const int64_t width = heads * hd;
  const int64_t half = rotary.rotary_dim / 2;
  std::vector<double> out(static_cast<size_t>(batch * heads * len * hd), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < layout.length(b); ++i) {
      const double* row = &projected[(layout.row_offset(b) + i) * width];
      const double position =
          static_cast<double>((first_positions.empty() ? 0 : first_positions[b]) + i);
      for (int64_t h = 0; h < heads; ++h) {
        const double* x = row + h * hd;
        double* y = &out[((b * heads + h) * len + i) * hd];
        for (int64_t e = 0; e < hd; ++e) y[e] = x[e];
        for (int64_t e = 0; e < half; ++e) {
          // theta^(-2e / rotary_dim), written as an exponential.
          const double frequency =
              std::exp(-2.0 * static_cast<double>(e) / static_cast<double>(rotary.rotary_dim) *
                       std::log(static_cast<double>(rotary.theta)));
          const double angle = position * frequency;
          y[e] = x[e] * std::cos(angle) - x[e + half] * std::sin(angle);
          y[e + half] = x[e + half] * std::cos(angle) + x[e] * std::sin(angle);
        }
      }
    }
  }
  return out;
}

// Everything the attention needs, in per-sequence coordinates.
struct Attention {
  int64_t batch = 0;
  int64_t s = 0;
  int64_t t = 0;
  std::vector<int64_t> q_lengths;
  std::vector<int64_t> kv_lengths;
  bool causal = false;
  core::ExplicitMask mask;
  absl::Span<const float> head_mask;
};

// Fills maps, statistics (not contribution) and context_heads from r.q, r.k,
// r.v; with `bf16`, the P V product takes BF16 probabilities and the context
// heads are rounded (see Bf16Operands).
void Attend(const core::HeadConfig& config, const Attention& a, const Bf16Operands* bf16,
            ReferenceResult& r) {
  const int64_t heads = config.num_heads;
  const int64_t kv_heads = config.num_kv_heads;
  const int64_t group = heads / kv_heads;
  const int64_t hd = config.head_dim;
  const int64_t s = a.s;
  const int64_t t = a.t;
  r.per_head_maps.assign(static_cast<size_t>(a.batch * heads * s * t), 0.0);
  r.mean_maps.assign(static_cast<size_t>(a.batch * s * t), 0.0);
  r.entropy.assign(static_cast<size_t>(a.batch * heads), 0.0);
  r.max_weight.assign(static_cast<size_t>(a.batch * heads), 0.0);
  r.context_heads.assign(static_cast<size_t>(a.batch * heads * s * hd), 0.0);
  std::vector<double> scores(static_cast<size_t>(t));
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / group;
      const double weight = a.head_mask.empty() ? 1.0 : a.head_mask[h];
      for (int64_t i = 0; i < a.q_lengths[b]; ++i) {
        const double* q_i = &r.q[((b * heads + h) * s + i) * hd];
        double max_score = kMinusInfinity;
        for (int64_t j = 0; j < t; ++j) {
          scores[j] = kMinusInfinity;
          if (j >= a.kv_lengths[b] || (a.causal && j > i)) continue;
          double extra = 0.0;
          if (a.mask.kind != core::ExplicitMask::Kind::kNone) {
            const int64_t mb = a.mask.batch_dim == 1 ? 0 : b;
            const int64_t mi = a.mask.q_dim == 1 ? 0 : i;
            const int64_t mj = a.mask.kv_dim == 1 ? 0 : j;
            const double m = a.mask.values[(mb * a.mask.q_dim + mi) * a.mask.kv_dim + mj];
            if (a.mask.kind == core::ExplicitMask::Kind::kAllowed) {
              if (m == 0.0) continue;
            } else {
              extra = m;
            }
          }
          const double* k_j = &r.k[((b * kv_heads + g) * t + j) * hd];
          double dot = 0.0;
          for (int64_t e = 0; e < hd; ++e) dot += q_i[e] * k_j[e];
          scores[j] = dot * config.scale + extra;
          max_score = std::max(max_score, scores[j]);
        }
        if (max_score == kMinusInfinity) continue;  // every key masked: weights 0
        double sum = 0.0;
        for (int64_t j = 0; j < t; ++j) {
          scores[j] = scores[j] == kMinusInfinity ? 0.0 : std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        double* p_row = &r.per_head_maps[((b * heads + h) * s + i) * t];
        double* mean_row = &r.mean_maps[(b * s + i) * t];
        double* context_i = &r.context_heads[((b * heads + h) * s + i) * hd];
        double entropy = 0.0;
        double max_p = 0.0;
        const bool relative_to_row_max =
            bf16 != nullptr &&
            bf16->probabilities == Bf16Operands::Probabilities::kRelativeToRowMax;
        for (int64_t j = 0; j < t; ++j) {
          const double p = scores[j] / sum * weight;
          p_row[j] = p;
          mean_row[j] += p / static_cast<double>(heads);
          if (p > 0.0) entropy -= p * std::log(p);
          max_p = std::max(max_p, p);
          // What the P V product takes.
          double p_v = p;
          if (bf16 != nullptr) {
            p_v = RoundToBf16(relative_to_row_max ? scores[j] : p, bf16->rounding);
          }
          const double* v_j = &r.v[((b * kv_heads + g) * t + j) * hd];
          for (int64_t e = 0; e < hd; ++e) context_i[e] += p_v * v_j[e];
        }
        if (relative_to_row_max) {
          for (int64_t e = 0; e < hd; ++e) context_i[e] *= weight / sum;
        }
        if (bf16 != nullptr) {
          for (int64_t e = 0; e < hd; ++e) context_i[e] = RoundToBf16(context_i[e], bf16->rounding);
        }
        r.entropy[b * heads + h] += entropy / static_cast<double>(a.q_lengths[b]);
        r.max_weight[b * heads + h] += max_p / static_cast<double>(a.q_lengths[b]);
      }
    }
  }
}

std::vector<int64_t> Lengths(const core::SequenceLayout& layout) {
  std::vector<int64_t> lengths;
  for (int64_t b = 0; b < layout.batch(); ++b) lengths.push_back(layout.length(b));
  return lengths;
}

// `values`, each rounded to BF16 (a BF16 value is an FP32 value too).
std::vector<float> Rounded(absl::Span<const float> values, Bf16Rounding rounding) {
  std::vector<float> rounded(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    rounded[i] = static_cast<float>(RoundToBf16(values[i], rounding));
  }
  return rounded;
}

// ReferenceLayer, with BF16 operands where `bf16` is set.
ReferenceResult Layer(const core::HeadConfig& config, const core::AttentionWeights& given_weights,
                      const core::LayerInputs& inputs, const Bf16Operands* bf16) {
  const core::SequenceLayout& layout = inputs.layout;
  const bool cross = inputs.context_layout.has_value();
  const core::SequenceLayout& keys = cross ? *inputs.context_layout : layout;
  const int64_t d = config.d_model;
  const int64_t heads = config.num_heads;
  const int64_t hd = config.head_dim;
  const int64_t kv_width = config.kv_width();

  absl::Span<const float> hidden = inputs.hidden_states;
  absl::Span<const float> context = cross ? inputs.context : inputs.hidden_states;
  std::vector<float> hidden_bf16, context_bf16;
  core::AttentionWeights rounded_weights;
  if (bf16 != nullptr) {
    hidden_bf16 = Rounded(hidden, bf16->rounding);
    hidden = hidden_bf16;
    if (cross) {
      context_bf16 = Rounded(context, bf16->rounding);
      context = context_bf16;
    } else {
      context = hidden;
    }
    rounded_weights = given_weights;
    for (std::vector<float>* w : {&rounded_weights.w_q, &rounded_weights.w_k,
                                  &rounded_weights.w_v, &rounded_weights.w_o}) {
      *w = Rounded(*w, bf16->rounding);
    }
  }
  const core::AttentionWeights& weights = bf16 != nullptr ? rounded_weights : given_weights;

  // Every row is projected, padding too (NaN there stays there, unused).
  const std::vector<double> q =
      Linear(hidden, layout.rows(), d, weights.w_q, weights.b_q, config.q_width());
  // The context is context_dim wide (== d_model in self-attention).
  const int64_t c_width = config.context_dim;
  const std::vector<double> k =
      Linear(context, keys.rows(), c_width, weights.w_k, weights.b_k, kv_width);
  const std::vector<double> v =
      Linear(context, keys.rows(), c_width, weights.w_v, weights.b_v, kv_width);

  ReferenceResult r;
  core::RotaryConfig no_rotary;
  no_rotary.rotary_dim = 0;
  r.q = HeadMajor(q, layout, heads, hd, config.rotary, inputs.position_offsets);
  r.k = HeadMajor(k, keys, config.num_kv_heads, hd, config.rotary,
                  cross ? absl::Span<const int64_t>() : inputs.position_offsets);
  r.v = HeadMajor(v, keys, config.num_kv_heads, hd, no_rotary, {});
  if (bf16 != nullptr) {
    // (Padding positions are 0 and stay 0.)
    for (std::vector<double>* heads_of : {&r.q, &r.k, &r.v}) {
      for (double& value : *heads_of) value = RoundToBf16(value, bf16->rounding);
    }
  }

  Attention a;
  a.batch = layout.batch();
  a.s = layout.max_length();
  a.t = keys.max_length();
  a.q_lengths = Lengths(layout);
  a.kv_lengths = Lengths(keys);
  a.causal = inputs.causal;
  a.mask = inputs.mask;
  a.head_mask = inputs.head_mask;
  Attend(config, a, bf16, r);

  // Concatenate the heads into token-major rows, project, and the
  // contribution of each head: ||head_h W^O_h||_F over a sequence's rows.
  r.output.assign(static_cast<size_t>(layout.rows() * d), 0.0);
  r.contribution.assign(static_cast<size_t>(a.batch * heads), 0.0);
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t i = 0; i < layout.length(b); ++i) {
      double* out = &r.output[(layout.row_offset(b) + i) * d];
      for (int64_t e = 0; e < d; ++e) out[e] = weights.b_o[e];
      for (int64_t h = 0; h < heads; ++h) {
        const double* x = &r.context_heads[((b * heads + h) * a.s + i) * hd];
        std::vector<double> y(static_cast<size_t>(d), 0.0);
        for (int64_t f = 0; f < hd; ++f) {
          const float* w = &weights.w_o[(h * hd + f) * d];
          for (int64_t e = 0; e < d; ++e) y[e] += x[f] * static_cast<double>(w[e]);
        }
        for (int64_t e = 0; e < d; ++e) {
          out[e] += y[e];
          r.contribution[b * heads + h] += y[e] * y[e];
        }
      }
    }
  }
  for (double& value : r.contribution) value = std::sqrt(value);
  return r;
}

}  // namespace

double RoundToBf16(double x, Bf16Rounding rounding) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int exponent = 0;
  // x = fraction * 2^exponent, |fraction| in [1/2, 1): keep 8 bits of it.
  const double significand = std::ldexp(std::frexp(x, &exponent), 8);
  // nearbyint rounds to nearest, ties to even (the default rounding mode).
  const double kept = rounding == Bf16Rounding::kNearestEven ? std::nearbyint(significand)
                                                             : std::trunc(significand);
  return std::ldexp(kept, exponent - 8);
}

ReferenceResult ReferenceLayer(const core::HeadConfig& config,
                               const core::AttentionWeights& weights,
                               const core::LayerInputs& inputs) {
  return Layer(config, weights, inputs, nullptr);
}

ReferenceResult ReferenceLayerWithBf16Operands(const core::HeadConfig& config,
                                               const core::AttentionWeights& weights,
                                               const core::LayerInputs& inputs,
                                               const Bf16Operands& bf16) {
  return Layer(config, weights, inputs, &bf16);
}

ReferenceResult ReferenceCore(const core::HeadConfig& config, const core::CoreInputs& inputs) {
  ReferenceResult r;
  r.q.assign(inputs.q.begin(), inputs.q.end());
  r.k.assign(inputs.k.begin(), inputs.k.end());
  r.v.assign(inputs.v.begin(), inputs.v.end());
  Attention a;
  a.batch = inputs.batch;
  a.s = inputs.q_len;
  a.t = inputs.kv_len;
  a.q_lengths.assign(static_cast<size_t>(a.batch), a.s);
  a.kv_lengths.assign(static_cast<size_t>(a.batch), a.t);
  if (!inputs.q_lengths.empty())
    a.q_lengths.assign(inputs.q_lengths.begin(), inputs.q_lengths.end());
  if (!inputs.kv_lengths.empty()) {
    a.kv_lengths.assign(inputs.kv_lengths.begin(), inputs.kv_lengths.end());
  }
  // Padding never enters a result: clear it (it may hold NaN).
  const int64_t hd = config.head_dim;
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t h = 0; h < config.num_heads; ++h) {
      for (int64_t i = a.q_lengths[b]; i < a.s; ++i) {
        std::fill_n(&r.q[((b * config.num_heads + h) * a.s + i) * hd], hd, 0.0);
      }
    }
    for (int64_t g = 0; g < config.num_kv_heads; ++g) {
      for (int64_t j = a.kv_lengths[b]; j < a.t; ++j) {
        std::fill_n(&r.k[((b * config.num_kv_heads + g) * a.t + j) * hd], hd, 0.0);
        std::fill_n(&r.v[((b * config.num_kv_heads + g) * a.t + j) * hd], hd, 0.0);
      }
    }
  }
  a.causal = inputs.causal;
  a.mask = inputs.mask;
  a.head_mask = inputs.head_mask;
  Attend(config, a, nullptr, r);
  r.output = r.context_heads;
  return r;
}

std::vector<double> SelectMaps(const ReferenceResult& result, const core::HeadConfig& config,
                               int64_t batch, int64_t s, int64_t t,
                               const core::MapSelection& maps) {
  std::vector<int64_t> rows = maps.query_rows;
  if (rows.empty()) {
    for (int64_t i = 0; i < s; ++i) rows.push_back(i);
  }
  std::vector<int64_t> heads = maps.heads;
  if (heads.empty()) {
    for (int64_t h = 0; h < config.num_heads; ++h) heads.push_back(h);
  }
  std::vector<double> out;
  for (int64_t b = 0; b < batch; ++b) {
    if (maps.mode == core::AttentionMapMode::kPerHead) {
      for (int64_t h : heads) {
        for (int64_t i : rows) {
          const double* row = &result.per_head_maps[((b * config.num_heads + h) * s + i) * t];
          out.insert(out.end(), row, row + t);
        }
      }
    } else if (maps.mode == core::AttentionMapMode::kMeanOverHeads) {
      for (int64_t i : rows) {
        const double* row = &result.mean_maps[(b * s + i) * t];
        out.insert(out.end(), row, row + t);
      }
    }
  }
  return out;
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

RowStatistics ReferenceRowStatistics(absl::Span<const double> maps, int64_t num_heads,
                                     int64_t length, int64_t from, int64_t n) {
  RowStatistics stats;
  for (int64_t h = 0; h < num_heads; ++h) {
    for (int64_t i = from; i < from + n; ++i) {
      double e = 0.0, m = 0.0;
      for (int64_t j = 0; j < length; ++j) {
        const double p = maps[static_cast<size_t>((h * length + i) * length + j)];
        if (p > 0.0) e -= p * std::log(p);
        m = std::max(m, p);
      }
      stats.entropy.push_back(e);
      stats.max_weight.push_back(m);
    }
  }
  return stats;
}

}  // namespace attnserve::testing
