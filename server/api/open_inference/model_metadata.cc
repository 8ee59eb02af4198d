#include "server/api/open_inference/model_metadata.h"

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/api/open_inference/infer_request.h"

namespace attnserve::server::open_inference {
namespace {

void AddTensor(
    const char* name, const char* datatype, std::initializer_list<int64_t> shape,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* tensors) {
  auto* tensor = tensors->Add();
  tensor->set_name(name);
  tensor->set_datatype(datatype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
}

}  // namespace

void ModelMetadataFromInfo(const v1::ModelInfo& info, inference::ModelMetadataResponse* metadata) {
  const v1::HeadConfig& head = info.head_config();
  const int64_t d_model = head.d_model();
  const int64_t context_dim = head.context_dim() > 0 ? head.context_dim() : head.d_model();
  const int64_t num_heads = head.num_heads();
  metadata->set_name(info.name());
  // From a std::string: GCC 12 at -O3 reports a false -Wrestrict inside
  // add_versions(const char*) (GCC bug 105329).
  metadata->add_versions(std::string(kModelVersion));
  metadata->set_platform(kPlatform);
  auto* in = metadata->mutable_inputs();
  AddTensor(kHiddenStates, "FP32", {-1, -1, d_model}, in);
  AddTensor(kSequenceLengths, "INT64", {-1}, in);
  AddTensor(kContext, "FP32", {-1, -1, context_dim}, in);
  AddTensor(kContextLengths, "INT64", {-1}, in);
  AddTensor(kMask, "FP32", {-1, -1, -1}, in);
  AddTensor(kHeadMask, "FP32", {num_heads}, in);
  AddTensor(kPositionOffsets, "INT64", {-1}, in);
  AddTensor(kAttentionMapHeads, "INT64", {-1}, in);
  AddTensor(kAttentionMapRows, "INT64", {-1}, in);
  auto* out = metadata->mutable_outputs();
  AddTensor(kOutput, "FP32", {-1, -1, d_model}, out);
  // per_head [batch, heads, rows, seq_kv]; mean maps drop the heads.
  AddTensor(kAttentionMaps, "FP32", {-1, -1, -1, -1}, out);
  AddTensor(kHeadEntropy, "FP32", {-1, num_heads}, out);
  AddTensor(kHeadMaxWeight, "FP32", {-1, num_heads}, out);
  AddTensor(kHeadContribution, "FP32", {-1, num_heads}, out);
  auto& p = *metadata->mutable_properties();
  p["d_model"] = absl::StrCat(d_model);
  p["num_heads"] = absl::StrCat(num_heads);
  p["num_kv_heads"] = absl::StrCat(head.num_kv_heads());
  p["head_dim"] = absl::StrCat(head.head_dim());
  p["context_dim"] = absl::StrCat(context_dim);
  p["scale"] = absl::StrCat(head.scale());
  p["rotary_dim"] = absl::StrCat(head.rotary().rotary_dim());
  if (head.rotary().rotary_dim() > 0) p["rotary_theta"] = absl::StrCat(head.rotary().theta());
  // causal: every request on the model is causal; otherwise the causal
  // parameter chooses.
  p["causal"] = info.causal() ? "true" : "false";
  p["max_batch"] = absl::StrCat(info.limits().max_batch());
  p["max_seq_len"] = absl::StrCat(info.limits().max_seq_len());
  p["max_attention_map_bytes"] = absl::StrCat(info.limits().max_attention_map_bytes());
  p["input_datatypes"] = "FP32,BF16";
  p["description"] = info.description();
}

}  // namespace attnserve::server::open_inference
