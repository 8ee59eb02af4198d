#ifndef ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_ATTENTION_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/compute_executor.h"
#include "server/model_registry.h"
#include "server/server_options.h"

namespace attnserve::server {

// attnserve.v1.AttentionService on the gRPC callback API. Handlers validate,
// convert and enqueue on the compute executor; the executor runs the layer
// and finishes the call. No attention math runs on a gRPC thread.
//
// Thread-safe. `registry` and `executor` must outlive the service.
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  enum class State { kStarting, kServing, kDraining };

  AttentionServiceImpl(const ServerOptions& options, const ModelRegistry* registry,
                       ComputeExecutor* executor);

  // Attend answers UNAVAILABLE unless the state is kServing.
  void set_state(State state) { state_.store(state); }

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelInfo* response) override;

 private:
  // Constant after construction.
  const ServerOptions options_;
  const ModelRegistry* const registry_;
  ComputeExecutor* const executor_;

  std::atomic<State> state_{State::kStarting};
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_ATTENTION_SERVICE_H_
