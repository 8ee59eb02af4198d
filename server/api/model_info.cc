#include "server/api/model_info.h"

#include <cstdint>
#include <string>

namespace attnserve::server {
namespace {

v1::ModelState ToProto(ModelState state) {
  switch (state) {
    case ModelState::kLoading:
      return v1::MODEL_STATE_LOADING;
    case ModelState::kReady:
      return v1::MODEL_STATE_READY;
    case ModelState::kFailed:
      return v1::MODEL_STATE_FAILED;
  }
  return v1::MODEL_STATE_UNSPECIFIED;
}

}  // namespace

void FillModelInfo(const Model& model, const RequestLimits& limits, v1::ModelInfo* info) {
  const core::HeadConfig& config = model.layer->config();
  info->set_name(model.name);
  info->set_state(v1::MODEL_STATE_READY);
  info->set_causal(model.causal);
  info->set_description(model.description);
  v1::HeadConfig* head = info->mutable_head_config();
  head->set_d_model(static_cast<int32_t>(config.d_model));
  head->set_num_heads(static_cast<int32_t>(config.num_heads));
  head->set_num_kv_heads(static_cast<int32_t>(config.num_kv_heads));
  head->set_head_dim(static_cast<int32_t>(config.head_dim));
  head->set_scale(config.scale);
  head->mutable_rotary()->set_rotary_dim(static_cast<int32_t>(config.rotary.rotary_dim));
  if (config.rotary.rotary_dim > 0) head->mutable_rotary()->set_theta(config.rotary.theta);
  head->set_context_dim(static_cast<int32_t>(config.context_dim));
  v1::ModelLimits* model_limits = info->mutable_limits();
  model_limits->set_max_batch(limits.max_batch);
  model_limits->set_max_seq_len(limits.max_seq_len);
  model_limits->set_max_attention_map_bytes(limits.max_attention_map_bytes);
  info->add_input_dtypes(v1::DATA_TYPE_FP32);
  info->add_input_dtypes(v1::DATA_TYPE_BF16);
}

void FillModelStatus(const ModelStatus& status, const RequestLimits& limits, v1::ModelInfo* info) {
  if (status.model != nullptr) {
    FillModelInfo(*status.model, limits, info);
  } else {
    info->set_name(status.name);
  }
  info->set_state(ToProto(status.state));
  if (!status.failure.ok()) info->set_failure_reason(std::string(status.failure.message()));
}

}  // namespace attnserve::server
