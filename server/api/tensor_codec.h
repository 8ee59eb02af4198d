#ifndef ATTNSERVE_SERVER_API_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_API_TENSOR_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::server {

// What ValidateTensor learned about a wire tensor.
struct TensorSpec {
  v1::DataType dtype = v1::DATA_TYPE_FP32;
  std::vector<int64_t> shape;
  int64_t elements = 0;
  bool uses_float_data = false;  // values in float_data rather than raw_data
};

// Checks a wire tensor before anything is allocated from its sizes: rank ==
// dim_names.size(), every dimension positive, the element and byte counts
// within int64, a known dtype, exactly one of raw_data / float_data, and a
// data size equal to shape x dtype. INVALID_ARGUMENT with a message that names
// `field` (and the dimension, by its name in dim_names) otherwise.
absl::StatusOr<TensorSpec> ValidateTensor(const v1::Tensor& tensor, absl::string_view field,
                                          absl::Span<const absl::string_view> dim_names);

// A validated tensor's values as FP32: a view of the message's own bytes when
// they are FP32 and aligned, else a converted copy. Must not outlive `tensor`.
class FloatValues {
 public:
  FloatValues(const v1::Tensor& tensor, const TensorSpec& spec);
  FloatValues(const FloatValues&) = delete;
  FloatValues& operator=(const FloatValues&) = delete;
  absl::Span<const float> values() const { return values_; }

 private:
  std::vector<float> storage_;
  absl::Span<const float> values_;
};

// A response tensor being filled: values() is FP32 to compute into (the
// message's own bytes when the wire form is FP32, a scratch buffer for BF16);
// Commit() writes the wire form. `tensor` must outlive it.
class OutputTensor {
 public:
  // dtype FP32 or BF16; use_float_data only with FP32.
  OutputTensor(absl::Span<const int64_t> shape, v1::DataType dtype, bool use_float_data,
               v1::Tensor* tensor);
  OutputTensor(const OutputTensor&) = delete;
  OutputTensor& operator=(const OutputTensor&) = delete;

  absl::Span<float> values() { return values_; }
  // BF16: rounds the values to nearest even into raw_data. FP32: nothing left to do.
  void Commit();

 private:
  v1::Tensor* tensor_;
  v1::DataType dtype_;
  std::vector<float> scratch_;
  absl::Span<float> values_;
};

// "FP32", "BF16", or the number of an unknown value.
std::string DataTypeName(v1::DataType dtype);

// Bytes per element of a known dtype; 0 otherwise.
int64_t DataTypeSize(v1::DataType dtype);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_TENSOR_CODEC_H_
