#include "server/api/open_inference/infer_response.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/api/tensor_codec.h"

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

absl::Status InferResponseFromAttend(const InferReplyForm& form, WireResponse& response,
                                     inference::ModelInferResponse* infer) {
  const v1::AttendResponse& m = response.message;
  infer->set_model_name(m.model());
  infer->set_model_version("1");
  infer->set_id(form.id);
  auto& params = *infer->mutable_parameters();
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
    auto* out = infer->add_outputs();
    out->set_name(name);
    out->set_datatype(DataTypeName(header.dtype()));
    out->mutable_shape()->Assign(header.shape().begin(), header.shape().end());
    // The values as the Attend response holds them: raw bytes kept out of
    // the message, raw_data in it, or float_data.
    std::string bytes;
    const bool has_raw = source.raw != nullptr && !source.raw->empty();
    if (has_raw) {
      bytes.assign(source.raw->data(), source.raw->size());
      *source.raw = RawBytes();
    } else if (!header.raw_data().empty()) {
      bytes = header.raw_data();
    }
    const bool bytes_form = has_raw || !header.raw_data().empty();
    if (form.raw) {
      if (!bytes_form) {
        bytes.resize(sizeof(float) * header.float_data_size());
        if (!bytes.empty()) std::memcpy(bytes.data(), header.float_data().data(), bytes.size());
      }
      infer->add_raw_output_contents(std::move(bytes));
      continue;
    }
    if (header.dtype() != v1::DATA_TYPE_FP32) {
      return absl::InternalError(
          absl::StrCat("outputs: '", name, "' is ", DataTypeName(header.dtype()),
                       ", which has no typed contents"));
    }
    auto* values = out->mutable_contents()->mutable_fp32_contents();
    if (bytes_form) {
      values->Resize(static_cast<int>(bytes.size() / sizeof(float)), 0.0f);
      if (!bytes.empty()) std::memcpy(values->mutable_data(), bytes.data(), bytes.size());
    } else {
      values->Assign(header.float_data().begin(), header.float_data().end());
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::server::open_inference
