#include "server/api/attention_service.h"

#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status_macros.h"
#include "server/api/attend_plan.h"
#include "server/api/attend_runner.h"
#include "server/api/map_stream.h"
#include "server/api/map_stream_reactor.h"
#include "server/api/model_info.h"
#include "server/api/observed_reactor.h"
#include "server/api/proto_time.h"
#include "server/api/request_bytes.h"
#include "server/api/status_util.h"
#include "server/api/tensor_codec.h"
#include "server/api/wire_response.h"
#include "server/observability/access_log.h"
#include "server/scheduling/scheduler.h"

namespace attnserve::server {
namespace {

// Reports a successful compute of a request of `tokens` query tokens: the
// batch's compute time and the map bytes in `response`.
void ObserveCompute(int64_t tokens, const WireResponse& response, absl::Duration compute,
                    CallObserver& observer, Metrics& metrics) {
  metrics.OnComputed(observer.model_label(), response.message.kernel_path(),
                     {.duration = compute,
                      .tokens = tokens,
                      .attention_map_bytes = response.attention_map_bytes()});
  observer.set_compute(compute);
}

// One Attend call's messages, alive until the call is finished.
struct AttendCall {
  v1::AttendRequest request;
  WireResponse response;
};

int64_t QueryTokens(const AttendPlan& plan) {
  int64_t tokens = 0;
  for (int64_t b = 0; b < plan.queries.batch(); ++b) tokens += plan.queries.length(b);
  return tokens;
}

}  // namespace

// An admitted Attend or AttendStream call waiting in the scheduler, then
// running.
struct AttentionServiceImpl::AttendJob final : ScheduledWork {
  AttendJob(AttentionServiceImpl* service, grpc::CallbackServerContext* context,
            std::shared_ptr<AttendCall> call, CallObserver* observer, Deliver deliver,
            absl::Time arrival, AttendPlan plan)
      : service(service),
        context(context),
        call(std::move(call)),
        observer(observer),
        deliver(std::move(deliver)),
        arrival(arrival),
        plan(std::move(plan)) {
    batch_key = BatchKey(this->plan);
    tokens = QueryTokens(this->plan);
    memory_bytes = this->plan.memory_bytes;
    deadline = DeadlineOf(*context);
  }

  bool IsCancelled() const override { return context->IsCancelled() || CutShort(); }
  bool CutShort() const { return service->cut_short_.load(std::memory_order_relaxed); }
  void Skip(absl::Status status) override {
    observer->Dequeued(absl::Now() - enqueued);
    service->metrics_->OnSkipped(absl::IsDeadlineExceeded(status)
                                     ? Metrics::SkipReason::kDeadline
                                     : Metrics::SkipReason::kCancelled);
    Finish(status, /*ran=*/false);  // the scheduler releases all its memory
  }
  // Delivers the response (status OK) or `status`; `ran`: it went through
  // compute, so what it keeps after (memory_kept_after_run) is its to
  // release. A call the drain stopped answers UNAVAILABLE, as a call refused
  // during the drain does: the client's retry policy sends it elsewhere.
  void Finish(absl::Status status, bool ran) {
    if (absl::IsCancelled(status) && CutShort() && !context->IsCancelled()) {
      status = absl::UnavailableError(
          "the server is shutting down: the call was stopped before it finished; retry on another "
          "replica");
    }
    deliver(std::move(status), call->response, ran ? memory_kept_after_run : 0);
  }

