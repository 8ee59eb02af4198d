#include "server/attn_server.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/build_info.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/api/replica_header.h"
#include "server/explorer/explorer_routes.h"
#include "server/http/open_inference_rest.h"
#include "server/observability/log.h"
#include "server/security/auth.h"
#include "server/security/tls_credentials.h"

namespace attnserve::server {
namespace {

absl::Status CheckRange(absl::string_view flag, int64_t value, int64_t min, int64_t max) {
  if (value >= min && value <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": ", value, " is outside [", min, ", ", max, "]"));
}

// The end of a drain: how long calls cut short get to answer, and how long
// answers still leaving get once the server stops listening.
constexpr absl::Duration kCutShortWait = absl::Seconds(2);
constexpr absl::Duration kShutdownGrace = absl::Seconds(2);
// How long no call may have arrived before the server stops listening.
constexpr absl::Duration kQuietPeriod = absl::Milliseconds(250);

// Transport limits beyond the options (SECURITY.md says why each).
constexpr absl::Duration kHandshakeTimeout = absl::Seconds(10);
constexpr int kMaxMetadataBytes = 16 * 1024;

// The host of a host:port address ("[::1]" bracketed as written).
std::string HostOf(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return std::string(address);
  return std::string(address.substr(0, colon));
}

// Seconds as the int milliseconds of a channel argument (at most ~24 days).
int ClampedMilliseconds(int64_t seconds) {
  return static_cast<int>(std::min<int64_t>(seconds, std::numeric_limits<int>::max() / 1000) * 1000);
}

// oneDNN's own primitive cache: off. Every primitive the server runs is built
// and cached on the compute worker's workspace (core/workspace.h; the
// warm-up's forwards make a workspace each, once per model), so oneDNN's
// cache only held second references to those and up to 1024 shapes the
// workspace had evicted: memory that grew for minutes as new batch shapes
// came (docs/measurements.md, "Churn"). ONEDNN_PRIMITIVE_CACHE_CAPACITY in the
// environment still sets it (attnserve logs the capacity in force).
constexpr int kOneDnnPrimitiveCacheCapacity = 0;

// Start-up queues at most this many loads at once (below ModelLoaderOptions'
// default max_pending, which refuses more).
constexpr size_t kStartupLoadsInFlight = 32;

// Runs one small forward pass so OpenMP's threads exist and the layer's
// weights are touched before the first request. (oneDNN's primitives it
// builds are not kept: the warm-up has no workspace and oneDNN's own cache is
// off, so the first request of each shape builds its own.)
absl::Status WarmUp(const Model& model, ComputeExecutor& executor) {
  ATTNSERVE_ASSIGN_OR_RETURN(core::SequenceLayout layout, core::SequenceLayout::Padded(1, 16));
  const int64_t d_model = model.layer->config().d_model;
  std::vector<float> input(layout.rows() * d_model, 0.5f), output(input.size());
  core::LayerInputs inputs;
  inputs.hidden_states = input;
  inputs.layout = layout;
  core::ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  absl::Status status;
  absl::Notification done;
  ATTNSERVE_RETURN_IF_ERROR(executor.Submit([&] {
    status = model.layer->Forward(inputs, {}, outputs).status();
    done.Notify();
  }));
  done.WaitForNotification();
  return status;
}

// The transport's defences (SECURITY.md, "Hostile clients"): the HTTP/2 and
// connection limits of the options, a resource quota that bounds the bytes
// gRPC buffers for all connections, and no SO_REUSEPORT, so that a second
// instance on a busy port fails to start instead of taking part of its
// traffic.
void ApplyConnectionLimits(const ServerOptions& options, grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             ClampedMilliseconds(options.max_connection_idle_seconds));
  if (options.max_connection_age_seconds > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               ClampedMilliseconds(options.max_connection_age_seconds));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               ClampedMilliseconds(options.max_connection_age_grace_seconds));
  }
  // A connection that has not finished its TLS handshake and sent its HTTP/2
  // settings by then is closed (gRPC's default is 120 s).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(kHandshakeTimeout)));
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  grpc::ResourceQuota quota("attnserve-transport");
  quota.Resize(static_cast<size_t>(options.max_transport_bytes));
  builder.SetResourceQuota(quota);
}

}  // namespace

