#ifndef ATTNSERVE_SERVER_API_TENSOR_CODEC_H_
#define ATTNSERVE_SERVER_API_TENSOR_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "core/bf16.h"

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

// `check(values)` on a validated FP32 or BF16 tensor's values as sent, with
// no conversion: FP32 as a span of floats (a view of the message's bytes; a
// copy only when raw_data is unaligned), BF16 as a span of its bits. Returns
// what `check` returns.
template <typename Check>
absl::Status OnWireValues(const v1::Tensor& tensor, const TensorSpec& spec, Check check) {
  if (spec.dtype != v1::DATA_TYPE_BF16) return check(FloatValues(tensor, spec).values());
  const size_t n = static_cast<size_t>(spec.elements);
  const char* bytes = tensor.raw_data().data();
  if (reinterpret_cast<uintptr_t>(bytes) % alignof(core::Bf16) == 0) {
    return check(absl::MakeConstSpan(reinterpret_cast<const core::Bf16*>(bytes), n));
  }
  std::vector<core::Bf16> copy(n);
  std::memcpy(copy.data(), bytes, n * sizeof(core::Bf16));
  return check(absl::MakeConstSpan(copy));
}

// The raw_data bytes of a response tensor, kept outside the message until
// they are sent (see WireResponse): allocated without being zeroed, since the
// kernels write every byte. Move-only; empty by default.
class RawBytes {
 public:
  RawBytes() = default;
  RawBytes(RawBytes&& other) noexcept
      : bytes_(std::move(other.bytes_)), size_(std::exchange(other.size_, 0)) {}
  RawBytes& operator=(RawBytes&& other) noexcept {
    bytes_ = std::move(other.bytes_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }
  static RawBytes Uninitialized(size_t size);

  char* data() { return bytes_.get(); }
  const char* data() const { return bytes_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Gives up the buffer (to be freed with delete[]); empty afterwards.
  char* release();

 private:
  std::unique_ptr<char[]> bytes_;
  size_t size_ = 0;
};

// A response tensor being filled: values() is FP32 to compute into; Commit()
// writes the wire form. The wire form is float_data in `tensor`, or raw bytes
// (FP32 or BF16) in `raw` -- `tensor` then gets the dtype and shape, its
// raw_data stays empty -- or, with `raw` null, in `tensor`'s raw_data. FP32
// raw values are computed in place; BF16 ones in a scratch buffer that
// Commit() rounds into place. `tensor` and `raw` must outlive it.
class OutputTensor {
 public:
  // dtype FP32 or BF16; use_float_data only with FP32.
  OutputTensor(absl::Span<const int64_t> shape, v1::DataType dtype, bool use_float_data,
               v1::Tensor* tensor, RawBytes* raw);
  OutputTensor(const OutputTensor&) = delete;
  OutputTensor& operator=(const OutputTensor&) = delete;

  absl::Span<float> values() { return values_; }
  // BF16: rounds the values to nearest even into place. Otherwise nothing left to do.
  void Commit();

 private:
  // `bytes` of raw wire form, in raw_ or in the message.
  char* AllocateRaw(size_t bytes);

  v1::Tensor* tensor_;
  v1::DataType dtype_;
  RawBytes* raw_;  // null: the raw bytes go in tensor_
  std::unique_ptr<float[]> scratch_;  // BF16: the FP32 values before rounding
  size_t elements_ = 0;
  absl::Span<float> values_;
};

// "FP32", "BF16", or the number of an unknown value.
std::string DataTypeName(v1::DataType dtype);

// Bytes per element of a known dtype; 0 otherwise.
int64_t DataTypeSize(v1::DataType dtype);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_TENSOR_CODEC_H_
