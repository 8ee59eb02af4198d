// AttentionServiceImpl's decode-session RPCs: OpenSession, Extend,
// GetSession, ForkSession, TruncateSession, CloseSession, GetLatestAttention. The sessions
// themselves are SessionManager's (server/sessions/); Extend's steps are
// planned and run by server/api/extend_runner.h.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/api/attention_service.h"
#include "server/api/extend_runner.h"
#include "server/api/observed_reactor.h"
#include "server/api/proto_time.h"
#include "server/api/status_util.h"
#include "server/api/tensor_codec.h"

namespace attnserve::server {
namespace {

void ToProto(const SessionInfo& info, v1::Session* session) {
  session->set_session_id(info.id);
  for (const std::string& model : info.models) session->add_models(model);
  for (int64_t length : info.layer_lengths) session->add_layer_lengths(length);
  session->set_kv_dtype(info.kv_precision == core::KvPrecision::kBf16 ? v1::DATA_TYPE_BF16
                                                                      : v1::DATA_TYPE_FP32);
  session->set_max_tokens(info.max_tokens);
  SetDuration(info.idle_ttl, session->mutable_idle_ttl());
  session->set_first_position(info.first_position);
  session->set_kv_blocks(info.kv_blocks);
  session->set_kv_bytes(info.kv_bytes);
  const int64_t micros = absl::ToUnixMicros(info.last_used);
  session->mutable_last_used()->set_seconds(micros / 1000000);
  session->mutable_last_used()->set_nanos(static_cast<int32_t>(micros % 1000000) * 1000);
}

// Finishes `reactor` with `info` in `response`, or with its error.
void FinishWithSession(const absl::StatusOr<SessionInfo>& info, v1::Session* response,
                       ObservedReactor& reactor) {
  if (info.ok()) ToProto(*info, response);
  reactor.FinishCall(ToGrpcStatus(info.status()));
}

// `values` as an FP32 tensor of `shape` (raw little-endian bytes).
void SetFloats(const std::vector<float>& values, std::initializer_list<int64_t> shape,
               v1::Tensor* tensor) {
  tensor->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t dim : shape) tensor->add_shape(dim);
  tensor->set_raw_data(std::string(reinterpret_cast<const char*>(values.data()),
                                   values.size() * sizeof(float)));
}

// Room a response leaves its framing and small fields under
// --max_send_message_bytes.
constexpr int64_t kResponseFramingBytes = int64_t{64} << 10;

}  // namespace

// An admitted Extend call (or ExtendStream message) waiting in the scheduler,
// then running in a batch with the Extend calls queued with it (one round
// each; a prefill longer than --prefill_chunk_tokens goes back into the
// queue after each round, holding its leases, until its last chunk ran).
//
// Why a prefill goes back into the queue rather than the scheduler filling
// each batch with decode steps first and a prefill's chunk after: the queue
// stays the one place that orders work (FIFO, deadlines, cancellation, the
// drain's sweep, the in-flight budget), a chunked call needs no state in the
// scheduler, and the effect is the same: after each chunk the decode steps
// that arrived meanwhile are ahead of it, and since they share its batch key
// the next batch holds them and the prefill's next chunk (within
// --max_batch_tokens), so a decode step waits for at most the chunk that was
// running when it arrived.
struct AttentionServiceImpl::ExtendJob final : ScheduledWork {
  ExtendJob(AttentionServiceImpl* service, grpc::CallbackServerContext* context,
            const v1::ExtendRequest* request, v1::ExtendResponse* response,
            CallObserver* observer, std::function<void(absl::Status)> done, absl::Time arrival,
            ExtendPlan plan)
      : service(service),
        context(context),
        request(request),
        response(response),
        observer(observer),
        done(std::move(done)),
        arrival(arrival),
        plan(std::move(plan)) {
    batch_key = kExtendBatchKey;
    tokens = RoundTokens(this->plan);  // its first round's
    memory_bytes = this->plan.memory_bytes;
    deadline = DeadlineOf(*context);
  }