absl::Status ValidateServerOptions(const ServerOptions& options) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_receive_message_bytes", options.max_receive_message_bytes, 1024, kIntMax));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_send_message_bytes", options.max_send_message_bytes, 1024, kIntMax));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("compute_threads", options.compute_threads, 0, 1024));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_queued_requests", options.max_queued_requests, 1, 1 << 20));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_batch", options.limits.max_batch, 1, 1 << 20));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_seq_len", options.limits.max_seq_len, 1, 1 << 20));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_attention_map_bytes",
                                       options.limits.max_attention_map_bytes, 0, int64_t{1} << 40));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_adhoc_weight_bytes",
                                       options.limits.max_adhoc_weight_bytes, 0, int64_t{1} << 40));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_scratch_bytes", options.limits.max_scratch_bytes,
                                       int64_t{1} << 20, int64_t{1} << 40));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_request_bytes", options.limits.max_request_bytes,
                                       int64_t{1} << 20, int64_t{1} << 40));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_inflight_bytes", options.max_inflight_bytes,
                                       int64_t{1} << 20, int64_t{1} << 44));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_batch_tokens", options.max_batch_tokens, 0, int64_t{1} << 24));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_queue_delay_us", options.max_queue_delay_us, 0, 10 * 1000 * 1000));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("prefill_chunk_tokens", options.prefill_chunk_tokens, 0, 1 << 20));
  if (!(options.lame_duck_seconds >= 0 && options.lame_duck_seconds <= 600)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lame_duck_seconds: ", options.lame_duck_seconds, " is outside [0, 600]"));
  }
  if (!(options.drain_timeout_seconds >= 0 && options.drain_timeout_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--drain_timeout_seconds: ", options.drain_timeout_seconds, " is outside [0, 3600]"));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_model_bytes", options.max_model_bytes, int64_t{1} << 20, int64_t{1} << 44));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_concurrent_streams", options.max_concurrent_streams, 1, 1 << 20));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_connection_idle_seconds",
                                       options.max_connection_idle_seconds, 1, int64_t{1} << 30));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_connection_age_seconds",
                                       options.max_connection_age_seconds, 0, int64_t{1} << 30));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_connection_age_grace_seconds",
                                       options.max_connection_age_grace_seconds, 0,
                                       int64_t{1} << 30));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_transport_bytes", options.max_transport_bytes,
                                       int64_t{16} << 20, int64_t{1} << 44));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("min_open_files", options.min_open_files, 0, int64_t{1} << 30));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("metrics_threads", options.metrics_threads, 1, 4096));
  if (!(options.watchdog_interval_seconds >= 0 && options.watchdog_interval_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrCat("--watchdog_interval_seconds: ",
                                                   options.watchdog_interval_seconds,
                                                   " is outside [0, 3600]"));
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("watchdog_failures", options.watchdog_failures, 1, 1000));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckRange("max_rss_bytes", options.max_rss_bytes, 0, int64_t{1} << 46));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("max_allocator_cache_bytes",
                                       options.max_allocator_cache_bytes, 0, int64_t{1} << 46));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("allocator_cache_idle_ms", options.allocator_cache_idle_ms,
                                       1, int64_t{24} * 3600 * 1000));
  if (options.listen_address.empty()) {
    return absl::InvalidArgumentError("--listen_address: required (host:port)");
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("http_threads", options.http_threads, 1, 1024));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("http_max_body_bytes", options.http_max_body_bytes, 1024,
                                       int64_t{1} << 30));
  ATTNSERVE_RETURN_IF_ERROR(CheckRange("http_request_timeout_ms", options.http_request_timeout_ms,
                                       100, 3600 * 1000));
  for (const std::string& host : options.http_allowed_hosts) {
    const bool bracketed = absl::StartsWith(host, "[") && absl::EndsWith(host, "]");
    bool name = !host.empty() && host.size() <= 255;
    for (char c : host) {
      name = name && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ||
                      (bracketed && (c == ':' || c == '[' || c == ']')));
    }
    if (!name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--http_allowed_hosts: '", host,
          "' is not a host name (letters, digits, '.', '-'; an IPv6 address in brackets; no port)"));
    }
  }
  return absl::OkStatus();
}

