#ifndef ATTNSERVE_SERVER_API_MODEL_INFO_H_
#define ATTNSERVE_SERVER_API_MODEL_INFO_H_

#include "attnserve/v1/attention.pb.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"

namespace attnserve::server {

// A serving model as attnserve.v1 describes it (GetModel, ListModels, and the
// Open Inference Protocol's ModelMetadata, which is made from it): name,
// head configuration, the server's limits, input dtypes, state READY.
// Thread-safe.
void FillModelInfo(const Model& model, const RequestLimits& limits, v1::ModelInfo* info);

// A registry entry in any state: READY entries carry everything (FillModelInfo),
// LOADING and FAILED ones their name, state and failure reason. Thread-safe.
void FillModelStatus(const ModelStatus& status, const RequestLimits& limits, v1::ModelInfo* info);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_MODEL_INFO_H_
