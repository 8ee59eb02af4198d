#ifndef ATTNSERVE_SERVER_API_WIRE_RESPONSE_H_
#define ATTNSERVE_SERVER_API_WIRE_RESPONSE_H_

#include <grpcpp/support/byte_buffer.h>

#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "server/api/tensor_codec.h"

namespace attnserve::server {

// An AttendResponse on its way to the wire. The bulk of it -- the raw_data of
// the output and of the attention maps -- stays in buffers of its own, which
// the kernels wrote into; Serialize hands those buffers to gRPC as slices, so
// the bytes are not copied into the message, nor the message into gRPC's
// buffers (for a 50 MB map, two copies of 50 MB and their page faults).
//
// The bytes on the wire are the message with those raw_data fields set, each
// raw tensor written whole (header and bytes) after the message's other
// fields: what any protobuf parser reads, field order being free.
//
// Not thread-safe; used by one call at a time.
struct WireResponse {
  // Everything but the raw bytes below: message.output's and
  // message.attention_maps' dtype and shape, their float_data if they use it.
  v1::AttendResponse message;
  RawBytes output_raw;  // message.output's raw_data, when it travels raw
  RawBytes maps_raw;    // message.attention_maps' raw_data, likewise

  // The bytes of the attention maps in the response, raw or float_data.
  int64_t attention_map_bytes() const;
  // Forgets everything (a failed call sends no response).
  void Clear();
  // The wire form into `out`, taking the raw buffers (empty afterwards; gRPC
  // frees them once sent) and the raw tensors' headers out of `message`.
  // INTERNAL if the message cannot be serialized.
  absl::Status SerializeTo(grpc::ByteBuffer* out);
  // The same wire form as slices, for a caller that frames it further.
  absl::StatusOr<std::vector<grpc::Slice>> TakeWireSlices();
};

// The start of a length-delimited protobuf field: its tag, then the length of
// its body of `body_size` bytes (which the caller writes after it).
std::string LengthDelimitedFieldStart(int field_number, size_t body_size);

// The bytes that introduce `raw_size` raw bytes as the raw_data of the tensor
// `header` (its dtype and shape, no data) in field `field_number` of a
// message: the field's start, the header's fields, then raw_data's start. The
// raw bytes themselves follow; the tensor is written whole, in one occurrence
// of its field.
std::string RawTensorFieldStart(int field_number, const v1::Tensor& header, size_t raw_size);

// A slice over `raw`'s buffer that frees it when gRPC lets go of it; `raw` is
// empty afterwards.
grpc::Slice TakeAsSlice(RawBytes& raw);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_WIRE_RESPONSE_H_
