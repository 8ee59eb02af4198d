#ifndef ATTNSERVE_SERVER_ATTN_SERVER_H_
#define ATTNSERVE_SERVER_ATTN_SERVER_H_

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/allocator_cache.h"
#include "server/api/attention_service.h"
#include "server/api/open_inference_service.h"
#include "server/common/server_options.h"
#include "server/http/http_front.h"
#include "server/models/model_loader.h"
#include "server/models/model_registry.h"
#include "server/models/model_repository.h"
#include "server/observability/metrics.h"
#include "server/scheduling/compute_executor.h"

namespace attnserve::server {

// The whole attnserve server: the gRPC server (AttentionService, standard
// health, reflection), the model registry, the compute executor, the
// metrics endpoint (options.metrics_address) and the HTTP port
// (options.http_address: the Open Inference Protocol's REST form).
//
// Life: Create (listening, health NOT_SERVING) -> LoadModelsAndServe (health
// SERVING) -> Shutdown (health NOT_SERVING, drains calls in flight).
// Health is reported for "" and for "attnserve.v1.AttentionService" alike:
// SERVING exactly while Attend can be served.
//
// Thread-safe.
class AttnServer {
 public:
  // INVALID_ARGUMENT for bad options, UNAVAILABLE when the gRPC or the
  // metrics address cannot be bound.
  static absl::StatusOr<std::unique_ptr<AttnServer>> Create(const ServerOptions& options);
  ~AttnServer();  // Shutdown()
  AttnServer(const AttnServer&) = delete;
  AttnServer& operator=(const AttnServer&) = delete;

  // Loads the models -- the built-in one, or every folder of
  // options.model_repository on the loader thread -- warms each up on the
  // compute executor, then turns health SERVING. With a repository, health
  // turns SERVING once every start-up load has finished, whether it
  // succeeded or failed (a failed model shows as FAILED with its reason in
  // ListModels and the log; the others serve). INTERNAL when the built-in
  // model cannot be built, FAILED_PRECONDITION when the repository cannot be
  // listed.
  absl::Status LoadModelsAndServe();

  // Turns health NOT_SERVING while still listening and serving for
  // options.lame_duck_seconds, then refuses new calls (UNAVAILABLE), lets
  // calls in flight finish (up to options.drain_timeout_seconds after the lame
  // duck; those left then stop before their next compute stage and answer
  // UNAVAILABLE), waits until calls stop arriving (up to the same deadline),
  // and stops (open health Watch streams end; a compute stage still running
  // more than 4 s after the deadline ends its call CANCELLED). Idempotent.
  void Shutdown();

  // The bound port (the one picked, when options asked for port 0).
  int port() const { return port_; }
  // The port serving /metrics (the one picked for port 0); 0 when
  // options.metrics_address is empty.
  int metrics_port() const { return metrics_->port(); }
  // The HTTP port (the one picked for port 0); 0 when options.http_address is
  // empty.
  int http_port() const { return http_ != nullptr ? http_->port() : 0; }
  // The metrics' text exposition, as /metrics serves it.
  std::string MetricsText() const { return metrics_->TextExposition(); }

 private:
  explicit AttnServer(const ServerOptions& options);
  void SetHealth(bool serving);

  // Constant after Create.
  const ServerOptions options_;
  ModelRegistry registry_;
  // Before the executor and the service: their calls report to it until the
  // last one finishes.
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ComputeExecutor> executor_;
  // With options.model_repository; the loader warms models up on executor_.
  std::unique_ptr<ModelRepository> repository_;
  std::unique_ptr<ModelLoader> loader_;
  // The decode sessions: before the service, which uses them, and after the
  // metrics, which their upkeep reports to.
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<AttentionServiceImpl> service_;
  // The Open Inference Protocol's gRPC service, on service_'s path.
  std::unique_ptr<OpenInferenceService> open_inference_;
  std::unique_ptr<grpc::Server> server_;
  // The HTTP port (options.http_address): its routes call server_ through
  // an in-process channel, so it is destroyed first.
  std::unique_ptr<HttpFront> http_;
  // Gives the allocator's freed memory back when idle or over its bound.
  // Declared after what its thread calls (service_, metrics_, the
  // executor), so it is destroyed, and its thread joined, before them.
  std::unique_ptr<AllocatorCacheKeeper> allocator_cache_;
  int port_ = 0;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

// INVALID_ARGUMENT naming the flag when an option is out of range.
absl::Status ValidateServerOptions(const ServerOptions& options);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_ATTN_SERVER_H_
