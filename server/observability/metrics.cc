#include "server/observability/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <utility>

#include <CivetServer.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "cli/build_info.h"
#include "core/attention_inputs.h"
#include "core/route.h"
#include "core/runtime_info.h"
#include "server/common/allocator_control.h"
#include "server/observability/process_metrics.h"

namespace attnserve::server {
namespace {

// civetweb's end_request callback: runs on the endpoint's worker thread that
// answered a request. Gives that thread's allocator cache (jemalloc's
// per-thread cache of small freed blocks) back to the shared arena. A scrape
// allocates and frees thousands of small strings; without this each worker
// keeps about half a MiB of them cached after its first scrape, and since
// civetweb hands connections to its --metrics_threads workers in turn, RSS
// grew by that much for each of the first 256 scrapes on new connections
// (docs/measurements.md, "Churn: RSS and the pool's bookkeeping").
void ReleaseWorkerThreadCache(const mg_connection* /*connection*/, int /*status*/) {
  ReleaseThreadAllocatorCache();
}

using prometheus::Histogram;

// 50 us (a one-token compute) doubling to 52 s (past a 30 s call): any latency
// in between is resolved within a factor of 2.
Histogram::BucketBoundaries SecondsBuckets() {
  Histogram::BucketBoundaries buckets;
  for (double bound = 50e-6; bound < 60; bound *= 2) buckets.push_back(bound);
  return buckets;
}

Histogram::BucketBoundaries PowersOfTwo(double last) {
  Histogram::BucketBoundaries buckets;
  for (double bound = 1; bound <= last; bound *= 2) buckets.push_back(bound);
  return buckets;
}

const Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* const buckets = new Histogram::BucketBoundaries(SecondsBuckets());
  return *buckets;
}
// Sequences per compute batch: up to 1024 (--max_batch defaults to 64).
const Histogram::BucketBoundaries& BatchSizeBuckets() {
  static const auto* const buckets = new Histogram::BucketBoundaries(PowersOfTwo(1024));
  return *buckets;
}
// Query tokens per compute batch: up to 2^17 (64 sequences of 2048 by default).
const Histogram::BucketBoundaries& BatchTokenBuckets() {
  static const auto* const buckets = new Histogram::BucketBoundaries(PowersOfTwo(1 << 17));
  return *buckets;
}

constexpr RpcMethod kMethods[] = {
    RpcMethod::kAttend,       RpcMethod::kAttendStream,    RpcMethod::kListModels,
    RpcMethod::kGetModel,     RpcMethod::kLoadModel,       RpcMethod::kUnloadModel,
    RpcMethod::kOpenSession,  RpcMethod::kExtend,          RpcMethod::kExtendStream,
    RpcMethod::kGetSession,   RpcMethod::kForkSession,     RpcMethod::kTruncateSession,
    RpcMethod::kCloseSession, RpcMethod::kGetLatestAttention, RpcMethod::kModelInfer,
    RpcMethod::kModelReady,   RpcMethod::kModelMetadata,   RpcMethod::kServerMetadata};

// The codes each method can answer with today; their request counters exist
// from the start, so error ratios are defined before the first error.
std::vector<absl::StatusCode> ExpectedCodes(RpcMethod method) {
  using absl::StatusCode;
  switch (method) {
    case RpcMethod::kAttend:
    case RpcMethod::kAttendStream:
    case RpcMethod::kModelInfer:
      return {StatusCode::kOk,          StatusCode::kInvalidArgument,
              StatusCode::kNotFound,    StatusCode::kResourceExhausted,
              StatusCode::kUnavailable, StatusCode::kDeadlineExceeded,
              StatusCode::kCancelled,   StatusCode::kInternal,
              StatusCode::kUnauthenticated, StatusCode::kFailedPrecondition};
    case RpcMethod::kListModels:
      return {StatusCode::kOk, StatusCode::kUnauthenticated};
    case RpcMethod::kGetModel:
    case RpcMethod::kModelReady:
      return {StatusCode::kOk, StatusCode::kInvalidArgument, StatusCode::kNotFound,
              StatusCode::kUnauthenticated};
    case RpcMethod::kModelMetadata:
      return {StatusCode::kOk,          StatusCode::kInvalidArgument,
              StatusCode::kNotFound,    StatusCode::kUnavailable,
              StatusCode::kFailedPrecondition, StatusCode::kUnauthenticated};
    case RpcMethod::kServerMetadata:
      return {StatusCode::kOk, StatusCode::kUnauthenticated};
    case RpcMethod::kLoadModel:
      return {StatusCode::kOk,
              StatusCode::kInvalidArgument,
              StatusCode::kNotFound,
              StatusCode::kAlreadyExists,
              StatusCode::kFailedPrecondition,
              StatusCode::kAborted,
              StatusCode::kResourceExhausted,  // the loader's queue is full
              StatusCode::kUnavailable,
              StatusCode::kUnauthenticated,
              StatusCode::kPermissionDenied};
    case RpcMethod::kUnloadModel:
      return {StatusCode::kOk,
              StatusCode::kInvalidArgument,
              StatusCode::kNotFound,
              StatusCode::kFailedPrecondition,
              StatusCode::kUnauthenticated,
              StatusCode::kPermissionDenied};
    case RpcMethod::kOpenSession:
    case RpcMethod::kForkSession:
      return {StatusCode::kOk,          StatusCode::kInvalidArgument,   StatusCode::kNotFound,
              StatusCode::kAborted,     StatusCode::kResourceExhausted, StatusCode::kUnavailable,
              StatusCode::kFailedPrecondition, StatusCode::kUnauthenticated};
    case RpcMethod::kExtend:
    case RpcMethod::kExtendStream:
      return {StatusCode::kOk,          StatusCode::kInvalidArgument,  StatusCode::kResourceExhausted,
              StatusCode::kUnavailable, StatusCode::kDeadlineExceeded, StatusCode::kCancelled,
              StatusCode::kInternal,    StatusCode::kUnauthenticated};
    case RpcMethod::kGetSession:
    case RpcMethod::kTruncateSession:
    case RpcMethod::kCloseSession:
      return {StatusCode::kOk,      StatusCode::kInvalidArgument, StatusCode::kNotFound,
              StatusCode::kAborted, StatusCode::kUnavailable,     StatusCode::kUnauthenticated};
    case RpcMethod::kGetLatestAttention:
      return {StatusCode::kOk,           StatusCode::kInvalidArgument,
              StatusCode::kNotFound,     StatusCode::kAborted,
              StatusCode::kFailedPrecondition, StatusCode::kResourceExhausted,
              StatusCode::kUnavailable,  StatusCode::kDeadlineExceeded,
              StatusCode::kCancelled,    StatusCode::kUnauthenticated};
  }
  return {};
}

// "OK", "INVALID_ARGUMENT", ...: the names gRPC and Abseil share.
std::string CodeName(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  return name.empty() ? "UNKNOWN" : name;
}

// Opens and closes one TCP connection to `host`:`port` (any family).
void ConnectOnce(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* addresses = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addresses) != 0) return;
  for (addrinfo* a = addresses; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(addresses);
}

