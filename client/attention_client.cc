#include "client/attention_client.h"

#include <chrono>
#include <cstring>
#include <utility>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/strings/str_cat.h"

namespace attnserve::client {
namespace {

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// One blocking unary call with a deadline `timeout_seconds` from now.
template <typename Response, typename Stub, typename Request>
absl::StatusOr<Response> Call(Stub& stub,
                              grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                           Response*),
                              const Request& request, double timeout_seconds) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(timeout_seconds * 1e6)));
  Response response;
  grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Create(
    const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target: required");
  if (!(options.timeout_seconds > 0)) {
    return absl::InvalidArgumentError("timeout_seconds: must be positive");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_receive_message_bytes));
  args.SetMaxSendMessageSize(-1);
  auto channel =
      grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), args);
  return std::unique_ptr<AttentionClient>(new AttentionClient(options, std::move(channel)));
}

AttentionClient::AttentionClient(const ClientOptions& options,
                                 std::shared_ptr<grpc::Channel> channel)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::AttentionService::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

absl::StatusOr<v1::ListModelsResponse> AttentionClient::ListModels() const {
  return Call(*stub_, &v1::AttentionService::Stub::ListModels, v1::ListModelsRequest(),
              options_.timeout_seconds);
}

absl::StatusOr<v1::ModelInfo> AttentionClient::GetModel(absl::string_view name) const {
  v1::GetModelRequest request;
  request.set_name(std::string(name));
  return Call(*stub_, &v1::AttentionService::Stub::GetModel, request, options_.timeout_seconds);
}

absl::StatusOr<v1::AttendResponse> AttentionClient::Attend(const v1::AttendRequest& request) const {
  return Call(*stub_, &v1::AttentionService::Stub::Attend, request, options_.timeout_seconds);
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> AttentionClient::CheckHealth(
    absl::string_view service) const {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response = Call(
      *health_stub_, &grpc::health::v1::Health::Stub::Check, request, options_.timeout_seconds);
  if (!response.ok()) return response.status();
  return response->status();
}

v1::AttendRequest MakeAttendRequest(absl::string_view model, absl::Span<const float> hidden_states,
                                    int64_t batch, int64_t seq, int64_t d_model,
                                    v1::AttentionMapMode maps) {
  v1::AttendRequest request;
  request.set_model(std::string(model));
  v1::Tensor* tensor = request.mutable_hidden_states();
  tensor->set_dtype(v1::DATA_TYPE_FP32);
  tensor->add_shape(batch);
  tensor->add_shape(seq);
  tensor->add_shape(d_model);
  tensor->set_raw_data(reinterpret_cast<const char*>(hidden_states.data()),
                       hidden_states.size() * sizeof(float));
  request.mutable_attention_maps()->set_mode(maps);
  return request;
}

absl::StatusOr<std::vector<float>> TensorValues(const v1::Tensor& tensor) {
  const bool bf16 = tensor.dtype() == v1::DATA_TYPE_BF16;
  if (tensor.dtype() != v1::DATA_TYPE_FP32 && !bf16) {
    return absl::InvalidArgumentError("tensor: only FP32 and BF16 tensors are decoded");
  }
  int64_t elements = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0 || (d > 0 && elements > INT64_MAX / 4 / d)) {
      return absl::InvalidArgumentError("tensor.shape: invalid");
    }
    elements *= d;
  }
  if (tensor.float_data_size() > 0) {
    if (bf16) return absl::InvalidArgumentError("tensor.float_data: BF16 travels as raw_data");
    if (tensor.float_data_size() != elements) {
      return absl::InvalidArgumentError("tensor.float_data: size does not match shape");
    }
    return std::vector<float>(tensor.float_data().begin(), tensor.float_data().end());
  }
  const int64_t item = bf16 ? 2 : 4;
  if (static_cast<int64_t>(tensor.raw_data().size()) != elements * item) {
    return absl::InvalidArgumentError("tensor.raw_data: size does not match shape");
  }
  std::vector<float> values(elements);
  if (!bf16) {
    std::memcpy(values.data(), tensor.raw_data().data(), tensor.raw_data().size());
    return values;
  }
  // A bfloat16 is the upper half of a binary32.
  const auto* bytes = reinterpret_cast<const unsigned char*>(tensor.raw_data().data());
  for (int64_t i = 0; i < elements; ++i) {
    const uint32_t bits = (uint32_t{bytes[2 * i + 1]} << 24) | (uint32_t{bytes[2 * i]} << 16);
    std::memcpy(&values[i], &bits, sizeof(float));
  }
  return values;
}

}  // namespace attnserve::client