  AttentionServiceImpl* const service;
  grpc::CallbackServerContext* const context;
  const std::shared_ptr<AttendCall> call;
  CallObserver* const observer;  // the reactor's
  const Deliver deliver;
  const absl::Time arrival;
  const AttendPlan plan;
};

absl::StatusOr<core::Workspace*> AttentionServiceImpl::ComputeWorkspace() {
  if (workspace_ == nullptr) {
    absl::StatusOr<std::unique_ptr<core::Workspace>> workspace = core::Workspace::Create();
    if (!workspace.ok()) return workspace.status();
    workspace_ = *std::move(workspace);
  }
  return workspace_.get();
}

void AttentionServiceImpl::RunBatch(std::vector<std::unique_ptr<ScheduledWork>> batch,
                                    const BatchInfo& /*info: the timing reports what computed*/) {
  if (IsExtendJob(*batch.front())) {  // Extend calls only (kExtendBatchKey)
    RunExtendBatch(std::move(batch));
    return;
  }
  if (IsLatestAttentionJob(*batch.front())) {  // alone too (batch_key 0)
    RunLatestAttentionJob(std::move(batch.front()));
    return;
  }
  const absl::Time start = absl::Now();
  std::vector<AttendJob*> jobs;
  for (const auto& work : batch) {
    auto* job = static_cast<AttendJob*>(work.get());
    job->observer->Dequeued(start - job->enqueued);
    jobs.push_back(job);
  }
  // The compute stops before a stage (CANCELLED) only when no request of
  // the batch still wants it.
  auto should_stop = [&jobs] {
    const absl::Time now = absl::Now();
    for (const AttendJob* job : jobs) {
      if (now < job->deadline && !job->IsCancelled()) return false;
    }
    return true;
  };
  std::vector<absl::Status> statuses(jobs.size());
  const absl::Status workspace_status = ComputeWorkspace().status();
  const ComputeContext context{workspace_.get(), options_.block_kernels, should_stop};
  if (!workspace_status.ok()) {
    std::fill(statuses.begin(), statuses.end(), workspace_status);
  } else if (jobs.size() == 1) {
    AttendJob& job = *jobs[0];
    statuses[0] =
        RunAttendPlan(job.call->request, job.plan, layer_cache_, context, &job.call->response)
            .status();
  } else {
    std::vector<BatchMember> members(jobs.size());
    for (size_t i = 0; i < jobs.size(); ++i) {
      members[i].request = &jobs[i]->call->request;
      members[i].plan = &jobs[i]->plan;
      members[i].response = &jobs[i]->call->response;
    }
    RunAttendBatch(absl::MakeSpan(members), layer_cache_, context);
    for (size_t i = 0; i < jobs.size(); ++i) statuses[i] = std::move(members[i].status);
  }
  KeepComputeMemory();
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < jobs.size(); ++i) {
    // Past its deadline the client has given up: count it as it saw it.
    if ((statuses[i].ok() || absl::IsCancelled(statuses[i])) && now >= jobs[i]->deadline) {
      statuses[i] = absl::DeadlineExceededError("the deadline passed before or during compute");
    }
    if (!statuses[i].ok()) jobs[i]->call->response.Clear();
  }
  const absl::Duration compute = absl::Now() - start;
  // The requests' tensors are done with: free them now rather than once the
  // responses are sent (a slow reader would hold them), so that the next
  // request reuses their memory.
  for (AttendJob* job : jobs) v1::AttendRequest().Swap(&job->call->request);
  // What the batch computed: its members that succeeded (one refused for a
  // non-finite input, say, did not run with the others).
  int64_t computed_requests = 0, computed_sequences = 0, computed_tokens = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!statuses[i].ok()) continue;
    ++computed_requests;
    computed_sequences += jobs[i]->plan.queries.batch();
    computed_tokens += jobs[i]->tokens;
  }
  if (computed_requests > 0) {
    metrics_->OnBatch(jobs[0]->observer->model_label(), computed_requests, computed_sequences,
                      computed_tokens);
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    AttendJob& job = *jobs[i];
    if (statuses[i].ok()) {
      v1::Timing* timing = job.call->response.message.mutable_timing();
      SetDuration(start - job.arrival, timing->mutable_queue());
      SetDuration(compute, timing->mutable_compute());
      timing->set_batch_size(static_cast<int32_t>(computed_requests));
      timing->set_batch_tokens(computed_tokens);
      ObserveCompute(job.tokens, job.call->response, compute, *job.observer, *metrics_);
    }
    job.Finish(std::move(statuses[i]), /*ran=*/true);
  }
}

AttentionServiceImpl::AttentionServiceImpl(const ServerOptions& options,
                                           const ModelRegistry* registry,
                                           ComputeExecutor* executor, Metrics* metrics,
                                           std::optional<TokenSet> tokens, ModelLoader* loader,
                                           SessionManager* sessions)
    : options_(options),
      registry_(registry),
      executor_(executor),
      metrics_(metrics),
      tokens_(std::move(tokens)),
      loader_(loader),
      sessions_(sessions) {
  // The options were validated (ValidateServerOptions): Create cannot fail.
  scheduler_ = Scheduler::Create(
                   {.queue_capacity = options.max_queued_requests,
                    .max_batch_tokens = options.max_batch_tokens,
                    .max_queue_delay = absl::Microseconds(options.max_queue_delay_us),
                    .max_inflight_bytes = options.max_inflight_bytes},
                   executor,
                   [this](std::vector<std::unique_ptr<ScheduledWork>> batch, const BatchInfo& info) {
                     RunBatch(std::move(batch), info);
                   })
                   .value();
}