// The host a local client reaches an endpoint bound to `address` on.
std::string LocalHost(absl::string_view address) {
  absl::string_view host = address.substr(0, address.rfind(':'));
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  if (host.empty() || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return std::string(host);
}

}  // namespace

absl::string_view RpcMethodName(RpcMethod method) {
  switch (method) {
    case RpcMethod::kAttend:
      return "Attend";
    case RpcMethod::kAttendStream:
      return "AttendStream";
    case RpcMethod::kListModels:
      return "ListModels";
    case RpcMethod::kGetModel:
      return "GetModel";
    case RpcMethod::kLoadModel:
      return "LoadModel";
    case RpcMethod::kUnloadModel:
      return "UnloadModel";
    case RpcMethod::kOpenSession:
      return "OpenSession";
    case RpcMethod::kExtend:
      return "Extend";
    case RpcMethod::kExtendStream:
      return "ExtendStream";
    case RpcMethod::kGetSession:
      return "GetSession";
    case RpcMethod::kForkSession:
      return "ForkSession";
    case RpcMethod::kTruncateSession:
      return "TruncateSession";
    case RpcMethod::kCloseSession:
      return "CloseSession";
    case RpcMethod::kGetLatestAttention:
      return "GetLatestAttention";
    case RpcMethod::kModelInfer:
      return "ModelInfer";
    case RpcMethod::kModelReady:
      return "ModelReady";
    case RpcMethod::kModelMetadata:
      return "ModelMetadata";
    case RpcMethod::kServerMetadata:
      return "ServerMetadata";
  }
  return "unknown";
}

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      process_(std::make_shared<ProcessCollector>()),
      readiness_(std::make_shared<prometheus::Registry>()) {}