  bool IsCancelled() const override { return context->IsCancelled() || CutShort(); }
  bool CutShort() const { return service->cut_short_.load(std::memory_order_relaxed); }
  bool ShouldStop() const { return absl::Now() >= deadline || IsCancelled(); }
  void Skip(absl::Status status) override {
    if (rounds == 0) observer->Dequeued(absl::Now() - enqueued);
    service->metrics_->OnSkipped(absl::IsDeadlineExceeded(status)
                                     ? Metrics::SkipReason::kDeadline
                                     : Metrics::SkipReason::kCancelled);
    Finish(status);
  }
  // Answers with `status` (the response filled when OK); the plan's steps
  // that have not ended end as failed, their layers as before the call
  // (EndExtend undoes the chunks of a prefill stopped between them). A call
  // the drain stopped answers UNAVAILABLE, as Attend's do: clients retry it.
  void Finish(absl::Status status) {
    EndExtend(plan, absl::CancelledError("the step was stopped before it finished"),
              *service->sessions_);
    if (absl::IsCancelled(status) && absl::Now() >= deadline) {
      status = absl::DeadlineExceededError("the deadline passed before or during compute");
    } else if (absl::IsCancelled(status) && CutShort() && !context->IsCancelled()) {
      status = absl::UnavailableError(
          "the server is shutting down: the call was stopped before it finished; retry");
    }
    if (!status.ok()) response->Clear();
    done(std::move(status));
  }

  AttentionServiceImpl* const service;
  grpc::CallbackServerContext* const context;
  const v1::ExtendRequest* const request;
  v1::ExtendResponse* const response;
  CallObserver* const observer;  // the call's
  const std::function<void(absl::Status)> done;
  const absl::Time arrival;
  ExtendPlan plan;
  // Across its rounds: how many ran, when the first started, their compute.
  int rounds = 0;
  absl::Time first_start;
  absl::Duration compute;
};

bool AttentionServiceImpl::IsExtendJob(const ScheduledWork& work) {
  return dynamic_cast<const ExtendJob*>(&work) != nullptr;
}

void AttentionServiceImpl::RunExtendBatch(std::vector<std::unique_ptr<ScheduledWork>> batch) {
  const absl::Time start = absl::Now();
  std::vector<ExtendJob*> jobs;
  std::vector<ExtendMember> members;
  for (const auto& work : batch) {
    auto* job = static_cast<ExtendJob*>(work.get());
    if (job->rounds++ == 0) {
      job->observer->Dequeued(start - job->enqueued);
      job->first_start = start;
    }
    jobs.push_back(job);
    ExtendMember& member = members.emplace_back();
    member.request = job->request;
    member.plan = &job->plan;
    member.response = job->response;
    member.should_stop = [job] { return job->ShouldStop(); };
  }
  absl::StatusOr<core::Workspace*> workspace = ComputeWorkspace();
  std::vector<ExtendComputed> computed;
  if (workspace.ok()) {
    ComputeContext context;
    context.block_kernels = options_.block_kernels;
    context.workspace = *workspace;
    RunExtendRound(absl::MakeSpan(members), *sessions_, context, &computed);
  } else {
    for (ExtendMember& member : members) member.status = workspace.status();
  }
  KeepComputeMemory();
  const absl::Duration compute = absl::Now() - start;
  // What the batch computed: its members that computed tokens in it.
  int32_t batch_size = 0;
  int64_t batch_tokens = 0;
  for (const ExtendMember& member : members) {
    if (member.tokens == 0) continue;
    ++batch_size;
    batch_tokens += member.tokens;
  }
  for (const ExtendComputed& part : computed) {
    const std::string model = metrics_->ModelLabel(part.model);
    metrics_->OnComputed(model, part.kernel_path,
                         {.duration = part.duration, .tokens = part.tokens,
                          .attention_map_bytes = 0});
    metrics_->OnDecodeBatch(model, part.tokens, part.kv_read_bytes);
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    ExtendJob& job = *jobs[i];
    job.compute += compute;
    // A prefill's next chunk: back into the queue. A member that failed as a
    // whole (no workspace) is answered now (Finish ends its steps).
    if (!members[i].finished && members[i].status.ok()) {
      job.tokens = RoundTokens(job.plan);
      scheduler_->Requeue(std::move(batch[i]));
      continue;
    }
    if (members[i].status.ok()) {
      v1::Timing* timing = job.response->mutable_timing();
      SetDuration(job.first_start - job.arrival, timing->mutable_queue());
      SetDuration(job.compute, timing->mutable_compute());
      timing->set_batch_size(batch_size);
      timing->set_batch_tokens(batch_tokens);
      job.observer->set_compute(job.compute);
    }
    job.Finish(members[i].status);
  }
}

