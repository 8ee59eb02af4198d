#include "server/api/open_inference/infer_request_scan.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "inference/open_inference.pb.h"

namespace attnserve::server::open_inference {
namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;
using inference::InferTensorContents;
using inference::ModelInferRequest;

constexpr absl::string_view kMalformed =
    "request: not a valid inference.ModelInferRequest (malformed protobuf)";

absl::Status TooMany(absl::string_view field, int bound) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": more than ", bound, " entries (attnserve reads at most ", bound, ")"));
}

// One tag of the message being read; false at its end. `malformed` is set for
// a tag that no message can hold (field number 0, or wire type 6 or 7).
bool NextTag(CodedInputStream& in, uint32_t& tag, bool& malformed) {
  tag = in.ReadTag();
  if (tag == 0) return false;  // end of the message or of the bytes, or a bad varint
  if (WireFormatLite::GetTagFieldNumber(tag) == 0) malformed = true;
  return !malformed;
}

// Enters a length-delimited field (the tag just read): its length, as a
// limit. False when the length is missing.
bool Enter(CodedInputStream& in, CodedInputStream::Limit& limit) {
  uint32_t length;
  if (!in.ReadVarint32(&length) || length > static_cast<uint32_t>(INT32_MAX)) return false;
  limit = in.PushLimit(static_cast<int>(length));
  return true;
}

// Leaves a field entered with Enter: true when all of its length was read
// as whole fields (the bytes may end early, or in a bad tag).
bool Leave(CodedInputStream& in, CodedInputStream::Limit limit) {
  const bool whole = in.ConsumedEntireMessage() && in.BytesUntilLimit() == 0;
  in.PopLimit(limit);
  return whole;
}

bool IsMessage(uint32_t tag, int number) {
  return WireFormatLite::GetTagFieldNumber(tag) == number &&
         WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
}

// Reads one input's or output's fields (entered): counts its parameters
// (field `parameters_number`) and, for an input, the bytes_contents of its
// contents (field `contents_number`, 0 for none).
absl::Status ScanTensor(CodedInputStream& in, absl::string_view field, int parameters_number,
                        int contents_number) {
  int parameters = 0;
  uint32_t tag;
  bool malformed = false;
  while (NextTag(in, tag, malformed)) {
    if (IsMessage(tag, parameters_number)) {
      if (++parameters > kMaxInferTensorParameters) {
        return TooMany(absl::StrCat(field, ".parameters"), kMaxInferTensorParameters);
      }
    } else if (contents_number != 0 && IsMessage(tag, contents_number)) {
      CodedInputStream::Limit limit;
      if (!Enter(in, limit)) return absl::InvalidArgumentError(kMalformed);
      bool inner_malformed = false;
      while (NextTag(in, tag, inner_malformed)) {
        if (IsMessage(tag, InferTensorContents::kBytesContentsFieldNumber)) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".contents.bytes_contents: attnserve takes no BYTES tensors"));
        }
        if (!WireFormatLite::SkipField(&in, tag)) return absl::InvalidArgumentError(kMalformed);
      }
      if (inner_malformed || !Leave(in, limit)) return absl::InvalidArgumentError(kMalformed);
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return absl::InvalidArgumentError(kMalformed);
  }
  if (malformed) return absl::InvalidArgumentError(kMalformed);
  return absl::OkStatus();
}

}  // namespace

absl::Status ScanInferRequest(const grpc::ByteBuffer& bytes) {
  grpc::ByteBuffer shared(bytes);  // shares the slices
  grpc::ProtoBufferReader reader(&shared);
  if (!reader.status().ok()) return absl::InvalidArgumentError(kMalformed);
  CodedInputStream in(&reader);
  int inputs = 0, outputs = 0, raw = 0, parameters = 0;
  uint32_t tag;
  bool malformed = false;
  while (NextTag(in, tag, malformed)) {
    const bool is_input = IsMessage(tag, ModelInferRequest::kInputsFieldNumber);
    const bool is_output = IsMessage(tag, ModelInferRequest::kOutputsFieldNumber);
    if (is_input || is_output) {
      const int index = is_input ? inputs++ : outputs++;
      if (is_input && inputs > kMaxInferInputs) return TooMany("inputs", kMaxInferInputs);
      if (is_output && outputs > kMaxInferOutputs) return TooMany("outputs", kMaxInferOutputs);
      CodedInputStream::Limit limit;
      if (!Enter(in, limit)) return absl::InvalidArgumentError(kMalformed);
      absl::Status tensor =
          is_input
              ? ScanTensor(in, absl::StrCat("inputs[", index, "]"),
                           ModelInferRequest::InferInputTensor::kParametersFieldNumber,
                           ModelInferRequest::InferInputTensor::kContentsFieldNumber)
              : ScanTensor(in, absl::StrCat("outputs[", index, "]"),
                           ModelInferRequest::InferRequestedOutputTensor::kParametersFieldNumber,
                           0);
      if (!tensor.ok()) return tensor;
      if (!Leave(in, limit)) return absl::InvalidArgumentError(kMalformed);
      continue;
    }
    if (IsMessage(tag, ModelInferRequest::kRawInputContentsFieldNumber) &&
        ++raw > kMaxInferRawContents) {
      return TooMany("raw_input_contents", kMaxInferRawContents);
    }
    if (IsMessage(tag, ModelInferRequest::kParametersFieldNumber) &&
        ++parameters > kMaxInferParameters) {
      return TooMany("parameters", kMaxInferParameters);
    }
    if (!WireFormatLite::SkipField(&in, tag)) return absl::InvalidArgumentError(kMalformed);
  }
  // ReadTag returns 0 at the end of the bytes and for a bad varint or a zero
  // tag alike; only the end is a message's end.
  if (malformed || !in.ConsumedEntireMessage()) return absl::InvalidArgumentError(kMalformed);
  return absl::OkStatus();
}

}  // namespace attnserve::server::open_inference