absl::Status AttentionServiceImpl::AuthorizeAdmin(
    const grpc::CallbackServerContext& context) const {
  absl::StatusOr<Principal> caller = Authenticate(context);
  if (!caller.ok()) return caller.status();
  if (tokens_.has_value() && !caller->is_admin) {
    return absl::PermissionDeniedError("this RPC needs an admin token");
  }
  return absl::OkStatus();
}

absl::StatusOr<Principal> AttentionServiceImpl::Authenticate(
    const grpc::CallbackServerContext& context) const {
  if (!tokens_.has_value()) return Principal{};
  return tokens_->Authenticate(context.client_metadata());
}

void AttentionServiceImpl::set_state(State state) {
  std::vector<ExtendStreamReactor*> idle_streams;
  {
    absl::MutexLock lock(&mu_);
    state_ = state;
    if (state == State::kDraining) {
      for (ExtendStreamReactor* stream : streams_) {
        if (stream->MarkDrained()) idle_streams.push_back(stream);
      }
    }
  }
  // Outside mu_: finishing may remove the stream from streams_ at once.
  for (ExtendStreamReactor* stream : idle_streams) stream->FinishDrained();
}

absl::Status AttentionServiceImpl::ServingLocked() const {
  switch (state_) {
    case State::kStarting:
      return absl::UnavailableError("the server is starting: models are loading; retry");
    case State::kDraining:
      return absl::UnavailableError("the server is shutting down; retry on another replica");
    case State::kServing:
      break;
  }
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::BeginCall() {
  absl::MutexLock lock(&mu_);
  if (absl::Status serving = ServingLocked(); !serving.ok()) return serving;
  ++in_flight_;
  return absl::OkStatus();
}

void AttentionServiceImpl::NoteArrival() {
  absl::MutexLock lock(&mu_);
  last_arrival_ = absl::Now();
}

void AttentionServiceImpl::EndCall() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
  last_end_ = absl::Now();
}

bool AttentionServiceImpl::WaitForQuiet(absl::Duration quiet, absl::Time deadline) {
  while (true) {
    absl::Time quiet_at;
    {
      absl::MutexLock lock(&mu_);
      quiet_at = last_arrival_ + quiet;
    }
    const absl::Time now = absl::Now();
    if (now >= quiet_at) return true;
    if (now >= deadline) return false;
    absl::SleepFor(std::min(quiet_at, deadline) - now);
  }
}

void AttentionServiceImpl::CutShortCallsInFlight() {
  cut_short_.store(true, std::memory_order_relaxed);
  scheduler_->StopWaiting();  // queued calls are swept now, not after a batching delay
}

absl::Time AttentionServiceImpl::last_activity() const {
  absl::MutexLock lock(&mu_);
  return in_flight_ > 0 ? absl::Now() : std::max(last_arrival_, last_end_);
}

void AttentionServiceImpl::KeepComputeMemory() {
  if (workspace_ != nullptr && workspace_->bytes() > kRetainedWorkspaceBytes) {
    workspace_->Release();
  }
  compute_memory_held_.store(true, std::memory_order_release);  // see ReleaseComputeMemory
}

void AttentionServiceImpl::ReleaseComputeMemory() {
  // Only when there is scratch to give back: a task takes a place in the
  // executor's queue (refused when full or shutting down: then there is no
  // idle to use).
  if (!compute_memory_held_.exchange(false, std::memory_order_acq_rel)) return;
  executor_->Submit([this] {
    if (workspace_ != nullptr) workspace_->Release();
  }).IgnoreError();
}

bool AttentionServiceImpl::WaitForIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

