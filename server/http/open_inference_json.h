#ifndef ATTNSERVE_SERVER_HTTP_OPEN_INFERENCE_JSON_H_
#define ATTNSERVE_SERVER_HTTP_OPEN_INFERENCE_JSON_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "inference/open_inference.pb.h"

namespace attnserve::server {

// The Open Inference Protocol's JSON (its HTTP/REST form) <-> its protobuf
// messages (the gRPC form), so that the REST routes can call the gRPC service.
// Free functions over immutable inputs: thread-safe.
//
// Tensor data ("data"): a JSON array, flat (row-major) or nested exactly as
// the shape, of
//   BOOL                                  true / false
//   INT8, INT16, INT32, INT64             integers in the type's range
//   UINT8, UINT16, UINT32, UINT64         integers in the type's range
//   FP32, FP64                            numbers (integers too)
//   BF16                                  numbers, read as FP32 and rounded to
//                                         the nearest BF16 (ties to even), as
//                                         the server rounds FP32 inputs for
//                                         BF16 compute; exact BF16 values pass
//                                         unchanged
// FP16 and BYTES are refused (no attnserve model takes them; the protocol's
// text notes that FP16 has no standard JSON form). The binary-data extension
// (tensors as raw bytes after the JSON) is not implemented.
//
// In the protobuf request, tensors travel in the typed contents when every
// input has a typed field, else (BF16) all of them in raw_input_contents.

// Parses an $inference_request body for the model and version named by the
// URL (version "" when the URL names none). INVALID_ARGUMENT naming the field
// ("inputs[0].data[3]: ...", "request body: not valid JSON (at byte 17)") for
// anything malformed; the message echoes client text only abbreviated.
absl::StatusOr<inference::ModelInferRequest> InferRequestFromJson(absl::string_view body,
                                                                  absl::string_view model_name,
                                                                  absl::string_view model_version);

// Writes an $inference_response: outputs with their data flat, FP32 and BF16
// values in the shortest decimal form that reads back to the same FP32 value,
// FP64 likewise for doubles; a non-finite value (JSON has none) as null.
// Outputs may carry typed contents or raw_output_contents. INTERNAL when an
// output's contents do not match its datatype and shape (a broken response),
// UNIMPLEMENTED for datatypes the JSON form does not carry (FP16, BYTES).
absl::StatusOr<std::string> InferResponseToJson(const inference::ModelInferResponse& response);

// $metadata_server_response.
std::string ServerMetadataToJson(const inference::ServerMetadataResponse& response);
// $metadata_model_response ("versions" only when there are any).
std::string ModelMetadataToJson(const inference::ModelMetadataResponse& response);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_HTTP_OPEN_INFERENCE_JSON_H_
