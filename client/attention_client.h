#ifndef ATTNSERVE_CLIENT_ATTENTION_CLIENT_H_
#define ATTNSERVE_CLIENT_ATTENTION_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnserve::client {

struct ClientOptions {
  // gRPC target, e.g. "localhost:50051" or "dns:///attnserve:50051".
  std::string target = "localhost:50051";
  // Deadline of each call.
  double timeout_seconds = 30;
  // Largest response accepted (outputs and maps can be large).
  int64_t max_receive_message_bytes = int64_t{256} << 20;
};

// A thin C++ client of attnserve.v1.AttentionService and grpc.health.v1.
// Calls return the server's status as an absl::Status with the same code and
// message. Thread-safe (gRPC channels and stubs are).
class AttentionClient {
 public:
  // INVALID_ARGUMENT for an empty target or a non-positive timeout.
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Create(const ClientOptions& options);

  absl::StatusOr<v1::ListModelsResponse> ListModels() const;
  absl::StatusOr<v1::ModelInfo> GetModel(absl::string_view name) const;
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request) const;
  // The health of `service` ("" for the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      absl::string_view service) const;

 private:
  AttentionClient(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel);

  // Constant after construction.
  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

// An Attend request for `model` with FP32 hidden states [batch, seq, d_model]
// in raw_data.
v1::AttendRequest MakeAttendRequest(absl::string_view model, absl::Span<const float> hidden_states,
                                    int64_t batch, int64_t seq, int64_t d_model,
                                    v1::AttentionMapMode maps = v1::ATTENTION_MAP_MODE_NONE);

// The values of an FP32 tensor (raw_data or float_data) or a BF16 one
// (raw_data), as floats. INVALID_ARGUMENT for another dtype or a size that
// does not match the shape.
absl::StatusOr<std::vector<float>> TensorValues(const v1::Tensor& tensor);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_ATTENTION_CLIENT_H_
