#include "server/api/wire_response.h"

#include <grpcpp/support/slice.h>

#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace attnserve::server {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

// Appends the varint encoding of `value` to `out`.
void AppendVarint(uint64_t value, std::string* out) {
  uint8_t bytes[10];
  const uint8_t* end = CodedOutputStream::WriteVarint64ToArray(value, bytes);
  out->append(reinterpret_cast<const char*>(bytes), static_cast<size_t>(end - bytes));
}

// The bytes that introduce `raw` as the raw_data of the tensor `header`
// (its dtype and shape, no data) in field `field_number` of the response: the
// field's tag and length, the header's fields, then raw_data's tag and length.
// The raw bytes themselves follow.
std::string RawTensorPrefix(int field_number, const v1::Tensor& header, size_t raw_size) {
  std::string inner = header.SerializeAsString();
  AppendVarint(WireFormatLite::MakeTag(v1::Tensor::kRawDataFieldNumber,
                                       WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
               &inner);
  AppendVarint(raw_size, &inner);
  std::string prefix;
  AppendVarint(WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
               &prefix);
  AppendVarint(inner.size() + raw_size, &prefix);
  return prefix + inner;
}

void FreeRawBytes(void* bytes) { delete[] static_cast<char*>(bytes); }

// A slice over the raw bytes that frees them when gRPC lets go of it.
grpc::Slice TakeAsSlice(RawBytes& raw) {
  const size_t size = raw.size();
  return grpc::Slice(raw.release(), size, &FreeRawBytes);
}

}  // namespace

int64_t WireResponse::attention_map_bytes() const {
  return static_cast<int64_t>(maps_raw.size() + message.attention_maps().raw_data().size() +
                              message.attention_maps().float_data_size() * sizeof(float));
}

void WireResponse::Clear() {
  message.Clear();
  output_raw = RawBytes();
  maps_raw = RawBytes();
}

absl::Status WireResponse::SerializeTo(grpc::ByteBuffer* out) {
  // A raw tensor is written whole, in one occurrence of its field (some
  // decoders replace a message field that occurs twice rather than merging
  // it): the message goes without it, then the tensor's header and bytes.
  struct RawTensor {
    int field_number;
    v1::Tensor header;
    RawBytes* bytes;
  };
  std::vector<RawTensor> raws;
  if (!output_raw.empty()) {
    raws.push_back({v1::AttendResponse::kOutputFieldNumber, std::move(*message.mutable_output()),
                    &output_raw});
    message.clear_output();
  }
  if (!maps_raw.empty()) {
    raws.push_back({v1::AttendResponse::kAttentionMapsFieldNumber,
                    std::move(*message.mutable_attention_maps()), &maps_raw});
    message.clear_attention_maps();
  }
  std::string head;
  if (!message.SerializeToString(&head)) {
    return absl::InternalError("response: cannot serialize the message");
  }
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * raws.size() + 1);
  for (RawTensor& raw : raws) {
    head += RawTensorPrefix(raw.field_number, raw.header, raw.bytes->size());
    slices.push_back(grpc::Slice(head));
    head.clear();
    slices.push_back(TakeAsSlice(*raw.bytes));
  }
  if (!head.empty() || slices.empty()) slices.push_back(grpc::Slice(head));
  grpc::ByteBuffer bytes(slices.data(), slices.size());
  out->Swap(&bytes);
  return absl::OkStatus();
}

}  // namespace attnserve::server