AttnServer::AttnServer(const ServerOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Create(const ServerOptions& options) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateServerOptions(options));
  ATTNSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                             MakeServerCredentials(options));
  std::optional<TokenSet> http_tokens;
  std::optional<TokenSet> tokens;
  if (!options.auth_tokens_file.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(tokens, TokenSet::Load(options.auth_tokens_file));
    http_tokens = tokens;
    if (!options.tls_cert_file.empty()) {
      // On TLS, a call without a valid token ends before its body is read.
      std::vector<std::string> guarded = {
          absl::StrCat("/", v1::AttentionService::service_full_name(), "/"),
          OpenInferenceService::GuardedPathPrefix()};
      credentials->SetAuthMetadataProcessor(MakeTokenAuthProcessor(
          *tokens, std::move(guarded), OpenInferenceService::OpenMethodPaths()));
    }
  }
  ATTNSERVE_RETURN_IF_ERROR(
      core::SetOneDnnPrimitiveCacheCapacityUnlessSet(kOneDnnPrimitiveCacheCapacity).status());
  std::unique_ptr<AttnServer> server(new AttnServer(options));
  ATTNSERVE_ASSIGN_OR_RETURN(
      server->executor_,
      ComputeExecutor::Create({.queue_capacity = options.max_queued_requests,
                               .compute_threads = options.compute_threads}));
  ATTNSERVE_ASSIGN_OR_RETURN(
      server->metrics_, Metrics::Create({.address = options.metrics_address,
                                         .threads = options.metrics_threads,
                                         .queue_capacity = options.max_queued_requests}));
  if (!options.model_repository.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(server->repository_,
                               ModelRepository::Create(options.model_repository,
                                                       {.max_model_bytes = options.max_model_bytes}));
    AttnServer* self = server.get();
    server->loader_ = std::make_unique<ModelLoader>(
        server->repository_.get(), &server->registry_,
        ModelLoaderOptions{
            .warm_up = [self](const Model& model) { return WarmUp(model, *self->executor_); },
            .on_ready =
                [self](const Model& model, absl::string_view folder) {
                  // A folder's layers share its label: one set of series a folder.
                  self->metrics_->AddModel(model.name, model.layer->config(), folder);
                },
            .on_unloaded = [self](absl::string_view name) { self->metrics_->RemoveModel(name); },
        });
  }
  ATTNSERVE_ASSIGN_OR_RETURN(
      server->sessions_,
      SessionManager::Create(options.sessions,
                             {.period = absl::Seconds(1),
                              .on_look = [metrics = server->metrics_.get(),
                                          budget = options.sessions.kv_cache_bytes](
                                             const SessionStats& stats) {
                                metrics->SetSessionGauges(
                                    {.sessions = stats.sessions,
                                     .kv_used_bytes = stats.pool.bytes_in_use,
                                     .kv_held_bytes = stats.pool.bytes_held,
                                     .kv_budget_bytes = budget,
                                     .kv_blocks = stats.pool.blocks_in_use,
                                     .kv_shared_blocks = stats.pool.shared_blocks,
                                     .kv_blocks_ahead = stats.blocks_ahead,
                                     .evictions_for_memory = stats.evictions_for_memory,
                                     .evictions_for_sessions = stats.evictions_for_sessions,
                                     .expiries = stats.expiries});
                              }}));
  server->service_ = std::make_unique<AttentionServiceImpl>(
      options, &server->registry_, server->executor_.get(), server->metrics_.get(),
      std::move(tokens), server->loader_.get(), server->sessions_.get());

  server->open_inference_ = std::make_unique<OpenInferenceService>(
      server->service_.get(), &server->registry_, options.limits, std::string(cli::Version()));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_receive_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_send_message_bytes));
  ApplyConnectionLimits(options, builder);
  if (!options.replica_name.empty()) {
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
    factories.push_back(MakeReplicaHeaderInterceptorFactory(options.replica_name));
    builder.experimental().SetInterceptorCreators(std::move(factories));
  }
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->open_inference_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen_address: cannot listen on '", options.listen_address,
        "' (is another process, perhaps another attnserve, serving on that port?)"));
  }
  // gRPC's health service says SERVING from the start; it must not until the
  // models are loaded and warm.
  server->SetHealth(false);
  if (!options.http_address.empty()) {
    // The REST routes call the gRPC services in process, with the gRPC
    // port's message limits.
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(static_cast<int>(options.max_send_message_bytes));
    arguments.SetMaxSendMessageSize(static_cast<int>(options.max_receive_message_bytes));
    HttpFrontOptions http_options;
    http_options.address = options.http_address;
    http_options.threads = options.http_threads;
    http_options.max_body_bytes = options.http_max_body_bytes;
    http_options.request_timeout_ms = options.http_request_timeout_ms;
    http_options.tokens = std::move(http_tokens);
    // Browser-facing routes (the explorer) accept, besides the loopback
    // names, the host the port is bound to (unless a wildcard) and the
    // allowed hosts.
    http_options.allowed_hosts = options.http_allowed_hosts;
    const std::string bound_host = HostOf(options.http_address);
    if (!bound_host.empty() && bound_host != "0.0.0.0" && bound_host != "[::]") {
      http_options.allowed_hosts.push_back(bound_host);
    }
    std::shared_ptr<grpc::Channel> channel = server->server_->InProcessChannel(arguments);
    std::vector<HttpRoute> routes = OpenInferenceRoutes(channel);
    ATTNSERVE_ASSIGN_OR_RETURN(
        std::vector<HttpRoute> explorer,
        ExplorerRoutes(channel,
                       {.web_dir = options.explorer_web_dir,
                        .max_body_bytes = options.http_max_body_bytes,
                        .layer_limits = {.max_seq_len = options.limits.max_seq_len,
                                         .max_attention_map_bytes =
                                             options.limits.max_attention_map_bytes,
                                         .max_weight_bytes = options.limits.max_adhoc_weight_bytes}}));
    for (HttpRoute& route : explorer) routes.push_back(std::move(route));
    absl::StatusOr<std::unique_ptr<HttpFront>> http =
        HttpFront::Create(std::move(http_options), std::move(routes));
    if (!http.ok()) {
      return absl::Status(http.status().code(),
                          absl::StrCat("--http_address: ", http.status().message()));
    }
    server->http_ = *std::move(http);
  }
  AttnServer* self = server.get();
  server->allocator_cache_ = std::make_unique<AllocatorCacheKeeper>(AllocatorCacheOptions{
      .max_bytes = options.max_allocator_cache_bytes,
      .idle = absl::Milliseconds(options.allocator_cache_idle_ms),
      .last_activity = [self] { return self->service_->last_activity(); },
      .on_idle = [self] { self->service_->ReleaseComputeMemory(); },
      .on_look =
          [self](int64_t cached_bytes, AllocatorCacheOptions::Release release) {
            self->metrics_->SetAllocatorCachedBytes(cached_bytes);
            if (release != AllocatorCacheOptions::Release::kNone) {
              self->metrics_->OnAllocatorCacheReleased(
                  release == AllocatorCacheOptions::Release::kIdle ? Metrics::CacheRelease::kIdle
                                                                   : Metrics::CacheRelease::kBound);
            }
          },
  });
  return server;
}