absl::StatusOr<std::string> AttentionServiceImpl::SessionOwner(
    const grpc::CallbackServerContext& context) const {
  absl::StatusOr<Principal> caller = Authenticate(context);
  if (!caller.ok()) return caller.status();
  if (sessions_ == nullptr) {
    return absl::FailedPreconditionError("this server has no decode sessions");
  }
  return caller->id;
}

std::optional<std::string> AttentionServiceImpl::BeginSessionCall(
    grpc::CallbackServerContext& context, ObservedReactor& reactor) {
  absl::StatusOr<std::string> owner = SessionOwner(context);
  if (!owner.ok()) {
    reactor.FinishCall(ToGrpcStatus(owner.status()));
    return std::nullopt;
  }
  if (absl::Status admitted = BeginCall(); !admitted.ok()) {
    reactor.FinishCall(ToGrpcStatus(admitted));
    return std::nullopt;
  }
  return *std::move(owner);
}

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(
    grpc::CallbackServerContext* context, const v1::OpenSessionRequest* request,
    v1::Session* response) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kOpenSession, "", metrics_, options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  const absl::StatusOr<SessionInfo> opened = [&]() -> absl::StatusOr<SessionInfo> {
    SessionSpec spec;
    for (int i = 0; i < request->models_size(); ++i) {
      // A folder of layers stands for its layers' models, in order.
      absl::StatusOr<std::vector<std::shared_ptr<const Model>>> models =
          registry_->FindLayers(request->models(i));
      if (!models.ok()) {
        return absl::Status(models.status().code(),
                            absl::StrCat("models[", i, "]: ", models.status().message()));
      }
      // Bounded as it grows: a long list of folder names cannot hold much.
      if (spec.layers.size() + models->size() > kMaxSessionLayers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "models: more than ", kMaxSessionLayers,
            " layers (a folder of layers counts each of its layers)"));
      }
      for (std::shared_ptr<const Model>& model : *models) spec.layers.push_back(std::move(model));
    }
    switch (request->kv_dtype()) {
      case v1::DATA_TYPE_UNSPECIFIED:
      case v1::DATA_TYPE_FP32:
        spec.kv_precision = core::KvPrecision::kFp32;
        break;
      case v1::DATA_TYPE_BF16:
        spec.kv_precision = core::KvPrecision::kBf16;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "kv_dtype: must be FP32 or BF16, got ", DataTypeName(request->kv_dtype())));
    }
    spec.max_tokens = request->max_tokens();
    spec.idle_ttl = FromProto(request->idle_ttl());
    spec.first_position = request->first_position();
    return sessions_->Open(spec, *owner);
  }();
  FinishWithSession(opened, response, *reactor);
  EndCall();
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetSession(grpc::CallbackServerContext* context,
                                                           const v1::GetSessionRequest* request,
                                                           v1::Session* response) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kGetSession, "", metrics_, options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  FinishWithSession(sessions_->Get(request->session_id(), *owner), response, *reactor);
  EndCall();
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ForkSession(
    grpc::CallbackServerContext* context, const v1::ForkSessionRequest* request,
    v1::Session* response) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kForkSession, "", metrics_, options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  FinishWithSession(sessions_->Fork(request->session_id(), *owner), response, *reactor);
  EndCall();
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::TruncateSession(
    grpc::CallbackServerContext* context, const v1::TruncateSessionRequest* request,
    v1::Session* response) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kTruncateSession, "", metrics_, options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  FinishWithSession(sessions_->Truncate(request->session_id(), *owner,
                                        request->all_layers() ? -1 : request->layer(),
                                        request->length()),
                    response, *reactor);
  EndCall();
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(
    grpc::CallbackServerContext* context, const v1::CloseSessionRequest* request,
    v1::CloseSessionResponse* /*response*/) {
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kCloseSession, "", metrics_, options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  reactor->FinishCall(ToGrpcStatus(sessions_->Close(request->session_id(), *owner)));
  EndCall();
  return reactor;
}