Metrics::~Metrics() {
  if (exposer_ == nullptr) return;
  // civetweb's listener waits for connections in 2 s rounds and sees that it
  // must stop only between rounds; connections end the round at once, so the
  // process is not held 2 s on its way out.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped, host = LocalHost(address_)] {
    while (!stopped.load()) {
      ConnectOnce(host, port_);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  stopped.store(true);
  waker.join();
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const MetricsOptions& options) {
  if (options.queue_capacity < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity: ", options.queue_capacity, " is negative"));
  }
  std::unique_ptr<Metrics> m(new Metrics());
  prometheus::Registry& r = *m->registry_;
  m->kernel_paths_ = core::KernelPathNames();

  m->request_duration_ =
      &prometheus::BuildHistogram()
           .Name("attnserve_request_duration_seconds")
           .Help("Time from a call's arrival to its status, by method, model and status code.")
           .Register(r);
  m->requests_ = &prometheus::BuildCounter()
                      .Name("attnserve_requests_total")
                      .Help("Calls finished, by method and status code.")
                      .Register(r);
  m->queue_wait_ = &prometheus::BuildHistogram()
                        .Name("attnserve_queue_wait_seconds")
                        .Help("Time Attend requests waited for the compute executor.")
                        .Register(r);
  m->compute_ = &prometheus::BuildHistogram()
                     .Name("attnserve_compute_seconds")
                     .Help("Compute time of the batch each successful Attend request ran in, by kernel path.")
                     .Register(r);
  m->batch_size_ = &prometheus::BuildHistogram()
                        .Name("attnserve_batch_size")
                        .Help("Sequences per compute batch (all its requests' sequences).")
                        .Register(r);
  m->batch_tokens_ = &prometheus::BuildHistogram()
                          .Name("attnserve_batch_tokens")
                          .Help("Query tokens (padding excluded) per compute batch.")
                          .Register(r);
  m->batch_requests_ = &prometheus::BuildHistogram()
                            .Name("attnserve_batch_requests")
                            .Help("Attend requests per compute batch (dynamic batching).")
                            .Register(r);
  m->skipped_ = &prometheus::BuildCounter()
                     .Name("attnserve_requests_skipped_total")
                     .Help("Attend requests admitted but not computed, by reason: deadline (it "
                           "passed while queued) or cancelled (the client went away).")
                     .Register(r);
  for (const char* reason : {"deadline", "cancelled"}) {
    m->skipped_reasons_.push_back(&m->skipped_->Add({{"reason", reason}}));
  }
  m->tokens_ = &prometheus::BuildCounter()
                    .Name("attnserve_tokens_total")
                    .Help("Query tokens (padding excluded) of successful Attend requests.")
                    .Register(r);
  m->map_bytes_ = &prometheus::BuildCounter()
                       .Name("attnserve_attention_map_bytes_total")
                       .Help("Attention-map bytes returned in Attend responses.")
                       .Register(r);
  m->decode_step_ =
      &prometheus::BuildHistogram()
           .Name("attnserve_decode_step_seconds")
           .Help("Time from an Extend call's (or ExtendStream message's) arrival to its answer, "
                 "for those answered OK: the decode step as the server sees it.")
           .Register(r);
  for (RpcMethod method : {RpcMethod::kExtend, RpcMethod::kExtendStream}) {
    m->decode_step_->Add({{"method", std::string(RpcMethodName(method))}}, DurationBuckets());
  }
  m->decode_batch_tokens_ =
      &prometheus::BuildHistogram()
           .Name("attnserve_decode_batch_tokens")
           .Help("New tokens per decode micro-batch (one model's steps of an Extend call or "
                 "ExtendStream message, computed together).")
           .Register(r);
  m->kv_read_bytes_ =
      &prometheus::BuildCounter()
           .Name("attnserve_kv_cache_read_bytes_total")
           .Help("KV cache bytes the decode attention read: for each computed step, the keys and "
                 "values of every token its layer holds after the step, once.")
           .Register(r);
  m->model_info_ = &prometheus::BuildGauge()
                        .Name("attnserve_model_info")
                        .Help("1 for each loaded model; its head configuration as labels.")
                        .Register(r);
  m->queue_depth_ = &prometheus::BuildGauge()
                         .Name("attnserve_queue_depth")
                         .Help("Attend requests waiting for the compute executor.")
                         .Register(r)
                         .Add({});
  m->in_flight_ = &prometheus::BuildGauge()
                       .Name("attnserve_requests_in_flight")
                       .Help("Calls arrived and not yet finished.")
                       .Register(r)
                       .Add({});
  m->allocator_cached_ =
      &prometheus::BuildGauge()
           .Name("attnserve_allocator_cached_bytes")
           .Help("Freed memory the allocator keeps for reuse by the next calls (no page faults "
                 "for their buffers); given back when idle or over --max_allocator_cache_bytes. "
                 "0 when the binary does not run on jemalloc.")
           .Register(r)
           .Add({});
  auto& cache_releases = prometheus::BuildCounter()
                             .Name("attnserve_allocator_cache_releases_total")
                             .Help("Times the allocator's cache was given back to the system: "
                                   "after --allocator_cache_idle_ms without calls (idle) or over "
                                   "--max_allocator_cache_bytes (bound).")
                             .Register(r);
  m->cache_releases_ = {&cache_releases.Add({{"reason", "idle"}}),
                        &cache_releases.Add({{"reason", "bound"}})};
  const auto gauge = [&r](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
  };
  m->sessions_ = gauge("attnserve_sessions", "Decode sessions open.");
  m->kv_used_ = gauge("attnserve_kv_cache_used_bytes",
                      "Bytes of the KV cache's blocks in use by sessions (a block forks share "
                      "counts once).");
  m->kv_held_ = gauge("attnserve_kv_cache_held_bytes",
                      "Bytes the KV cache holds: blocks in use and blocks kept for reuse.");
  m->kv_budget_ = gauge("attnserve_kv_cache_budget_bytes",
                        "The most the KV cache may hold (--kv_cache_bytes).");
  m->kv_blocks_ = gauge("attnserve_kv_cache_blocks", "KV cache blocks in use.");
  m->kv_shared_blocks_ = gauge("attnserve_kv_cache_shared_blocks",
                               "KV cache blocks in use by more than one session (forks share "
                               "their parent's blocks until one of them writes).");
  m->kv_blocks_ahead_ = gauge("attnserve_kv_cache_ahead_blocks",
                              "KV cache blocks in use held ahead of sessions' tokens (a session "
                              "growing by a block takes a run of them, so that its blocks lie "
                              "together in memory).");
  auto& evictions = prometheus::BuildCounter()
                        .Name("attnserve_session_evictions_total")
                        .Help("Idle sessions evicted, least recently used first: for the KV "
                              "cache's memory (memory) or for a new session at --max_sessions "
                              "(sessions).")
                        .Register(r);
  m->session_evictions_ = {&evictions.Add({{"reason", "memory"}}),
                           &evictions.Add({{"reason", "sessions"}})};
  m->session_expiries_ = &prometheus::BuildCounter()
                              .Name("attnserve_session_expiries_total")
                              .Help("Sessions ended for being idle past their TTL.")
                              .Register(r)
                              .Add({});
  prometheus::BuildGauge()
      .Name("attnserve_queue_capacity")
      .Help("Attend requests the compute queue holds; more are refused (RESOURCE_EXHAUSTED).")
      .Register(r)
      .Add({})
      .Set(static_cast<double>(options.queue_capacity));
  const core::RuntimeInfo runtime = core::GetRuntimeInfo();
  prometheus::BuildGauge()
      .Name("attnserve_build_info")
      .Help("1; the server's version and git revision, oneDNN's version and the CPU ISA oneDNN "
            "runs as labels.")
      .Register(r)
      .Add({{"version", std::string(cli::Version())},
            {"revision", std::string(cli::Revision())},
            {"onednn_version", runtime.onednn_version},
            {"cpu_isa", runtime.cpu_isa}})
      .Set(1);

  m->serving_ = &prometheus::BuildGauge()
                    .Name("attnserve_serving")
                    .Help("1 while the server serves (health SERVING); 0 while it starts or drains.")
                    .Register(*m->readiness_)
                    .Add({});

  for (RpcMethod method : kMethods) {
    for (absl::StatusCode code : ExpectedCodes(method)) {
      m->requests_->Add({{"method", std::string(RpcMethodName(method))}, {"code", CodeName(code)}});
    }
  }
  // Methods whose calls name no model (sessions span models): model "".
  for (RpcMethod method :
       {RpcMethod::kListModels, RpcMethod::kOpenSession, RpcMethod::kExtend,
        RpcMethod::kExtendStream, RpcMethod::kGetSession, RpcMethod::kForkSession,
        RpcMethod::kTruncateSession, RpcMethod::kCloseSession, RpcMethod::kGetLatestAttention,
        RpcMethod::kServerMetadata}) {
    for (absl::StatusCode code : ExpectedCodes(method)) {
      m->request_duration_->Add({{"method", std::string(RpcMethodName(method))},
                                 {"model", ""},
                                 {"code", CodeName(code)}},
                                DurationBuckets());
    }
  }
  m->CreateModelSeries("");

  if (!options.address.empty()) {
    m->address_ = options.address;
    try {
      // civetweb's options: request_timeout_ms bounds the time from a
      // request's first byte to the end of its headers, and each read and write.
      // (civetweb copies the callbacks.)
      CivetCallbacks callbacks;
      callbacks.end_request = &ReleaseWorkerThreadCache;
      m->exposer_ = std::make_unique<prometheus::Exposer>(
          std::vector<std::string>{"listening_ports", options.address, "num_threads",
                                   std::to_string(options.threads), "request_timeout_ms",
                                   std::to_string(MetricsOptions::kRequestTimeoutMs)},
          &callbacks);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics_address: cannot listen on '", options.address, "': ", e.what()));
    }
    m->exposer_->RegisterCollectable(m->registry_);
    m->exposer_->RegisterCollectable(m->process_);
    m->exposer_->RegisterCollectable(m->readiness_);
    m->exposer_->RegisterCollectable(m->readiness_, "/ready");
    const std::vector<int> ports = m->exposer_->GetListeningPorts();
    if (ports.empty()) {
      return absl::UnavailableError(
          absl::StrCat("--metrics_address: cannot listen on '", options.address, "'"));
    }
    m->port_ = ports.front();
  }
  return m;
}

void Metrics::CreateModelSeries(const std::string& model) {
  // Every code a method can answer, so rates of errors exist before the first one.
  for (RpcMethod method : {RpcMethod::kAttend, RpcMethod::kAttendStream}) {
    for (absl::StatusCode code : ExpectedCodes(method)) {
      request_duration_->Add(
          {{"method", std::string(RpcMethodName(method))}, {"model", model}, {"code", CodeName(code)}},
          DurationBuckets());
    }
  }
  if (!model.empty()) {
    for (RpcMethod method : {RpcMethod::kGetModel, RpcMethod::kModelReady,
                             RpcMethod::kModelMetadata}) {
      for (absl::StatusCode code : ExpectedCodes(method)) {
        request_duration_->Add({{"method", std::string(RpcMethodName(method))},
                                {"model", model},
                                {"code", CodeName(code)}},
                               DurationBuckets());
      }
    }
  }
  queue_wait_->Add({{"model", model}}, DurationBuckets());
  for (const std::string& path : kernel_paths_) {
    compute_->Add({{"model", model}, {"kernel_path", path}}, DurationBuckets());
  }
  batch_size_->Add({{"model", model}}, BatchSizeBuckets());
  batch_tokens_->Add({{"model", model}}, BatchTokenBuckets());
  batch_requests_->Add({{"model", model}}, BatchSizeBuckets());
  tokens_->Add({{"model", model}});
  map_bytes_->Add({{"model", model}});
  decode_batch_tokens_->Add({{"model", model}}, BatchTokenBuckets());
  kv_read_bytes_->Add({{"model", model}});
}

void Metrics::AddModel(absl::string_view name, const core::HeadConfig& config,
                       absl::string_view label) {
  const std::string model(label.empty() ? name : label);
  {
    absl::MutexLock lock(&mu_);
    if (!models_.try_emplace(std::string(name), model).second) return;
    if (labels_[model]++ > 0) return;  // the label's series exist
  }
  CreateModelSeries(model);
  prometheus::Gauge& info = model_info_
      ->Add({{"model", model},
             {"d_model", absl::StrCat(config.d_model)},
             {"num_heads", absl::StrCat(config.num_heads)},
             {"num_kv_heads", absl::StrCat(config.num_kv_heads)},
             {"head_dim", absl::StrCat(config.head_dim)}});
  info.Set(1);
  absl::MutexLock lock(&mu_);
  model_info_series_[model] = &info;
}

void Metrics::RemoveModel(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  const auto it = models_.find(name);
  if (it == models_.end()) return;
  const std::string label = it->second;
  models_.erase(it);
  const auto count = labels_.find(label);
  if (count != labels_.end() && --count->second > 0) return;  // the label's other models stay
  if (count != labels_.end()) labels_.erase(count);
  if (const auto info = model_info_series_.find(label); info != model_info_series_.end()) {
    model_info_->Remove(info->second);
    model_info_series_.erase(info);
  }
}

std::string Metrics::ModelLabel(absl::string_view requested) const {
  absl::MutexLock lock(&mu_);
  if (const auto it = models_.find(requested); it != models_.end()) return it->second;
  return labels_.contains(requested) ? std::string(requested) : std::string();
}

void Metrics::OnRequestStarted() { in_flight_->Increment(); }

void Metrics::OnRequestDone(RpcMethod method, absl::string_view model, absl::StatusCode code,
                            absl::Duration duration) {
  in_flight_->Decrement();
  const std::string method_name(RpcMethodName(method));
  const std::string code_name = CodeName(code);
  requests_->Add({{"method", method_name}, {"code", code_name}}).Increment();
  request_duration_
      ->Add({{"method", method_name}, {"model", std::string(model)}, {"code", code_name}},
            DurationBuckets())
      .Observe(absl::ToDoubleSeconds(duration));
}

void Metrics::OnQueued() { queue_depth_->Increment(); }

void Metrics::OnQueueRefused() { queue_depth_->Decrement(); }

void Metrics::OnDequeued(absl::string_view model, absl::Duration queue_wait) {
  queue_depth_->Decrement();
  queue_wait_->Add({{"model", std::string(model)}}, DurationBuckets())
      .Observe(absl::ToDoubleSeconds(queue_wait));
}

void Metrics::OnComputed(absl::string_view model, absl::string_view kernel_path,
                         const Compute& compute) {
  const std::string model_label(model);
  compute_
      ->Add({{"model", model_label}, {"kernel_path", std::string(kernel_path)}}, DurationBuckets())
      .Observe(absl::ToDoubleSeconds(compute.duration));
  tokens_->Add({{"model", model_label}}).Increment(static_cast<double>(compute.tokens));
  map_bytes_->Add({{"model", model_label}})
      .Increment(static_cast<double>(compute.attention_map_bytes));
}

void Metrics::SetServing(bool serving) { serving_->Set(serving ? 1 : 0); }

void Metrics::SetAllocatorCachedBytes(int64_t bytes) {
  allocator_cached_->Set(static_cast<double>(bytes));
}

void Metrics::SetSessionGauges(const SessionGauges& gauges) {
  sessions_->Set(static_cast<double>(gauges.sessions));
  kv_used_->Set(static_cast<double>(gauges.kv_used_bytes));
  kv_held_->Set(static_cast<double>(gauges.kv_held_bytes));
  kv_budget_->Set(static_cast<double>(gauges.kv_budget_bytes));
  kv_blocks_->Set(static_cast<double>(gauges.kv_blocks));
  kv_shared_blocks_->Set(static_cast<double>(gauges.kv_shared_blocks));
  kv_blocks_ahead_->Set(static_cast<double>(gauges.kv_blocks_ahead));
  absl::MutexLock lock(&mu_);
  const auto add = [](prometheus::Counter* counter, int64_t now, int64_t before) {
    if (now > before) counter->Increment(static_cast<double>(now - before));
  };
  add(session_evictions_[0], gauges.evictions_for_memory, last_sessions_.evictions_for_memory);
  add(session_evictions_[1], gauges.evictions_for_sessions, last_sessions_.evictions_for_sessions);
  add(session_expiries_, gauges.expiries, last_sessions_.expiries);
  last_sessions_ = gauges;
}

void Metrics::OnAllocatorCacheReleased(CacheRelease reason) {
  cache_releases_[reason == CacheRelease::kIdle ? 0 : 1]->Increment();
}

std::string Metrics::TextExposition() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& family : readiness_->Collect()) {
    families.push_back(std::move(family));
  }
  for (prometheus::MetricFamily& family : process_->Collect()) {
    families.push_back(std::move(family));
  }
  return prometheus::TextSerializer().Serialize(families);
}

