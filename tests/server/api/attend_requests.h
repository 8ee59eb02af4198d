#ifndef ATTNSERVE_TESTS_SERVER_API_ATTEND_REQUESTS_H_
#define ATTNSERVE_TESTS_SERVER_API_ATTEND_REQUESTS_H_

// Attend requests on the built-in model (d_model 768) and their answers'
// values, for the service tests.

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "attnserve/v1/attention.pb.h"

namespace attnserve::testing {

// n standard-normal values from `seed`.
inline std::vector<float> RandomValues(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = normal(rng);
  return values;
}

// An Attend request on model "default": hidden states [batch, seq, 768] as
// FP32 raw_data, with the maps asked for.
inline v1::AttendRequest RawRequest(int64_t batch, int64_t seq, const std::vector<float>& values,
                                    v1::AttentionMapMode maps = v1::ATTENTION_MAP_MODE_NONE) {
  v1::AttendRequest request;
  request.set_model("default");
  v1::Tensor* t = request.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {batch, seq, int64_t{768}}) t->add_shape(d);
  t->set_raw_data(values.data(), values.size() * sizeof(float));
  request.mutable_attention_maps()->set_mode(maps);
  return request;
}

// An FP32 tensor's values, from float_data or raw_data.
inline std::vector<float> Floats(const v1::Tensor& t) {
  if (t.float_data_size() > 0) return {t.float_data().begin(), t.float_data().end()};
  std::vector<float> values(t.raw_data().size() / sizeof(float));
  std::memcpy(values.data(), t.raw_data().data(), t.raw_data().size());
  return values;
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_API_ATTEND_REQUESTS_H_
