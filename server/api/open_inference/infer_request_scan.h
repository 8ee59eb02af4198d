#ifndef ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_REQUEST_SCAN_H_
#define ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_REQUEST_SCAN_H_

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"

namespace attnserve::server::open_inference {

// How many entries of each repeated field of a ModelInferRequest attnserve
// reads. Every entry, even an empty one of 2 bytes on the wire, becomes an
// object of about 100 bytes when parsed; these bounds keep what a request of
// --max_receive_message_bytes can make parsing allocate near its own size.
inline constexpr int kMaxInferInputs = 16;              // inputs
inline constexpr int kMaxInferOutputs = 16;             // outputs
inline constexpr int kMaxInferRawContents = 16;         // raw_input_contents
inline constexpr int kMaxInferParameters = 64;          // parameters
inline constexpr int kMaxInferTensorParameters = 16;    // inputs[i] / outputs[i].parameters

// Reads the top-level fields of a ModelInferRequest's wire form in `bytes`
// (and the parameters and contents inside each input and output) without
// parsing it: tags are read and fields skipped, nothing is copied or
// allocated per entry. INVALID_ARGUMENT naming the field when one has more
// entries than its bound above, or when an input's contents carry
// bytes_contents (attnserve takes no BYTES tensors); INVALID_ARGUMENT naming
// the request when the bytes are not a protobuf message. OK says nothing of
// the fields' values: the request is still to be parsed and checked.
// Thread-safe; `bytes` is not consumed.
absl::Status ScanInferRequest(const grpc::ByteBuffer& bytes);

}  // namespace attnserve::server::open_inference

#endif  // ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_REQUEST_SCAN_H_
