#ifndef ATTNSERVE_TESTS_SERVER_API_BLOCKABLE_SERVER_H_
#define ATTNSERVE_TESTS_SERVER_API_BLOCKABLE_SERVER_H_

// The Attend service (and the Open Inference Protocol's service on it) on a
// gRPC server of its own on an ephemeral port, with
// its compute executor in the test's hands: Block() occupies the executor, so
// admitted calls stay queued until Release(), however fast or slow the
// machine is. Tests of queueing, batching, deadlines and cancellation use it
// to wait for what they can observe (the queue depth, a counter) instead of
// guessing how long things take.

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "gtest/gtest.h"
#include "inference/open_inference.grpc.pb.h"
#include "server/api/attention_service.h"
#include "server/api/open_inference_service.h"
#include "server/attn_server.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"
#include "server/observability/metrics.h"
#include "server/scheduling/compute_executor.h"
#include "server/sessions/session_manager.h"

namespace attnserve::testing {

// The value of the sample `series` (a name, with its labels if it has any,
// as the exposition writes them) in a Prometheus text exposition; -1 when
// absent.
inline double SampleValue(const std::string& text, absl::string_view series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
      double value = -1;
      return absl::SimpleAtod(line, &value) ? value : -1;
    }
  }
  return -1;
}

// Polls `scrape` until its sample `series` is `value`; false after a minute.
inline bool WaitForSample(const std::function<std::string()>& scrape, absl::string_view series,
                          double value) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (SampleValue(scrape(), series) != value) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// One Attend call started with BlockableServer::Start.
struct PendingCall {
  grpc::ClientContext context;
  v1::AttendRequest request;
  v1::AttendResponse response;
  grpc::Status status;
  absl::Notification done;  // notified when the call has finished
};

// See the file comment. The built-in model (seed `model_seed`) is loaded and
// the service is serving from construction on, with decode sessions
// (options.sessions). Not thread-safe, except
// Start/Attend, which may be called from any thread.
class BlockableServer {
 public:
  BlockableServer(const server::ServerOptions& options, uint64_t model_seed) {
    const absl::Status valid = server::ValidateServerOptions(options);
    EXPECT_TRUE(valid.ok()) << valid;
    absl::StatusOr<std::shared_ptr<const server::Model>> model =
        server::MakeBuiltinModel(model_seed);
    EXPECT_TRUE(model.ok()) << model.status();
    executor_ = *server::ComputeExecutor::Create({.queue_capacity = options.max_queued_requests,
                                                  .compute_threads = options.compute_threads});
    metrics_ = *server::Metrics::Create(
        {.address = "", .queue_capacity = options.max_queued_requests});  // no endpoint
    metrics_->AddModel((*model)->name, (*model)->layer->config());
    EXPECT_TRUE(registry_.Add(*std::move(model)).ok());
    sessions_ = *server::SessionManager::Create(options.sessions);
    service_ = std::make_unique<server::AttentionServiceImpl>(
        options, &registry_, executor_.get(), metrics_.get(), std::nullopt, nullptr,
        sessions_.get());
    service_->set_state(server::AttentionServiceImpl::State::kServing);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_receive_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(options.max_send_message_bytes));
    builder.RegisterService(service_.get());
    open_inference_ = std::make_unique<server::OpenInferenceService>(
        service_.get(), &registry_, options.limits, "test");
    builder.RegisterService(open_inference_.get());
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials()));
    oip_stub_ = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials()));
  }
  ~BlockableServer() {
    if (release_ != nullptr && !release_->HasBeenNotified()) release_->Notify();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
    }
    executor_->Shutdown();
  }
  BlockableServer(const BlockableServer&) = delete;
  BlockableServer& operator=(const BlockableServer&) = delete;

  // Occupies the compute executor until Release(); returns once it does.
  void Block() {
    release_ = std::make_shared<absl::Notification>();
    absl::Notification started;
    const absl::Status submitted = executor_->Submit([&started, release = release_] {
      started.Notify();
      release->WaitForNotification();
    });
    ASSERT_TRUE(submitted.ok()) << submitted;
    started.WaitForNotification();
  }
  void Release() { release_->Notify(); }

  // The metrics' text exposition.
  std::string MetricsText() const { return metrics_->TextExposition(); }
  // Waits (up to a minute) until `depth` Attend calls are queued for compute.
  bool WaitForQueueDepth(int64_t depth) const {
    return WaitForSample([this] { return MetricsText(); }, "attnserve_queue_depth",
                         static_cast<double>(depth));
  }

  // One call, waited for (deadline `timeout`).
  grpc::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response,
                      absl::Duration timeout = absl::Seconds(120)) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    return stub_->Attend(&context, request, response);
  }
  // Starts a call (deadline `timeout`); its `done` is notified when it has
  // finished.
  std::unique_ptr<PendingCall> Start(v1::AttendRequest request,
                                     absl::Duration timeout = absl::Seconds(120)) {
    auto call = std::make_unique<PendingCall>();
    call->request = std::move(request);
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    PendingCall* c = call.get();
    stub_->async()->Attend(&c->context, &c->request, &c->response, [c](grpc::Status status) {
      c->status = std::move(status);
      c->done.Notify();
    });
    return call;
  }

  // Serves `model` too (e.g. a GQA layer beside the built-in MHA one).
  void AddModel(std::shared_ptr<const server::Model> model) {
    metrics_->AddModel(model->name, model->layer->config());
    const absl::Status added = registry_.Add(std::move(model));
    EXPECT_TRUE(added.ok()) << added;
  }

  server::AttentionServiceImpl& service() { return *service_; }
  v1::AttentionService::Stub& stub() { return *stub_; }
  // The Open Inference Protocol's service on the same server and service.
  inference::GRPCInferenceService::Stub& oip_stub() { return *oip_stub_; }
  const server::ModelRegistry& registry() const { return registry_; }

 private:
  server::ModelRegistry registry_;
  std::unique_ptr<server::ComputeExecutor> executor_;
  std::unique_ptr<server::Metrics> metrics_;
  std::unique_ptr<server::SessionManager> sessions_;
  std::unique_ptr<server::AttentionServiceImpl> service_;
  std::unique_ptr<server::OpenInferenceService> open_inference_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> oip_stub_;
  std::shared_ptr<absl::Notification> release_;  // of the last Block()
  int port_ = 0;
};

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_API_BLOCKABLE_SERVER_H_
