#ifndef ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_RESPONSE_H_
#define ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_RESPONSE_H_

#include "absl/status/status.h"
#include "inference/open_inference.pb.h"
#include "server/api/open_inference/infer_request.h"
#include "server/api/wire_response.h"

namespace attnserve::server::open_inference {

// Translates a computed Attend response into the Open Inference Protocol's
// reply laid out as `form` says: the named outputs in order, with their
// datatype ("FP32", or "BF16" for output_dtype BF16) and shape; values in
// raw_output_contents (form.raw) or typed fp32_contents; model_version "1",
// id echoed; parameters kernel_path and precision (strings), queue_us and
// compute_us, batch_size and batch_tokens (int64). Takes the raw buffers out
// of `response`. INTERNAL if an output the form names was not computed.
// Not thread-safe for one `response`.
absl::Status InferResponseFromAttend(const InferReplyForm& form, WireResponse& response,
                                     inference::ModelInferResponse* infer);

}  // namespace attnserve::server::open_inference

#endif  // ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_RESPONSE_H_
