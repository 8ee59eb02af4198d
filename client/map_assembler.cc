#include "client/map_assembler.h"

#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve::client {
namespace {

absl::Status Malformed(absl::string_view what) {
  return absl::InternalError(absl::StrCat("AttendStream: the server's stream is malformed: ", what));
}

}  // namespace

absl::Status MapAssembler::Add(v1::AttendStreamResponse& message) {
  switch (message.part_case()) {
    case v1::AttendStreamResponse::kResponse:
      if (started_) return Malformed("a second response");
      return Start(*message.mutable_response());
    case v1::AttendStreamResponse::kMapChunk:
      if (!started_) return Malformed("a map chunk before the response");
      return Place(message.map_chunk());
    default:
      return Malformed("an empty message");
  }
}

absl::Status MapAssembler::Start(v1::AttendResponse& response) {
  started_ = true;
  response_ = std::move(response);
  if (!response_.has_attention_maps()) return absl::OkStatus();
  v1::Tensor* maps = response_.mutable_attention_maps();
  const int dims = maps->shape_size();
  if (dims != 3 && dims != 4) return Malformed("attention_maps.shape has neither 3 nor 4 dims");
  batch_ = maps->shape(0);
  heads_ = dims == 4 ? maps->shape(1) : 1;
  rows_ = maps->shape(dims - 2);
  keys_ = maps->shape(dims - 1);
  if (!maps->raw_data().empty() || maps->float_data_size() > 0) {
    return Malformed("the response carries map values (they come as chunks)");
  }
  // The shape must describe a buffer this process can hold (int64, and bytes
  // that fit a protobuf string).
  int64_t values = 1;
  for (int64_t d : maps->shape()) {
    if (d < 0 || (d > 0 && values > std::numeric_limits<int32_t>::max() / d)) {
      return Malformed("attention_maps.shape is negative or over 2^31 values");
    }
    values *= d;
  }
  values_ = values;
  value_bytes_ = maps->dtype() == v1::DATA_TYPE_BF16 ? 2 : 4;
  // One protobuf string holds the maps: at most 2 GiB.
  if (values_ > std::numeric_limits<int32_t>::max() / value_bytes_) {
    return Malformed("attention_maps.shape is over 2 GiB of values");
  }
  return absl::OkStatus();
}

absl::Status MapAssembler::Place(const v1::AttentionMapChunk& chunk) {
  if (!response_.has_attention_maps()) return Malformed("a map chunk without maps");
  const v1::Tensor& tensor = chunk.maps();
  const v1::Tensor& maps = response_.attention_maps();
  const bool per_head = maps.shape_size() == 4;
  if (tensor.dtype() != maps.dtype() || tensor.shape_size() != maps.shape_size() ||
      tensor.shape(0) != 1 || tensor.shape(tensor.shape_size() - 1) != keys_) {
    return Malformed("a chunk whose dtype or shape does not match attention_maps'");
  }
  const int64_t heads = per_head ? tensor.shape(1) : 1;
  const int64_t rows = tensor.shape(tensor.shape_size() - 2);
  const int64_t b = chunk.sequence(), h = chunk.first_head(), r = chunk.first_row();
  // Whole heads, or rows of one head, inside the maps.
  const bool inside = b >= 0 && b < batch_ && h >= 0 && heads >= 1 && h <= heads_ - heads &&
                      r >= 0 && rows >= 1 && r <= rows_ - rows && (heads == 1 || rows == rows_);
  if (!inside) return Malformed("a chunk outside the maps");
  const int64_t values = heads * rows * keys_;
  const int64_t first = ((b * heads_ + h) * rows_ + r) * keys_;
  if (first != received_) return Malformed("a chunk out of order");
  v1::Tensor* whole = response_.mutable_attention_maps();
  if (chunks_ == 0) {  // the first chunk's encoding is the maps'
    raw_ = tensor.float_data_size() == 0;
    if (!raw_ && maps.dtype() != v1::DATA_TYPE_FP32) {
      return Malformed("float_data chunks of maps that are not FP32");
    }
    if (raw_) {
      whole->mutable_raw_data()->resize(static_cast<size_t>(values_ * value_bytes_));
    } else {
      whole->mutable_float_data()->Resize(static_cast<int>(values_), 0.0f);
    }
  }
  if (raw_) {
    if (static_cast<int64_t>(tensor.raw_data().size()) != values * value_bytes_) {
      return Malformed("a chunk whose raw_data does not match its shape");
    }
    std::memcpy(whole->mutable_raw_data()->data() + first * value_bytes_,
                tensor.raw_data().data(), tensor.raw_data().size());
  } else {
    if (tensor.float_data_size() != values) {
      return Malformed("a chunk whose float_data does not match its shape");
    }
    std::memcpy(whole->mutable_float_data()->mutable_data() + first,
                tensor.float_data().data(), static_cast<size_t>(values) * sizeof(float));
  }
  received_ += values;
  ++chunks_;
  return absl::OkStatus();
}

absl::StatusOr<v1::AttendResponse> MapAssembler::Finish() {
  if (!started_) return Malformed("no response");
  if (received_ != values_) {
    return Malformed(absl::StrCat(received_, " map values received of ", values_));
  }
  return std::move(response_);
}

}  // namespace attnserve::client
