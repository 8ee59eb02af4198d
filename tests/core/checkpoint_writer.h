#ifndef ATTNSERVE_TESTS_CORE_CHECKPOINT_WRITER_H_
#define ATTNSERVE_TESTS_CORE_CHECKPOINT_WRITER_H_

// Writes one attention layer's weights as a checkpoint layout stores them
// (safetensors, any prefix and dtype) and the config.json that describes it.

#include <initializer_list>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"
#include "core/head_config.h"
#include "tests/core/safetensors_writer.h"

namespace attnserve::testing {

struct LayoutCase {
  std::string layout;  // torch_mha, bert, gpt2, llama
  core::HeadConfig head;
  std::string prefix;
  std::string dtype;  // F32, BF16, F16
};

// Linear weight [out, in] from an x W weight [in, out].
inline std::vector<float> LinearOf(const std::vector<float>& w, int64_t in, int64_t out) {
  std::vector<float> t(w.size());
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t o = 0; o < out; ++o) t[o * in + i] = w[i * out + o];
  }
  return t;
}

inline std::vector<float> Concat(std::initializer_list<std::vector<float>> parts) {
  std::vector<float> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// [rows, a] ++ [rows, b] ++ [rows, c] column-wise.
inline std::vector<float> ConcatColumns(const std::vector<std::vector<float>>& parts, int64_t rows) {
  std::vector<float> out;
  for (int64_t r = 0; r < rows; ++r) {
    for (const auto& p : parts) {
      const int64_t width = static_cast<int64_t>(p.size()) / rows;
      out.insert(out.end(), p.begin() + r * width, p.begin() + (r + 1) * width);
    }
  }
  return out;
}

// Adds `w`'s tensors to `out` as `c.layout` stores them under `c.prefix`.
inline void AddLayout(const LayoutCase& c, const core::HeadConfig& h, const core::AttentionWeights& w,
                      SafetensorsWriter& out) {
  const int64_t d = h.d_model, q = h.q_width(), kv = h.kv_width();
  const std::string& p = c.prefix;
  const std::string& t = c.dtype;
  if (c.layout == "torch_mha") {
    out.Add(p + "in_proj_weight", {3 * d, d},
            Concat({LinearOf(w.w_q, d, q), LinearOf(w.w_k, d, kv), LinearOf(w.w_v, d, kv)}), t);
    out.Add(p + "in_proj_bias", {3 * d}, Concat({w.b_q, w.b_k, w.b_v}), t);
    out.Add(p + "out_proj.weight", {d, d}, LinearOf(w.w_o, q, d), t);
    out.Add(p + "out_proj.bias", {d}, w.b_o, t);
  } else if (c.layout == "bert" || c.layout == "llama") {
    const bool bert = c.layout == "bert";
    const std::string names[4] = {bert ? "self.query." : "q_proj.", bert ? "self.key." : "k_proj.",
                                  bert ? "self.value." : "v_proj.",
                                  bert ? "output.dense." : "o_proj."};
    out.Add(p + names[0] + "weight", {q, d}, LinearOf(w.w_q, d, q), t);
    out.Add(p + names[1] + "weight", {kv, d}, LinearOf(w.w_k, d, kv), t);
    out.Add(p + names[2] + "weight", {kv, d}, LinearOf(w.w_v, d, kv), t);
    out.Add(p + names[3] + "weight", {d, q}, LinearOf(w.w_o, q, d), t);
    if (bert) {
      out.Add(p + names[0] + "bias", {q}, w.b_q, t);
      out.Add(p + names[1] + "bias", {kv}, w.b_k, t);
      out.Add(p + names[2] + "bias", {kv}, w.b_v, t);
      out.Add(p + names[3] + "bias", {d}, w.b_o, t);
    }
  } else {  // gpt2: Conv1D stores [in, out]
    out.Add(p + "c_attn.weight", {d, 3 * d}, ConcatColumns({w.w_q, w.w_k, w.w_v}, d), t);
    out.Add(p + "c_attn.bias", {3 * d}, Concat({w.b_q, w.b_k, w.b_v}), t);
    out.Add(p + "c_proj.weight", {d, d}, w.w_o, t);
    out.Add(p + "c_proj.bias", {d}, w.b_o, t);
  }
}

// Writes `w` as `layout` stores it under `prefix`, with an unrelated tensor
// beside it (other layers of the checkpoint).
inline SafetensorsWriter WriteLayout(const LayoutCase& c, const core::HeadConfig& h, const core::AttentionWeights& w) {
  SafetensorsWriter out;
  out.Add("other.layer.weight", {2, 2}, {1, 2, 3, 4}, c.dtype);
  AddLayout(c, h, w, out);
  return out;
}

// Writes several layers of one network into one checkpoint: layer i's
// weights `w[i]` under `prefixes[i]` (c.prefix is ignored), with an unrelated
// tensor beside them.
inline SafetensorsWriter WriteLayers(const LayoutCase& c, const core::HeadConfig& h,
                                     const std::vector<core::AttentionWeights>& w,
                                     const std::vector<std::string>& prefixes) {
  SafetensorsWriter out;
  out.Add("wte.weight", {2, 2}, {1, 2, 3, 4}, c.dtype);
  for (size_t i = 0; i < w.size(); ++i) {
    LayoutCase layer = c;
    layer.prefix = prefixes[i];
    AddLayout(layer, h, w[i], out);
  }
  return out;
}

inline std::string ConfigJson(const LayoutCase& c) {
  return absl::StrCat("{\"layout\":\"", c.layout, "\",\"prefix\":\"", c.prefix,
                      "\",\"d_model\":", c.head.d_model, ",\"num_heads\":", c.head.num_heads,
                      ",\"num_kv_heads\":", c.head.num_kv_heads,
                      c.head.rotary.rotary_dim > 0
                          ? absl::StrCat(",\"rotary\":{\"dim\":", c.head.rotary.rotary_dim,
                                         ",\"theta\":500000}")
                          : "",
                      "}");
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_CHECKPOINT_WRITER_H_
