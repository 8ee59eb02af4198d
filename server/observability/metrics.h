#ifndef ATTNSERVE_SERVER_OBSERVABILITY_METRICS_H_
#define ATTNSERVE_SERVER_OBSERVABILITY_METRICS_H_

#include <cstdint>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/head_config.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace attnserve::server {

class ProcessCollector;

// The RPCs that metrics and the access log know by name.
enum class RpcMethod {
  kAttend,
  kAttendStream,
  kListModels,
  kGetModel,
  kLoadModel,
  kUnloadModel,
  kOpenSession,
  kExtend,
  kExtendStream,
  kGetSession,
  kForkSession,
  kTruncateSession,
  kCloseSession,
  kGetLatestAttention,
  kModelInfer,  // the Open Inference Protocol's inference call (inference.GRPCInferenceService)
  kModelReady,  // and its metadata calls (its probes, ServerLive/ServerReady, are not counted)
  kModelMetadata,
  kServerMetadata,
};
// "Attend", "ListModels", "GetModel", ..., "ModelInfer": the protos' method names.
absl::string_view RpcMethodName(RpcMethod method);

struct MetricsOptions {
  // host:port of the HTTP endpoint serving /metrics; port 0 picks a free port
  // (see Metrics::port). Empty: no endpoint (the metrics are still kept).
  std::string address;
  // The endpoint's threads: each serves one connection at a time. A request
  // whose headers are not complete within kRequestTimeoutMs is dropped (and
  // any read or write that stalls as long), so a connection that dribbles
  // holds a thread for at most that long.
  int threads = 256;
  static constexpr int kRequestTimeoutMs = 5000;
  // The compute queue's capacity, exported as attnserve_queue_capacity.
  int64_t queue_capacity = 0;
};

// The service's Prometheus metrics and the endpoint that serves them (the
// families are listed in README.md, "Metrics"). The service reports each call
// at its edges -- arrival, queueing, compute, finish -- and nothing in core/
// observes. Label values stay bounded: `model` is the label of a model added
// with AddModel (its name, or for a layer of a folder of layers, the folder's:
// one set of series a folder however many layers it has) or "" (ad-hoc
// layers, and names that are not loaded: see ModelLabel), `code`
// a status code name, `kernel_path` one of core's kernel paths. The series of
// every added model exist, at 0, from AddModel on.
//
// Thread-safe.
class Metrics {
 public:
  // UNAVAILABLE when options.address cannot be bound, INVALID_ARGUMENT for a
  // negative queue capacity.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const MetricsOptions& options);
  ~Metrics();  // stops the endpoint
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The port /metrics is served on (the one picked for port 0); 0 without an
  // endpoint.
  int port() const { return port_; }

  // attnserve_serving: 1 while the server serves (health SERVING), 0 while it
  // starts or drains. Besides /metrics, the endpoint serves it alone at
  // /ready, small enough for a proxy's health check to read it on every
  // check (deploy/haproxy/haproxy.cfg expects "attnserve_serving 1").
  void SetServing(bool serving);

  // Adds model `name` under label `label` (empty: `name`; a layer of a
  // folder of layers: the folder's name). The label's first model creates its
  // series (at 0) and its attnserve_model_info series (with `config`); later
  // models of the label share them. Adding a name again does nothing.
  void AddModel(absl::string_view name, const core::HeadConfig& config,
                absl::string_view label = {});
  // An unloaded model: the name is no longer a label for new calls (ModelLabel
  // gives ""); when it was its label's last model, the label's
  // attnserve_model_info series goes. Counters and histograms stay
  // (Prometheus counters must not reset); their number is bounded by the
  // repository's folders. AddModel again restores it.
  void RemoveModel(absl::string_view name);
  // The label of the added model `requested`, `requested` itself when it is
  // a label (a folder's name), else "": the one way a string from a client
  // becomes a label value.
  std::string ModelLabel(absl::string_view requested) const;

  // A call arrived: requests in flight + 1.
  void OnRequestStarted();
  // A call finished with `code`, `duration` after it arrived: requests in
  // flight - 1, the request counter and duration histogram move.
  void OnRequestDone(RpcMethod method, absl::string_view model, absl::StatusCode code,
                     absl::Duration duration);

  // An Attend request is about to be queued for compute (queue depth + 1).
  void OnQueued();
  // The queue refused it after OnQueued (queue depth - 1).
  void OnQueueRefused();
  // It left the queue to run after waiting `queue_wait` (queue depth - 1).
  void OnDequeued(absl::string_view model, absl::Duration queue_wait);

  // What one successful compute did for one request (the batch it ran in is
  // reported by OnBatch).
  struct Compute {
    absl::Duration duration;
    int64_t tokens = 0;               // query tokens, padding excluded
    int64_t attention_map_bytes = 0;  // map bytes in the response
  };
  void OnComputed(absl::string_view model, absl::string_view kernel_path, const Compute& compute);

  // One compute batch ran: `requests` requests with `sequences` sequences and
  // `tokens` query tokens in all (a request computed alone is a batch of 1).
  void OnBatch(absl::string_view model, int64_t requests, int64_t sequences, int64_t tokens);