AttnServer::~AttnServer() { Shutdown(); }

void AttnServer::SetHealth(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", serving);
  health->SetServingStatus(v1::AttentionService::service_full_name(), serving);
  health->SetServingStatus(inference::GRPCInferenceService::service_full_name(), serving);
  open_inference_->set_ready(serving);
  metrics_->SetServing(serving);
}

absl::Status AttnServer::LoadModelsAndServe() {
  const absl::Time start = absl::Now();
  if (loader_ != nullptr) {
    ATTNSERVE_ASSIGN_OR_RETURN(std::vector<std::string> names, repository_->ListModelNames());
    // Loads answered so far. Loads started and not answered stay under the
    // loader's max_pending, so no folder of a large repository is refused.
    absl::Mutex mu;
    size_t finished = 0;
    for (size_t started = 0; started < names.size(); ++started) {
      const std::string& name = names[started];
      {
        absl::MutexLock lock(&mu);
        auto has_room = [&]() { return started - finished < kStartupLoadsInFlight; };
        mu.Await(absl::Condition(&has_room));
      }
      absl::Status queued = loader_->Load(name, [&, name](
                                                    absl::StatusOr<ModelLoader::Loaded> loaded) {
        if (!loaded.ok() || loaded->models.empty()) {
          LogLine(absl::StrCat("model '", name, "' not loaded: ", loaded.status().ToString()));
        } else if (!loaded->layered) {
          LogLine(absl::StrCat("model '", name, "' loaded and warm after ",
                               absl::FormatDuration(absl::Now() - start), ": ",
                               loaded->models[0].model->description));
        } else {
          const std::vector<ModelStatus>& layers = loaded->models;
          LogLine(absl::StrCat("model folder '", name, "' loaded and warm after ",
                               absl::FormatDuration(absl::Now() - start), ": ", layers.size(),
                               " layers, models ", layers.front().name, " to ",
                               layers.back().name, " (", layers.front().model->description,
                               ", ...)"));
        }
        absl::MutexLock lock(&mu);
        ++finished;
      });
      if (!queued.ok()) {
        LogLine(absl::StrCat("model '", name, "' not loaded: ", queued.ToString()));
        absl::MutexLock lock(&mu);
        ++finished;
      }
    }
    {
      absl::MutexLock lock(&mu);
      auto done = [&]() { return finished == names.size(); };
      mu.Await(absl::Condition(&done));
    }
    LogLine(absl::StrCat("model repository '", options_.model_repository, "': ", names.size(),
                         " model folder(s) processed in ",
                         absl::FormatDuration(absl::Now() - start)));
    service_->set_state(AttentionServiceImpl::State::kServing);
    SetHealth(true);
    return absl::OkStatus();
  }
  ATTNSERVE_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                             MakeBuiltinModel(options_.builtin_model_seed));
  ATTNSERVE_RETURN_IF_ERROR(WarmUp(*model, *executor_));
  ATTNSERVE_RETURN_IF_ERROR(registry_.Add(model));
  metrics_->AddModel(model->name, model->layer->config());
  LogLine(absl::StrCat("model '", model->name, "' loaded and warm in ",
                       absl::FormatDuration(absl::Now() - start), ": ", model->description));
  service_->set_state(AttentionServiceImpl::State::kServing);
  SetHealth(true);
  return absl::OkStatus();
}