template <class Reactor>
Reactor* AttentionServiceImpl::HandleAttend(
    grpc::CallbackServerContext* context, const ParseAttend& parse, MapDelivery map_delivery,
    const std::function<Reactor*(absl::string_view model)>& make_reactor,
    const std::function<Deliver(Reactor*)>& make_deliver, const ParseAttend& translate) {
  NoteArrival();  // for WaitForQuiet and last_activity()
  if (absl::StatusOr<Principal> caller = Authenticate(*context); !caller.ok()) {
    Reactor* reactor = make_reactor("");
    reactor->FinishCall(ToGrpcStatus(caller.status()));
    return reactor;
  }
  // The request and response live until the call is finished.
  auto call = std::make_shared<AttendCall>();
  const absl::Status parsed = parse(&call->request);
  Reactor* reactor = make_reactor(call->request.model());
  if (!parsed.ok()) {
    reactor->FinishCall(ToGrpcStatus(parsed));
    return reactor;
  }
  const v1::AttendRequest& request = call->request;
  if (reactor->observer().access_log()) reactor->observer().set_shapes(AttendShapes(request));
  const absl::Time arrival = absl::Now();
  if (absl::Status admitted = BeginCall(); !admitted.ok()) {
    reactor->FinishCall(ToGrpcStatus(admitted));
    return reactor;
  }
  if (translate) {
    if (absl::Status translated = translate(&call->request); !translated.ok()) {
      reactor->FinishCall(ToGrpcStatus(translated));
      EndCall();
      return reactor;
    }
    if (reactor->observer().access_log()) reactor->observer().set_shapes(AttendShapes(request));
  }
  absl::StatusOr<AttendPlan> plan =
      PlanAttend(request, *registry_, options_.limits, options_.max_send_message_bytes,
                 options_.block_kernels, map_delivery);
  if (!plan.ok()) {
    reactor->FinishCall(ToGrpcStatus(plan.status()));
    EndCall();
    return reactor;
  }
  const int64_t kept = map_delivery == MapDelivery::kStreamed
                           ? std::min(plan->memory_bytes,
                                      plan->map_elements * DataTypeSize(plan->output_dtype))
                           : 0;
  metrics_->OnQueued();
  auto job = std::make_unique<AttendJob>(this, context, std::move(call), &reactor->observer(),
                                         make_deliver(reactor), arrival, *std::move(plan));
  job->memory_kept_after_run = kept;
  absl::Status submitted = scheduler_->Submit(std::move(job));
  if (!submitted.ok()) {
    metrics_->OnQueueRefused();
    reactor->FinishCall(ToGrpcStatus(submitted));
    EndCall();
  }
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::HandleUnaryAttend(
    grpc::CallbackServerContext* context, RpcMethod method, ParseAttend parse, WriteAttend write,
    ParseAttend translate) {
  return HandleAttend<ObservedReactor>(
      context, parse, MapDelivery::kInResponse,
      [&](absl::string_view model) {
        return new ObservedReactor(context, method, model, metrics_, options_.access_log);
      },
      [this, &write](ObservedReactor* reactor) -> Deliver {
        return [this, reactor, write = std::move(write)](
                   absl::Status status, WireResponse& response, int64_t /*kept: none*/) {
          if (status.ok()) status = write(response);
          reactor->FinishCall(ToGrpcStatus(status));
          EndCall();
        };
      },
      translate);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request_bytes,
                                                       grpc::ByteBuffer* response_bytes) {
  return HandleUnaryAttend(
      context, RpcMethod::kAttend,
      [context, request_bytes](v1::AttendRequest* request) {
        return ParseRequestBytes(*context, request_bytes, "attnserve.v1.AttendRequest", request);
      },
      [response_bytes](WireResponse& response) { return response.SerializeTo(response_bytes); });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request_bytes) {
  // Each chunk's values leave room for its framing under the message limit.
  const int64_t chunk_bytes = std::max<int64_t>(
      1, std::min(kMapChunkBytes, options_.max_send_message_bytes - int64_t{4096}));
  return HandleAttend<MapStreamReactor>(
      context,
      [context, request_bytes](v1::AttendRequest* request) {
        return ParseRequestBytes(*context, request_bytes, "attnserve.v1.AttendRequest", request);
      },
      MapDelivery::kStreamed,
      [&](absl::string_view model) {
        return new MapStreamReactor(context, model, metrics_, options_.access_log);
      },
      [this, chunk_bytes](MapStreamReactor* reactor) -> Deliver {
        return [this, reactor, chunk_bytes](absl::Status status, WireResponse& response,
                                            int64_t kept) {
          // The maps' buffer stays reserved from the in-flight budget until
          // the last chunk is sent (memory_kept_after_run).
          if (!status.ok()) {
            scheduler_->ReleaseKept(kept);
            reactor->FinishCall(ToGrpcStatus(status));
            EndCall();
            return;
          }
          // The call stays in flight (a drain waits for it) until its last
          // chunk is sent.
          reactor->Send(std::make_unique<MapStream>(std::move(response), chunk_bytes),
                        [this, kept] {
                          scheduler_->ReleaseKept(kept);
                          EndCall();
                        });
        };
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const v1::ListModelsRequest* /*request*/,
                                                           v1::ListModelsResponse* response) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kListModels, "", metrics_, options_.access_log);
  if (absl::StatusOr<Principal> caller = Authenticate(*context); !caller.ok()) {
    reactor->FinishCall(ToGrpcStatus(caller.status()));
    return reactor;
  }
  for (const ModelStatus& status : registry_->List()) {
    FillModelStatus(status, options_.limits, response->add_models());
  }
  reactor->FinishCall(grpc::Status::OK);
  return reactor;
}

ObservedReactor* AttentionServiceImpl::NewObservedReactor(grpc::CallbackServerContext* context,
                                                         RpcMethod method,
                                                         absl::string_view model) {
  return new ObservedReactor(context, method, model, metrics_, options_.access_log);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const v1::GetModelRequest* request,
                                                         v1::ModelInfo* response) {
  if (absl::StatusOr<Principal> caller = Authenticate(*context); !caller.ok()) {
    auto* reactor =
        new ObservedReactor(context, RpcMethod::kGetModel, "", metrics_, options_.access_log);
    reactor->FinishCall(ToGrpcStatus(caller.status()));
    return reactor;
  }
  auto* reactor = new ObservedReactor(context, RpcMethod::kGetModel, request->name(), metrics_,
                                      options_.access_log);
  if (request->name().empty()) {
    reactor->FinishCall(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "name: required"));
    return reactor;
  }
  absl::StatusOr<ModelStatus> model = registry_->Get(request->name());
  if (!model.ok()) {
    reactor->FinishCall(ToGrpcStatus(
        absl::Status(model.status().code(), absl::StrCat("name: ", model.status().message()))));
    return reactor;
  }
  FillModelStatus(*model, options_.limits, response);
  reactor->FinishCall(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::LoadModel(grpc::CallbackServerContext* context,
                                                          const v1::LoadModelRequest* request,
                                                          v1::LoadModelResponse* response) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kLoadModel, "", metrics_, options_.access_log);
  if (absl::Status allowed = AuthorizeAdmin(*context); !allowed.ok()) {
    reactor->FinishCall(ToGrpcStatus(allowed));
    return reactor;
  }
  if (loader_ == nullptr) {
    reactor->FinishCall(ToGrpcStatus(absl::FailedPreconditionError(
        "the server has no model repository (start it with --model_repository)")));
    return reactor;
  }
  // The reactor and response outlive this handler: the loader thread finishes
  // the call when the load is over.
  const RequestLimits limits = options_.limits;
  absl::Status queued = loader_->Load(
      request->name(), [reactor, response, limits](absl::StatusOr<ModelLoader::Loaded> loaded) {
        if (loaded.ok()) {
          // One model named as the folder, or the folder's layers.
          if (!loaded->layered && loaded->models.size() == 1) {
            FillModelStatus(loaded->models[0], limits, response->mutable_model());
          } else {
            for (const ModelStatus& layer : loaded->models) {
              FillModelStatus(layer, limits, response->add_layers());
            }
          }
        }
        reactor->FinishCall(ToGrpcStatus(loaded.status()));
      });
  if (!queued.ok()) {
    reactor->FinishCall(ToGrpcStatus(queued));
  }
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::UnloadModel(grpc::CallbackServerContext* context,
                                                            const v1::UnloadModelRequest* request,
                                                            v1::UnloadModelResponse* /*response*/) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kUnloadModel, "", metrics_, options_.access_log);
  if (absl::Status allowed = AuthorizeAdmin(*context); !allowed.ok()) {
    reactor->FinishCall(ToGrpcStatus(allowed));
    return reactor;
  }
  if (request->name().empty()) {
    reactor->FinishCall(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "name: required"));
    return reactor;
  }
  absl::Status unloaded = loader_ != nullptr ? loader_->Unload(request->name())
                                             : registry_->Get(request->name()).status();
  if (loader_ == nullptr && unloaded.ok()) {
    unloaded = absl::FailedPreconditionError(
        "the built-in model cannot be unloaded (the server has no --model_repository)");
  }
  reactor->FinishCall(ToGrpcStatus(
      unloaded.ok() ? unloaded
                    : absl::Status(unloaded.code(), absl::StrCat("name: ", unloaded.message()))));
  return reactor;
}

}  // namespace attnserve::server
