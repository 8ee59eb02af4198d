#ifndef ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_RESPONSE_H_
#define ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_RESPONSE_H_

#include <grpcpp/support/byte_buffer.h>

#include <vector>

#include "absl/status/status.h"
#include "inference/open_inference.pb.h"
#include "server/api/open_inference/infer_request.h"
#include "server/api/tensor_codec.h"
#include "server/api/wire_response.h"

namespace attnserve::server::open_inference {

// A ModelInferResponse on its way to the wire, as WireResponse is for Attend:
// its raw_output_contents stay in buffers of their own -- for the output and
// the maps the kernels' own, moved from the WireResponse, not copied -- and
// SerializeTo hands them to gRPC as slices after the message's other fields
// (what any protobuf parser reads as the whole message).
// Not thread-safe; used by one call at a time.
struct InferWireResponse {
  inference::ModelInferResponse message;  // everything but raw_output_contents
  std::vector<RawBytes> raw_outputs;      // raw_output_contents, in the order of message.outputs

  // The wire form into `out`, taking the raw buffers (empty afterwards; gRPC
  // frees them once sent). INTERNAL if the message cannot be serialized.
  absl::Status SerializeTo(grpc::ByteBuffer* out);
};

// Translates a computed Attend response into the Open Inference Protocol's
// reply laid out as `form` says: the named outputs in order, with their
// datatype ("FP32", or "BF16" for output_dtype BF16) and shape; values in
// raw_outputs (form.raw) or typed fp32_contents; model_version "1", id
// echoed; parameters kernel_path and precision (strings), queue_us and
// compute_us, batch_size and batch_tokens (int64). Takes the raw buffers out
// of `response`. INTERNAL if an output the form names was not computed.
// Not thread-safe for one `response`.
absl::Status InferResponseFromAttend(const InferReplyForm& form, WireResponse& response,
                                     InferWireResponse* infer);

}  // namespace attnserve::server::open_inference

#endif  // ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_RESPONSE_H_
