#ifndef ATTNSERVE_SERVER_API_OPEN_INFERENCE_MODEL_METADATA_H_
#define ATTNSERVE_SERVER_API_OPEN_INFERENCE_MODEL_METADATA_H_

#include "attnserve/v1/attention.pb.h"
#include "inference/open_inference.pb.h"

namespace attnserve::server::open_inference {

// The platform name ModelMetadata gives every attnserve model.
inline constexpr char kPlatform[] = "attnserve_attention";

// A serving model's Open Inference Protocol metadata, from its attnserve.v1
// description (FillModelInfo): name, versions ["1"], platform, every input
// and output the model takes and gives with its datatype (FP32, the
// protocol's declared type; hidden_states, context and mask also take BF16,
// see the properties) and shape (-1 for a dimension of any size), and
// properties with the head configuration and limits as decimal strings.
// Thread-safe.
void ModelMetadataFromInfo(const v1::ModelInfo& info, inference::ModelMetadataResponse* metadata);

}  // namespace attnserve::server::open_inference

#endif  // ATTNSERVE_SERVER_API_OPEN_INFERENCE_MODEL_METADATA_H_