void Metrics::OnBatch(absl::string_view model, int64_t requests, int64_t sequences,
                      int64_t tokens) {
  const std::string model_label(model);
  batch_size_->Add({{"model", model_label}}, BatchSizeBuckets())
      .Observe(static_cast<double>(sequences));
  batch_tokens_->Add({{"model", model_label}}, BatchTokenBuckets())
      .Observe(static_cast<double>(tokens));
  batch_requests_->Add({{"model", model_label}}, BatchSizeBuckets())
      .Observe(static_cast<double>(requests));
}

void Metrics::OnDecodeStep(RpcMethod method, absl::Duration duration) {
  decode_step_->Add({{"method", std::string(RpcMethodName(method))}}, DurationBuckets())
      .Observe(absl::ToDoubleSeconds(duration));
}

void Metrics::OnDecodeBatch(absl::string_view model, int64_t tokens, int64_t kv_read_bytes) {
  const std::string model_label(model);
  decode_batch_tokens_->Add({{"model", model_label}}, BatchTokenBuckets())
      .Observe(static_cast<double>(tokens));
  kv_read_bytes_->Add({{"model", model_label}}).Increment(static_cast<double>(kv_read_bytes));
}

void Metrics::OnSkipped(SkipReason reason) {
  skipped_reasons_[reason == SkipReason::kDeadline ? 0 : 1]->Increment();
}

}  // namespace attnserve::server
