#ifndef ATTNSERVE_SERVER_API_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_API_ATTENTION_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/api/attend_plan.h"
#include "server/api/call_observer.h"
#include "server/api/extend_stream_reactor.h"
#include "server/api/observed_reactor.h"
#include "server/api/wire_response.h"
#include "server/common/server_options.h"
#include "server/models/layer_cache.h"
#include "server/models/model_loader.h"
#include "server/models/model_registry.h"
#include "server/observability/metrics.h"
#include "server/scheduling/compute_executor.h"
#include "server/scheduling/scheduler.h"
#include "server/security/auth.h"
#include "server/sessions/session_manager.h"

namespace attnserve::server {

// attnserve.v1.AttentionService on the gRPC callback API. Handlers validate,
// convert and submit to the Scheduler, which batches compatible requests
// (BatchKey) and runs them on the compute executor; the executor runs the
// layer and finishes the calls. No attention math runs on a gRPC thread.
//
// Every call is reported to Metrics (and, with options.access_log, to the
// access log) when it arrives and when it finishes.
//
// Attend takes the request as bytes and parses it itself, so that bytes that
// are not an AttendRequest get INVALID_ARGUMENT naming the request (gRPC's
// generated handler would answer UNIMPLEMENTED with no message).
//
// With `tokens`, every call is authenticated first (before the request is
// parsed, validated or anything is allocated for it): UNAUTHENTICATED without
// a valid "authorization: Bearer <token>". Without it, calls are open.
//
// Thread-safe. `registry`, `executor`, `metrics` and `loader` (when given)
// must outlive the service,
// and the executor must be shut down (running what its scheduler queued)
// before the service is destroyed.
// Workspace memory kept from one batch to the next (the small routes of
// serving traffic reuse it without allocating; larger routes' buffers are
// freed after their batch).
inline constexpr int64_t kRetainedWorkspaceBytes = int64_t{64} << 20;

class AttentionServiceImpl final
    : public v1::AttentionService::WithRawCallbackMethod_Attend<
          v1::AttentionService::WithRawCallbackMethod_AttendStream<
              v1::AttentionService::CallbackService>> {
 public:
  enum class State { kStarting, kServing, kDraining };

  AttentionServiceImpl(const ServerOptions& options, const ModelRegistry* registry,
                       ComputeExecutor* executor, Metrics* metrics,
                       std::optional<TokenSet> tokens = std::nullopt,
                       ModelLoader* loader = nullptr, SessionManager* sessions = nullptr);

  // Attend answers UNAVAILABLE unless the state is kServing. Entering
  // kDraining drains the open ExtendStream calls: an idle one ends
  // UNAVAILABLE at once, one running a message once it is answered.
  void set_state(State state);

  // Waits until no admitted Attend call is unfinished, or until `deadline`.
  // True when idle.
  bool WaitForIdle(absl::Time deadline);

  // Waits until no Attend call has reached the handler (admitted or refused,
  // valid or not) for `quiet`, or until `deadline`. True when quiet. A
  // heuristic for "clients have moved away": a call whose request is still
  // being uploaded has not reached the handler yet.
  bool WaitForQuiet(absl::Duration quiet, absl::Time deadline);
  // When Attend calls were last active: now while one is in flight, else when
  // the last one finished or reached the handler (InfinitePast before the
  // first).
  absl::Time last_activity() const;
  // Gives back the compute memory kept for the next batch (the workspace's
  // scratch buffers; the primitives stay), on the compute executor after what
  // it has queued. For an idle server (AllocatorCacheOptions::on_idle): the
  // next call allocates afresh. Does nothing when no batch ran since the last
  // release, or when the executor is full or shutting down (then it is not
  // idle).
  void ReleaseComputeMemory();

  // The end of a drain: admitted calls still queued or computing stop (before
  // their next compute stage) and answer UNAVAILABLE, which clients retry on
  // another replica. Irreversible; the server is shutting down.
  void CutShortCallsInFlight();

  // The one authentication check, first in every handler (here and in the
  // other protocols' services on this server): OK without tokens, else as
  // TokenSet::Authenticate (UNAUTHENTICATED).
  absl::StatusOr<Principal> Authenticate(const grpc::CallbackServerContext& context) const;
  // A reactor for a unary call of another protocol's service on this server
  // that reports it to this service's metrics under `method` and `model`,
  // and to the access log if it is on (as GetModel's). Deletes itself when
  // done. Thread-safe.
  ObservedReactor* NewObservedReactor(grpc::CallbackServerContext* context, RpcMethod method,
                                      absl::string_view model);

  // Fills a call's AttendRequest from what the call carries (Attend: its
  // bytes; ModelInfer: the Open Inference Protocol's request). A status that
  // is not OK fails the call with it; the request's model (even then) labels
  // the call.
  using ParseAttend = std::function<absl::Status(v1::AttendRequest* request)>;
  // Writes a computed response into the call's own response message; a
  // status that is not OK fails the call instead.
  using WriteAttend = std::function<absl::Status(WireResponse& response)>;
  // Attend's one path for a unary call of any protocol: authenticates,
  // parses (`parse`), admits (UNAVAILABLE unless serving), translates
  // (`translate`, if given: a protocol's request into the AttendRequest that
  // `parse` began, its model's existence first, so its checks come in
  // Attend's order), plans (PlanAttend: its codes), queues for the Scheduler
  // and the compute executor, and finishes the call with `write`'s result --
  // reported to metrics under `method` and to the access log. Thread-safe;
  // `parse` and `translate` run on the calling thread, `write` on the compute
  // executor (or here, for a refusal it does not run at all).
  grpc::ServerUnaryReactor* HandleUnaryAttend(grpc::CallbackServerContext* context,
                                              RpcMethod method, ParseAttend parse,
                                              WriteAttend write, ParseAttend translate = nullptr);

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request_bytes,
                                   grpc::ByteBuffer* response_bytes) override;
  // Attend with the maps streamed after the response (MapStream), each
  // message under --max_send_message_bytes; the call counts as in flight
  // until its last message is sent.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request_bytes) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const v1::GetModelRequest* request,
                                     v1::ModelInfo* response) override;
  // Admin RPCs: with tokens, PERMISSION_DENIED for a valid token that is not
  // an admin's. FAILED_PRECONDITION without a model repository (`loader`).
  // LoadModel finishes from the loader thread when the load is over.
  grpc::ServerUnaryReactor* LoadModel(grpc::CallbackServerContext* context,
                                      const v1::LoadModelRequest* request,
                                      v1::LoadModelResponse* response) override;
  grpc::ServerUnaryReactor* UnloadModel(grpc::CallbackServerContext* context,
                                        const v1::UnloadModelRequest* request,
                                        v1::UnloadModelResponse* response) override;

  // Decode sessions (server/api/session_handlers.cc): the session belongs to
  // the caller's token (Principal::id). FAILED_PRECONDITION without a
  // SessionManager. Extend plans its steps on the gRPC thread (each step's
  // status in the response) and runs them on the compute executor, alone
  // (its own micro-batch); the others answer on the gRPC thread.
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::OpenSessionRequest* request,
                                        v1::Session* response) override;
  grpc::ServerUnaryReactor* Extend(grpc::CallbackServerContext* context,
                                   const v1::ExtendRequest* request,
                                   v1::ExtendResponse* response) override;
  // Extend's messages on one stream (ExtendStreamReactor), each planned, run
  // and answered as an Extend call is (SubmitExtend), one at a time and in
  // order. The caller is authenticated once, when the stream opens; each
  // message is admitted (and counted in flight) as an Extend call is, so a
  // drain waits for the message running, not for an idle stream.
  grpc::ServerBidiReactor<v1::ExtendRequest, v1::ExtendResponse>* ExtendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::Session* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::Session* response) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* context,
                                            const v1::TruncateSessionRequest* request,
                                            v1::Session* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;
  // SessionManager::SnapshotLatest on the gRPC thread (the maps within
  // --max_attention_map_bytes and the response within
  // --max_send_message_bytes), then ReadLatest on the compute executor, alone
  // (a job of the scheduler: the queue's limits, deadlines and cancellation
  // apply as to Extend's).
  grpc::ServerUnaryReactor* GetLatestAttention(grpc::CallbackServerContext* context,
                                               const v1::LatestAttentionRequest* request,
                                               v1::LatestAttention* response) override;

 private:
  // Constant after construction.
  const ServerOptions options_;
  const ModelRegistry* const registry_;
  ComputeExecutor* const executor_;
  Metrics* const metrics_;
  const std::optional<TokenSet> tokens_;
  ModelLoader* const loader_;  // null without --model_repository
  SessionManager* const sessions_;  // null: no decode sessions

  // Authenticate, then PERMISSION_DENIED unless the principal is an admin
  // (open without tokens_, like every RPC).
  absl::Status AuthorizeAdmin(const grpc::CallbackServerContext& context) const;

  // Admits a call: false unless serving; otherwise counts it in flight until
  // EndCall.
  absl::Status BeginCall();
  void EndCall();

  // Runs one batch the scheduler formed, on the compute executor, and
  // finishes its calls.
  struct AttendJob;
  // An admitted Extend call (session_handlers.cc); Extend calls queued
  // together run as one batch (kExtendBatchKey), never with Attend calls.
  struct ExtendJob;
  static bool IsExtendJob(const ScheduledWork& work);
  // One round of each job (RunExtendRound); a job with chunks left goes back
  // into the queue (Scheduler::Requeue), the others are answered.
  void RunExtendBatch(std::vector<std::unique_ptr<ScheduledWork>> batch);
  // An admitted GetLatestAttention call (session_handlers.cc): always alone.
  struct LatestAttentionJob;
  static bool IsLatestAttentionJob(const ScheduledWork& work);
  void RunLatestAttentionJob(std::unique_ptr<ScheduledWork> work);
  // After a batch, on the executor: keeps the workspace's scratch for the
  // next batch up to kRetainedWorkspaceBytes, and marks it for
  // ReleaseComputeMemory.
  void KeepComputeMemory();
  // The compute executor's workspace (made on the first batch), or why not.
  absl::StatusOr<core::Workspace*> ComputeWorkspace();
  // The owner of the caller's sessions (its token's id): UNAUTHENTICATED as
  // Authenticate; FAILED_PRECONDITION without a SessionManager.
  absl::StatusOr<std::string> SessionOwner(const grpc::CallbackServerContext& context) const;
  // A session RPC's common start: SessionOwner, then admits the call
  // (BeginCall); on failure finishes `reactor`.
  std::optional<std::string> BeginSessionCall(grpc::CallbackServerContext& context,
                                              ObservedReactor& reactor);
  // Extend's one way for an admitted call or stream message: plans `request`
  // (PlanExtend) on the gRPC thread, then answers at once when nothing
  // computes (refusals and replays), else queues it for the compute executor
  // (alone: its own micro-batch). Calls `answer` exactly once, on either
  // thread, with OK (`response` filled) or the status that fails the call
  // as a whole; `request`, `response` and `observer` must live until then.
  // `method` (kExtend, kExtendStream) labels the step's latency.
  void SubmitExtend(RpcMethod method, grpc::CallbackServerContext* context,
                    const std::string& owner, const v1::ExtendRequest* request,
                    v1::ExtendResponse* response, CallObserver* observer,
                    std::function<void(absl::Status)> answer);
  // Records a call's (or stream message's) arrival, for WaitForQuiet.
  void NoteArrival();
  // OK while serving, else UNAVAILABLE saying why.
  absl::Status ServingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends an admitted call's result: the response when the status is OK, else
  // the status. Ends the call (EndCall) once it is sent, and then releases
  // `kept_bytes` of the in-flight budget (what it kept after compute).
  using Deliver =
      std::function<void(absl::Status status, WireResponse& response, int64_t kept_bytes)>;
  // The handler of Attend, AttendStream and HandleUnaryAttend's calls:
  // authenticates, parses (`parse`), admits, translates (`translate`, if not
  // empty), plans and submits the call;
  // `make_reactor` makes its reactor (for the model the request names) and
  // `make_deliver` what sends its result.
  template <class Reactor>
  Reactor* HandleAttend(grpc::CallbackServerContext* context, const ParseAttend& parse,
                        MapDelivery map_delivery,
                        const std::function<Reactor*(absl::string_view model)>& make_reactor,
                        const std::function<Deliver(Reactor*)>& make_deliver,
                        const ParseAttend& translate = nullptr);
  void RunBatch(std::vector<std::unique_ptr<ScheduledWork>> batch, const BatchInfo& info);

  // CutShortCallsInFlight() was called.
  std::atomic<bool> cut_short_{false};
  // The workspace may hold scratch: set after each batch on the executor,
  // cleared by ReleaseComputeMemory.
  std::atomic<bool> compute_memory_held_{false};

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kStarting;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // The open ExtendStream calls (each removes itself when gRPC is done with
  // it), to drain them at shutdown.
  absl::flat_hash_set<ExtendStreamReactor*> streams_ ABSL_GUARDED_BY(mu_);
  absl::Time last_end_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_arrival_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Used only on the compute executor, which runs one batch at a time.
  LayerCache layer_cache_;
  // Where every model's forwards compute (made on the first batch). Its
  // buffers are released after a batch that left more than
  // kRetainedWorkspaceBytes, so between batches compute memory beyond the
  // in-flight budget stays below that, and when the server is idle
  // (ReleaseComputeMemory).
  std::unique_ptr<core::Workspace> workspace_;
  // Admission, deadlines, memory budget and dynamic batching in front of
  // the compute executor; created in the constructor.
  std::unique_ptr<Scheduler> scheduler_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_ATTENTION_SERVICE_H_
