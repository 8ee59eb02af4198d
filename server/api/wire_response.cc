#include "server/api/wire_response.h"

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

void FreeRawBytes(void* bytes) { delete[] static_cast<char*>(bytes); }

}  // namespace

std::string LengthDelimitedFieldStart(int field_number, size_t body_size) {
  std::string start;
  AppendVarint(WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
               &start);
  AppendVarint(body_size, &start);
  return start;
}

std::string RawTensorFieldStart(int field_number, const v1::Tensor& header, size_t raw_size) {
  std::string inner = header.SerializeAsString();
  inner += LengthDelimitedFieldStart(v1::Tensor::kRawDataFieldNumber, raw_size);
  return LengthDelimitedFieldStart(field_number, inner.size() + raw_size) + inner;
}

grpc::Slice TakeAsSlice(RawBytes& raw) {
  const size_t size = raw.size();
  return grpc::Slice(raw.release(), size, &FreeRawBytes);
}

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
  absl::StatusOr<std::vector<grpc::Slice>> slices = TakeWireSlices();
  if (!slices.ok()) return slices.status();
  grpc::ByteBuffer bytes(slices->data(), slices->size());
  out->Swap(&bytes);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<grpc::Slice>> WireResponse::TakeWireSlices() {
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
    head += RawTensorFieldStart(raw.field_number, raw.header, raw.bytes->size());
    slices.push_back(grpc::Slice(head));
    head.clear();
    slices.push_back(TakeAsSlice(*raw.bytes));
  }
  if (!head.empty() || slices.empty()) slices.push_back(grpc::Slice(head));
  return slices;
}

}  // namespace attnserve::server
