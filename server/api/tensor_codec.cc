#include "server/api/tensor_codec.h"

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/bf16.h"
#include "core/checked_math.h"
#include "server/common/message_text.h"

namespace attnserve::server {
namespace {

std::string DimLabel(absl::string_view field, size_t index,
                     absl::Span<const absl::string_view> dim_names) {
  return absl::StrCat(field, ".shape[", index, "] (", dim_names[index], ")");
}

bool IsAligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace

std::string DataTypeName(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_FP32:
      return "FP32";
    case v1::DATA_TYPE_BF16:
      return "BF16";
    case v1::DATA_TYPE_BOOL:
      return "BOOL";
    case v1::DATA_TYPE_UNSPECIFIED:
      return "UNSPECIFIED";
    default:
      return absl::StrCat("unknown value ", static_cast<int>(dtype));
  }
}

int64_t DataTypeSize(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_FP32:
      return 4;
    case v1::DATA_TYPE_BF16:
      return 2;
    case v1::DATA_TYPE_BOOL:
      return 1;
    default:
      return 0;
  }
}

absl::StatusOr<TensorSpec> ValidateTensor(const v1::Tensor& tensor, absl::string_view field,
                                          absl::Span<const absl::string_view> dim_names) {
  TensorSpec spec;
  const size_t rank = dim_names.size();
  if (static_cast<size_t>(tensor.shape_size()) != rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape: expected rank ", rank, " [", absl::StrJoin(dim_names, ", "), "], got rank ",
        tensor.shape_size(), " ", ShapeText(tensor.shape())));
  }
  for (size_t i = 0; i < rank; ++i) {
    if (tensor.shape(i) <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(DimLabel(field, i, dim_names),
                                                     ": must be positive, got ", tensor.shape(i)));
    }
  }
  spec.shape.assign(tensor.shape().begin(), tensor.shape().end());

  const bool has_raw = !tensor.raw_data().empty();
  const bool has_floats = tensor.float_data_size() > 0;
  if (has_raw && has_floats) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": set raw_data or float_data, not both"));
  }
  if (!has_raw && !has_floats) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no values (raw_data and float_data are empty)"));
  }
  spec.uses_float_data = has_floats;
  spec.dtype = tensor.dtype();
  if (spec.uses_float_data) {
    if (spec.dtype == v1::DATA_TYPE_UNSPECIFIED) spec.dtype = v1::DATA_TYPE_FP32;
    if (spec.dtype != v1::DATA_TYPE_FP32) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".dtype: float_data carries FP32 values, but dtype is ", DataTypeName(spec.dtype)));
    }
  } else if (DataTypeSize(spec.dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".dtype: must be FP32, BF16 or BOOL with raw_data, got ", DataTypeName(spec.dtype)));
  }

  const int64_t element_size = DataTypeSize(spec.dtype);
  std::optional<int64_t> elements = core::CheckedProduct(spec.shape);
  std::optional<int64_t> bytes = elements ? core::CheckedMul(*elements, element_size) : std::nullopt;
  if (!bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape: [", absl::StrJoin(spec.shape, ", "), "] has more elements than fit in int64"));
  }
  spec.elements = *elements;

  if (spec.uses_float_data) {
    if (tensor.float_data_size() != spec.elements) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".float_data: ", tensor.float_data_size(), " values, but shape [",
          absl::StrJoin(spec.shape, ", "), "] has ", spec.elements));
    }
  } else if (static_cast<int64_t>(tensor.raw_data().size()) != *bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".raw_data: ", tensor.raw_data().size(), " bytes, but shape [",
        absl::StrJoin(spec.shape, ", "), "] x ", DataTypeName(spec.dtype), " needs ", *bytes));
  }
  return spec;
}

FloatValues::FloatValues(const v1::Tensor& tensor, const TensorSpec& spec) {
  const size_t n = static_cast<size_t>(spec.elements);
  if (spec.uses_float_data) {
    values_ = absl::MakeConstSpan(tensor.float_data().data(), n);
    return;
  }
  const char* bytes = tensor.raw_data().data();
  if (spec.dtype == v1::DATA_TYPE_FP32) {
    // Little-endian FP32 is this machine's float: view it when aligned.
    if (IsAligned(bytes, alignof(float))) {
      values_ = absl::MakeConstSpan(reinterpret_cast<const float*>(bytes), n);
      return;
    }
    storage_.resize(n);
    std::memcpy(storage_.data(), bytes, n * sizeof(float));
  } else if (spec.dtype == v1::DATA_TYPE_BOOL) {
    storage_.resize(n);
    for (size_t i = 0; i < n; ++i) storage_[i] = bytes[i] != 0 ? 1.0f : 0.0f;
  } else {  // BF16: the upper 16 bits of an FP32.
    storage_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      core::Bf16 half;
      std::memcpy(&half, bytes + 2 * i, sizeof(half));
      storage_[i] = core::Bfloat16ToFloat(half);
    }
  }
  values_ = absl::MakeConstSpan(storage_);
}

RawBytes RawBytes::Uninitialized(size_t size) {
  RawBytes raw;
  // new char[] leaves the bytes as the allocator had them: no zero-fill, and
  // with jemalloc no page faults when pages freed by an earlier response are
  // reused. operator new[] aligns to 16 bytes: floats can live there.
  raw.bytes_.reset(new char[size]);
  raw.size_ = size;
  return raw;
}

char* RawBytes::release() {
  size_ = 0;
  return bytes_.release();
}

OutputTensor::OutputTensor(absl::Span<const int64_t> shape, v1::DataType dtype,
                           bool use_float_data, v1::Tensor* tensor, RawBytes* raw)
    : tensor_(tensor), dtype_(dtype), raw_(raw) {
  tensor->Clear();
  tensor->set_dtype(dtype);
  int64_t elements = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    elements *= d;  // shapes here come from validated requests
  }
  const auto n = static_cast<size_t>(elements);
  elements_ = n;
  if (dtype == v1::DATA_TYPE_BF16) {
    scratch_.reset(new float[n]);  // not zeroed: the kernels write every value
    values_ = absl::MakeSpan(scratch_.get(), n);
  } else if (use_float_data) {
    tensor->mutable_float_data()->Resize(static_cast<int>(elements), 0.0f);
    values_ = absl::MakeSpan(tensor->mutable_float_data()->mutable_data(), n);
  } else {
    values_ = absl::MakeSpan(reinterpret_cast<float*>(AllocateRaw(n * sizeof(float))), n);
  }
}

char* OutputTensor::AllocateRaw(size_t bytes) {
  if (raw_ == nullptr) {
    std::string* in_message = tensor_->mutable_raw_data();
    in_message->resize(bytes);
    // std::string storage comes from operator new (16-byte aligned) or, for a
    // few bytes, lies inside the string object (8-byte aligned): float-aligned.
    return in_message->data();
  }
  *raw_ = RawBytes::Uninitialized(bytes);
  return raw_->data();
}

void OutputTensor::Commit() {
  if (dtype_ != v1::DATA_TYPE_BF16) return;
  // Little-endian halves (x86-64, as everywhere the wire format is read raw).
  core::FloatsToBf16(scratch_.get(), static_cast<int64_t>(elements_),
                     reinterpret_cast<core::Bf16*>(AllocateRaw(elements_ * 2)));
  scratch_.reset();
  values_ = {};
}

}  // namespace attnserve::server
