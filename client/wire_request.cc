#include "client/wire_request.h"

#include <memory>
#include <utility>

#include <grpcpp/support/slice.h>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace attnserve::client {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

// The start of a length-delimited field `field_number` whose body is
// `body_size` bytes: its tag and the length.
std::string FieldStart(int field_number, size_t body_size) {
  uint8_t bytes[20];  // two varints of at most 10 bytes each
  uint8_t* end = CodedOutputStream::WriteVarint32ToArray(
      WireFormatLite::MakeTag(field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), bytes);
  end = CodedOutputStream::WriteVarint64ToArray(body_size, end);
  return std::string(reinterpret_cast<const char*>(bytes), static_cast<size_t>(end - bytes));
}

// A slice's hold on the pieces, dropped by gRPC when it lets the slice go.
using PiecesHold = std::shared_ptr<const std::vector<std::string>>;
void DropPiecesHold(void* hold) { delete static_cast<PiecesHold*>(hold); }

}  // namespace

WireRequest::WireRequest(v1::AttendRequest request) {
  struct RawTensor {
    int field_number;
    v1::Tensor* tensor;
  };
  const RawTensor raws[] = {
      {v1::AttendRequest::kHiddenStatesFieldNumber,
       request.has_hidden_states() ? request.mutable_hidden_states() : nullptr},
      {v1::AttendRequest::kContextFieldNumber,
       request.has_context() ? request.mutable_context() : nullptr}};
  std::vector<std::pair<int, v1::Tensor>> taken;  // field number, header and bytes
  for (const RawTensor& raw : raws) {
    if (raw.tensor == nullptr || raw.tensor->raw_data().empty()) continue;
    taken.emplace_back(raw.field_number, std::move(*raw.tensor));
  }
  for (const auto& [field_number, tensor] : taken) {
    if (field_number == v1::AttendRequest::kHiddenStatesFieldNumber) request.clear_hidden_states();
    if (field_number == v1::AttendRequest::kContextFieldNumber) request.clear_context();
  }
  std::vector<std::string> pieces;
  pieces.push_back(request.SerializeAsString());
  for (auto& [field_number, tensor] : taken) {
    std::string bytes = std::move(*tensor.mutable_raw_data());
    tensor.clear_raw_data();
    // The tensor's body: its other fields, then raw_data.
    std::string inner = tensor.SerializeAsString();
    inner += FieldStart(v1::Tensor::kRawDataFieldNumber, bytes.size());
    pieces.push_back(FieldStart(field_number, inner.size() + bytes.size()) + inner);
    pieces.push_back(std::move(bytes));
  }
  for (const std::string& piece : pieces) size_ += static_cast<int64_t>(piece.size());
  pieces_ = std::make_shared<const std::vector<std::string>>(std::move(pieces));
}

grpc::ByteBuffer WireRequest::Bytes() const {
  std::vector<grpc::Slice> slices;
  slices.reserve(pieces_->size());
  for (const std::string& piece : *pieces_) {
    if (piece.empty()) continue;
    // Not copied: each slice holds the pieces until gRPC lets it go, which
    // may be after its call ended (a write cut short by a deadline or a
    // cancel can still sit in the transport's queue).
    slices.emplace_back(const_cast<char*>(piece.data()), piece.size(), &DropPiecesHold,
                        new PiecesHold(pieces_));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace attnserve::client