void AttnServer::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_ != nullptr) {  // null only when Create failed
    // 1. Lame duck: health NOT_SERVING while the server still listens and
    //    serves, so that health checkers, proxies and balancers move away
    //    before it refuses anything (a proxy takes about its check interval
    //    to notice; calls refused meanwhile could exhaust a client's retries
    //    on this replica). Then new Attend calls get UNAVAILABLE.
    SetHealth(false);
    absl::SleepFor(absl::Seconds(options_.lame_duck_seconds));
    service_->set_state(AttentionServiceImpl::State::kDraining);
    // The drain counts from the end of the lame duck, whose calls it drains.
    const absl::Time drain_deadline = absl::Now() + absl::Seconds(options_.drain_timeout_seconds);
    // 2. Calls in flight finish (up to the drain timeout); those still
    //    running then stop and answer UNAVAILABLE (retryable), never CANCELLED.
    if (!service_->WaitForIdle(drain_deadline)) {
      LogLine("drain timeout: the calls still in flight stop and answer UNAVAILABLE");
      service_->CutShortCallsInFlight();
      service_->WaitForIdle(absl::Now() + kCutShortWait);
    }
    // gRPC 1.51 ends a call whose request is still arriving when the server
    // stops with CANCELLED, which clients do not retry. Stop once calls have
    // stopped coming (the proxies and balancers have seen NOT_SERVING), or
    // at the drain timeout.
    // The HTTP port: new requests get 503, those in flight (their calls have
    // finished or been cut short above) send their answers.
    if (http_ != nullptr) {
      http_->Drain(std::max(drain_deadline, absl::Now() + kCutShortWait));
    }
    if (!service_->WaitForQuiet(kQuietPeriod, drain_deadline)) {
      LogLine("drain timeout: calls still arriving; those whose requests are still in transit "
              "end CANCELLED");
    }
    // 3. Loads: the one in progress finishes, queued ones answer UNAVAILABLE,
    //    so no LoadModel call is left unfinished when the server stops.
    if (loader_ != nullptr) loader_->Shutdown();
    // 4. Stop: GOAWAY (clients send new calls elsewhere); calls that arrived
    //    since step 2 have been answered UNAVAILABLE and get kShutdownGrace for
    //    their answers to leave, then what is left (health Watch streams) is
    //    cancelled.
    http_.reset();  // stops listening; before the server its channel calls
    server_->GetHealthCheckService()->Shutdown();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
  }
  // Loads finish before the executor their warm-up runs on stops.
  if (loader_ != nullptr) loader_->Shutdown();  // idempotent
  if (executor_ != nullptr) executor_->Shutdown();
}

}  // namespace attnserve::server
