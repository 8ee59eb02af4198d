#include "server/api/open_inference/infer_response.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/api/tensor_codec.h"
#include "server/api/wire_response.h"

namespace attnserve::server::open_inference {
namespace {

int64_t Micros(const google::protobuf::Duration& d) {
  return d.seconds() * 1000000 + d.nanos() / 1000;
}

// Where one output's header (dtype, shape) and values are in the response.
struct Source {
  const v1::Tensor* header = nullptr;  // null: not computed
  RawBytes* raw = nullptr;             // its raw values when kept out of the message
};

Source Find(const std::string& name, WireResponse& response) {
  const v1::AttendResponse& m = response.message;
  if (name == kOutput) return {m.has_output() ? &m.output() : nullptr, &response.output_raw};
  if (name == kAttentionMaps) {
    return {m.has_attention_maps() ? &m.attention_maps() : nullptr, &response.maps_raw};
  }
  if (!m.has_head_statistics()) return {};
  const v1::HeadStatistics& stats = m.head_statistics();
  if (name == kHeadEntropy) return {stats.has_entropy() ? &stats.entropy() : nullptr, nullptr};
  if (name == kHeadMaxWeight) {
    return {stats.has_max_weight() ? &stats.max_weight() : nullptr, nullptr};
  }
  if (name == kHeadContribution) {
    return {stats.has_contribution() ? &stats.contribution() : nullptr, nullptr};
  }
  return {};
}

}  // namespace

absl::Status InferWireResponse::SerializeTo(grpc::ByteBuffer* out) {
  std::string head;
  if (!message.SerializeToString(&head)) {
    return absl::InternalError("response: cannot serialize the ModelInferResponse");
  }
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * raw_outputs.size() + 1);
  for (RawBytes& raw : raw_outputs) {
    head += LengthDelimitedFieldStart(inference::ModelInferResponse::kRawOutputContentsFieldNumber,
                                      raw.size());
    slices.push_back(grpc::Slice(head));
    head.clear();
    if (!raw.empty()) slices.push_back(TakeAsSlice(raw));
  }
  if (!head.empty() || slices.empty()) slices.push_back(grpc::Slice(head));
  raw_outputs.clear();
  grpc::ByteBuffer bytes(slices.data(), slices.size());
  out->Swap(&bytes);
  return absl::OkStatus();
}

absl::Status InferResponseFromAttend(const InferReplyForm& form, WireResponse& response,
                                     InferWireResponse* infer) {
  const v1::AttendResponse& m = response.message;
  inference::ModelInferResponse& reply = infer->message;
  reply.set_model_name(m.model());
  reply.set_model_version(kModelVersion);
  reply.set_id(form.id);
  auto& params = *reply.mutable_parameters();
  params["kernel_path"].set_string_param(m.kernel_path());
  params["precision"].set_string_param(m.precision() == v1::PRECISION_BF16 ? "bf16" : "fp32");
  params["queue_us"].set_int64_param(Micros(m.timing().queue()));
  params["compute_us"].set_int64_param(Micros(m.timing().compute()));
  params["batch_size"].set_int64_param(m.timing().batch_size());
  params["batch_tokens"].set_int64_param(m.timing().batch_tokens());
  for (const std::string& name : form.outputs) {
    Source source = Find(name, response);
    if (source.header == nullptr) {
      return absl::InternalError(absl::StrCat("outputs: '", name, "' was not computed"));
    }
    const v1::Tensor& header = *source.header;
    auto* out = reply.add_outputs();
    out->set_name(name);
    out->set_datatype(DataTypeName(header.dtype()));
    out->mutable_shape()->Assign(header.shape().begin(), header.shape().end());
    // The values as the Attend response holds them: raw bytes kept out of
    // the message, raw_data in it, or float_data.
    const bool kept_out = source.raw != nullptr && !source.raw->empty();
    const char* bytes = nullptr;
    size_t size = 0;
    if (kept_out) {
      bytes = source.raw->data();
      size = source.raw->size();
    } else if (!header.raw_data().empty()) {
      bytes = header.raw_data().data();
      size = header.raw_data().size();
    } else {
      bytes = reinterpret_cast<const char*>(header.float_data().data());
      size = sizeof(float) * static_cast<size_t>(header.float_data_size());
    }
    if (form.raw) {
      if (kept_out) {
        infer->raw_outputs.push_back(std::move(*source.raw));  // the kernels' buffer, no copy
      } else {
        RawBytes copy = RawBytes::Uninitialized(size);
        if (size > 0) std::memcpy(copy.data(), bytes, size);
        infer->raw_outputs.push_back(std::move(copy));
      }
      continue;
    }
    if (header.dtype() != v1::DATA_TYPE_FP32) {
      return absl::InternalError(absl::StrCat("outputs: '", name, "' is ",
                                              DataTypeName(header.dtype()),
                                              ", which has no typed contents"));
    }
    auto* values = out->mutable_contents()->mutable_fp32_contents();
    values->Resize(static_cast<int>(size / sizeof(float)), 0.0f);
    if (size > 0) std::memcpy(values->mutable_data(), bytes, size);
  }
  return absl::OkStatus();
}

}  // namespace attnserve::server::open_inference