// An admitted GetLatestAttention call waiting in the scheduler with its
// layer's snapshot, then reading it alone on the compute executor.
struct AttentionServiceImpl::LatestAttentionJob final : ScheduledWork {
  LatestAttentionJob(AttentionServiceImpl* service, grpc::CallbackServerContext* context,
                     const v1::LatestAttentionRequest* request, v1::LatestAttention* response,
                     ObservedReactor* reactor, LatestSnapshot snapshot)
      : service(service),
        context(context),
        request(request),
        response(response),
        reactor(reactor),
        snapshot(std::move(snapshot)) {
    tokens = 1;  // one query row
    // The maps as computed, and their copy in the response.
    memory_bytes = 2 * this->snapshot.map_bytes;
    deadline = DeadlineOf(*context);
  }

  bool IsCancelled() const override {
    return context->IsCancelled() || service->cut_short_.load(std::memory_order_relaxed);
  }
  void Skip(absl::Status status) override {
    reactor->observer().Dequeued(absl::Now() - enqueued);
    service->metrics_->OnSkipped(absl::IsDeadlineExceeded(status)
                                     ? Metrics::SkipReason::kDeadline
                                     : Metrics::SkipReason::kCancelled);
    Finish(std::move(status));
  }
  // Answers with `status` (the response filled when OK); the snapshot's
  // blocks go back first, and leave its owner's quota.
  void Finish(absl::Status status) {
    snapshot.Release();
    if (!status.ok()) response->Clear();
    reactor->FinishCall(ToGrpcStatus(status));
    service->EndCall();
  }

  AttentionServiceImpl* const service;
  grpc::CallbackServerContext* const context;
  const v1::LatestAttentionRequest* const request;
  v1::LatestAttention* const response;
  ObservedReactor* const reactor;
  LatestSnapshot snapshot;
};

bool AttentionServiceImpl::IsLatestAttentionJob(const ScheduledWork& work) {
  return dynamic_cast<const LatestAttentionJob*>(&work) != nullptr;
}