  // One Extend call or ExtendStream message was answered (OK), `duration`
  // after it reached the handler: attnserve_decode_step_seconds{method}.
  void OnDecodeStep(RpcMethod method, absl::Duration duration);
  // One decode micro-batch (an AttentionLayer::Extend of one model) computed
  // `tokens` new tokens and its attention read `kv_read_bytes` of the KV
  // cache: attnserve_decode_batch_tokens{model} and
  // attnserve_kv_cache_read_bytes_total{model}.
  void OnDecodeBatch(absl::string_view model, int64_t tokens, int64_t kv_read_bytes);

  enum class SkipReason { kDeadline, kCancelled };
  // An admitted request was not computed: its deadline passed or its client
  // cancelled while it was queued.
  void OnSkipped(SkipReason reason);

  // attnserve_allocator_cached_bytes: freed memory the allocator keeps for
  // reuse (server/allocator_cache.h), as last looked at.
  void SetAllocatorCachedBytes(int64_t bytes);
  enum class CacheRelease { kIdle, kBound };
  // The allocator's cache was given back to the system:
  // attnserve_allocator_cache_releases_total{reason="idle"|"bound"} + 1.
  void OnAllocatorCacheReleased(CacheRelease reason);

  // The decode sessions and their KV cache as last looked at (totals since
  // start for the counts; the counters follow them).
  struct SessionGauges {
    int64_t sessions = 0;
    int64_t kv_used_bytes = 0;    // blocks in use
    int64_t kv_held_bytes = 0;    // in use + kept for reuse
    int64_t kv_budget_bytes = 0;  // --kv_cache_bytes
    int64_t kv_blocks = 0;
    int64_t kv_shared_blocks = 0;  // in use by more than one session (forks)
    int64_t kv_blocks_ahead = 0;   // in use, held ahead of sessions' tokens
    int64_t evictions_for_memory = 0;
    int64_t evictions_for_sessions = 0;
    int64_t expiries = 0;
  };
  // attnserve_sessions, attnserve_kv_cache_{used,held,budget}_bytes,
  // attnserve_kv_cache_blocks, attnserve_kv_cache_shared_blocks,
  // attnserve_kv_cache_ahead_blocks,
  // attnserve_session_evictions_total{reason},
  // attnserve_session_expiries_total. Called from one thread.
  void SetSessionGauges(const SessionGauges& gauges);

  // The text exposition of the registry and the process collector, as
  // /metrics serves it (less the endpoint's own exposer_* families).
  std::string TextExposition() const;

 private:
  Metrics();
  // Creates the series of `model` (a loaded model's name, or "").
  void CreateModelSeries(const std::string& model);

  // Constant after Create.
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ProcessCollector> process_;
  std::shared_ptr<prometheus::Registry> readiness_;  // attnserve_serving alone
  prometheus::Gauge* serving_ = nullptr;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;  // as given; empty without an endpoint
  int port_ = 0;
  std::vector<std::string> kernel_paths_;  // pre-created compute series
  prometheus::Family<prometheus::Histogram>* request_duration_ = nullptr;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* queue_wait_ = nullptr;
  prometheus::Family<prometheus::Histogram>* compute_ = nullptr;
  prometheus::Family<prometheus::Histogram>* batch_size_ = nullptr;
  prometheus::Family<prometheus::Histogram>* batch_tokens_ = nullptr;
  prometheus::Family<prometheus::Histogram>* batch_requests_ = nullptr;
  prometheus::Family<prometheus::Counter>* skipped_ = nullptr;
  std::vector<prometheus::Counter*> skipped_reasons_;  // deadline, cancelled
  prometheus::Family<prometheus::Counter>* tokens_ = nullptr;
  prometheus::Family<prometheus::Counter>* map_bytes_ = nullptr;
  prometheus::Family<prometheus::Histogram>* decode_step_ = nullptr;
  prometheus::Family<prometheus::Histogram>* decode_batch_tokens_ = nullptr;
  prometheus::Family<prometheus::Counter>* kv_read_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* model_info_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* in_flight_ = nullptr;
  prometheus::Gauge* allocator_cached_ = nullptr;
  std::vector<prometheus::Counter*> cache_releases_;  // idle, bound
  prometheus::Gauge* sessions_ = nullptr;
  prometheus::Gauge* kv_used_ = nullptr;
  prometheus::Gauge* kv_held_ = nullptr;
  prometheus::Gauge* kv_budget_ = nullptr;
  prometheus::Gauge* kv_blocks_ = nullptr;
  prometheus::Gauge* kv_blocks_ahead_ = nullptr;
  prometheus::Gauge* kv_shared_blocks_ = nullptr;
  std::vector<prometheus::Counter*> session_evictions_;  // memory, sessions
  prometheus::Counter* session_expiries_ = nullptr;

  mutable absl::Mutex mu_;
  SessionGauges last_sessions_ ABSL_GUARDED_BY(mu_);  // what the counters count
  // Each added model's label.
  std::map<std::string, std::string, std::less<>> models_ ABSL_GUARDED_BY(mu_);
  // Each label's count of added models.
  std::map<std::string, int64_t, std::less<>> labels_ ABSL_GUARDED_BY(mu_);
  // Each label's attnserve_model_info series (removed with its last model).
  std::map<std::string, prometheus::Gauge*, std::less<>> model_info_series_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_OBSERVABILITY_METRICS_H_