void AttentionServiceImpl::RunLatestAttentionJob(std::unique_ptr<ScheduledWork> work) {
  auto& job = static_cast<LatestAttentionJob&>(*work);
  const absl::Time start = absl::Now();
  job.reactor->observer().Dequeued(start - job.enqueued);
  const absl::StatusOr<LatestAttentionRead> read = SessionManager::ReadLatest(job.snapshot);
  if (read.ok()) {
    v1::LatestAttention* response = job.response;
    response->set_session_id(job.request->session_id());
    response->set_layer(job.request->layer());
    response->set_length(read->length);
    response->set_position(read->position);
    SetFloats(read->maps, {read->num_heads, read->length}, response->mutable_maps());
    v1::HeadStatistics* stats = response->mutable_head_statistics();
    SetFloats(read->entropy, {read->num_heads}, stats->mutable_entropy());
    SetFloats(read->max_weight, {read->num_heads}, stats->mutable_max_weight());
    job.reactor->observer().set_compute(absl::Now() - start);
  }
  job.Finish(read.status());
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetLatestAttention(
    grpc::CallbackServerContext* context, const v1::LatestAttentionRequest* request,
    v1::LatestAttention* response) {
  NoteArrival();
  auto* reactor = new ObservedReactor(context, RpcMethod::kGetLatestAttention, "", metrics_,
                                      options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  // A --max_send_message_bytes below the framing leaves no room: every read
  // is then refused, naming both flags.
  const int64_t max_map_bytes =
      std::max<int64_t>(0, std::min(options_.limits.max_attention_map_bytes,
                                    options_.max_send_message_bytes - kResponseFramingBytes));
  absl::StatusOr<LatestSnapshot> snapshot =
      sessions_->SnapshotLatest(request->session_id(), *owner, request->layer(), max_map_bytes,
                                "--max_attention_map_bytes, --max_send_message_bytes");
  if (!snapshot.ok()) {
    reactor->FinishCall(ToGrpcStatus(snapshot.status()));
    EndCall();
    return reactor;
  }
  metrics_->OnQueued();
  absl::Status submitted = scheduler_->Submit(std::make_unique<LatestAttentionJob>(
      this, context, request, response, reactor, *std::move(snapshot)));
  if (!submitted.ok()) {  // the refused job was destroyed in Submit, unanswered
    metrics_->OnQueueRefused();
    reactor->FinishCall(ToGrpcStatus(submitted));
    EndCall();
  }
  return reactor;
}

void AttentionServiceImpl::SubmitExtend(RpcMethod method, grpc::CallbackServerContext* context,
                                        const std::string& owner,
                                        const v1::ExtendRequest* request,
                                        v1::ExtendResponse* response, CallObserver* observer,
                                        std::function<void(absl::Status)> answer) {
  const absl::Time arrival = absl::Now();
  // The decode step's latency, of those answered OK.
  auto done = [this, method, arrival, answer = std::move(answer)](absl::Status status) {
    if (status.ok()) metrics_->OnDecodeStep(method, absl::Now() - arrival);
    answer(std::move(status));
  };
  absl::StatusOr<ExtendPlan> plan =
      PlanExtend(*request, *sessions_, owner, options_.limits, options_.max_send_message_bytes,
                 std::min(options_.prefill_chunk_tokens, options_.limits.max_seq_len));
  if (!plan.ok()) {
    done(plan.status());
    return;
  }
  if (plan->tokens == 0) {  // nothing to compute: refusals and replays only
    done(RunExtend(*request, *plan, *sessions_, {}, response));
    return;
  }
  metrics_->OnQueued();
  // The job takes a copy of `done`: a refused job is destroyed in Submit.
  absl::Status submitted = scheduler_->Submit(std::make_unique<ExtendJob>(
      this, context, request, response, observer, std::function<void(absl::Status)>(done),
      arrival, *std::move(plan)));
  if (!submitted.ok()) {
    metrics_->OnQueueRefused();
    done(std::move(submitted));
  }
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Extend(grpc::CallbackServerContext* context,
                                                       const v1::ExtendRequest* request,
                                                       v1::ExtendResponse* response) {
  NoteArrival();
  auto* reactor =
      new ObservedReactor(context, RpcMethod::kExtend, "", metrics_, options_.access_log);
  const std::optional<std::string> owner = BeginSessionCall(*context, *reactor);
  if (!owner) return reactor;
  SubmitExtend(RpcMethod::kExtend, context, *owner, request, response, &reactor->observer(),
               [this, reactor](absl::Status status) {
                 reactor->FinishCall(ToGrpcStatus(status));
                 EndCall();
               });
  return reactor;
}

grpc::ServerBidiReactor<v1::ExtendRequest, v1::ExtendResponse>*
AttentionServiceImpl::ExtendStream(grpc::CallbackServerContext* context) {
  NoteArrival();
  auto* reactor = new ExtendStreamReactor(context, metrics_, options_.access_log);
  absl::StatusOr<std::string> owner = SessionOwner(*context);
  if (!owner.ok()) {
    reactor->Refuse(ToGrpcStatus(owner.status()));
    return reactor;
  }
  absl::Status serving;
  {
    absl::MutexLock lock(&mu_);
    serving = ServingLocked();
    if (serving.ok()) streams_.insert(reactor);  // before a drain can look for it
  }
  if (!serving.ok()) {
    reactor->Refuse(ToGrpcStatus(serving));
    return reactor;
  }
  reactor->Start(
      [this, context, owner = *std::move(owner)](const v1::ExtendRequest& request,
                                                 v1::ExtendResponse* response,
                                                 CallObserver& observer,
                                                 std::function<void(absl::Status)> done) {
        NoteArrival();
        if (absl::Status admitted = BeginCall(); !admitted.ok()) {
          done(std::move(admitted));
          return;
        }
        SubmitExtend(RpcMethod::kExtendStream, context, owner, &request, response, &observer,
                     [this, done = std::move(done)](absl::Status status) {
                       done(std::move(status));
                       EndCall();
                     });
      },
      [this, reactor] {
        absl::MutexLock lock(&mu_);
        streams_.erase(reactor);
      });
  return reactor;
}

}  // namespace attnserve::server
