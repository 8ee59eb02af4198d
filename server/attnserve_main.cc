// attnserve: the multi-head attention gRPC server.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/build_info.h"
#include "cli/command_line.h"
#include "core/runtime_info.h"
#include "core/workspace.h"
#include "server/attn_server.h"
#include "server/openmp_wait.h"
#include "server/process_guard.h"
#include "server/common/server_options.h"
#include "server/observability/log.h"

namespace {
const attnserve::server::ServerOptions kDefaults;
// The watchdog stopped the server (see --watchdog_interval_seconds).
constexpr int kExitWatchdog = 3;
// --openmp_spin_us above this is a spin that outlasts most requests: PASSIVE's
// opposite, which the environment can still ask for (OMP_WAIT_POLICY=ACTIVE).
constexpr int64_t kMaxOpenMpSpinUs = 100000;

constexpr char kUsage[] = R"(attnserve: serves multi-head attention over gRPC
(attnserve.v1.AttentionService, grpc.health.v1.Health, server reflection) and,
with --http_address, the Open Inference Protocol's REST form over HTTP and
the attention explorer, a page for looking at heads (http://<address>/explorer/).

Usage: attnserve [--listen_address=0.0.0.0:50051] [flags]
Stops on SIGTERM or SIGINT: health turns NOT_SERVING, calls in flight finish,
and the process exits 0.
Exit status: 0 after a stop by signal (and for --help, --version); 1 when the
server cannot start or load its models; 2 for a mistake on the command line;
3 when the watchdog stopped it (the gRPC port no longer accepted connections,
or memory stayed over --max_rss_bytes): its supervisor should restart it.
OpenMP threads sleep between requests (OMP_WAIT_POLICY=PASSIVE) unless
--openmp_spin_us asks for a spin or the environment sets OMP_WAIT_POLICY or
GOMP_SPINCOUNT.)";

// The --version lines after the version, revision and build type.
std::vector<attnserve::cli::Component> LibraryVersions() {
  return {{"oneDNN", attnserve::core::GetRuntimeInfo().onednn_version}, {"gRPC", grpc::Version()}};
}
}  // namespace

ABSL_FLAG(std::string, listen_address, kDefaults.listen_address,
          "host:port to serve gRPC on (port 0 picks a free port, printed at start-up)");
ABSL_FLAG(std::string, replica_name, "",
          "Name sent in every response's attnserve-replica header, so clients behind a proxy "
          "see which replica served a call (decode sessions live on one); empty: the host name");
ABSL_FLAG(int64_t, max_receive_message_bytes, kDefaults.max_receive_message_bytes,
          "Largest request message accepted, in bytes");
ABSL_FLAG(int64_t, max_send_message_bytes, kDefaults.max_send_message_bytes,
          "Largest response message sent, in bytes; requests whose output and maps would be "
          "larger are refused before compute (INVALID_ARGUMENT)");
ABSL_FLAG(int, compute_threads, kDefaults.compute_threads,
          "Threads the compute executor gives oneDNN (0: one per core)");
ABSL_FLAG(int64_t, openmp_spin_us, 0,
          "How long (microseconds) the compute threads spin waiting for the next parallel region "
          "before they sleep, timed with the spin loop's cost measured at start (GOMP_SPINCOUNT "
          "set to match, whatever the CPU's pause costs); 0: sleep at once "
          "(OMP_WAIT_POLICY=PASSIVE). On 2 shared cores no spin measured better than 0; on a quiet "
          "machine a spin of about 20 us helped a 32-session decode step and lone small requests "
          "(docs/measurements.md). libgomp cuts any spin to ~100 iterations while it runs more "
          "threads than CPUs (--compute_threads above the cores). Ignored when the environment sets "
          "OMP_WAIT_POLICY or GOMP_SPINCOUNT");
ABSL_FLAG(int64_t, max_queued_requests, kDefaults.max_queued_requests,
          "Requests that may wait for the compute executor; more are refused "
          "(RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_batch, kDefaults.limits.max_batch, "Most sequences in one request");
ABSL_FLAG(int64_t, max_seq_len, kDefaults.limits.max_seq_len, "Longest sequence in a request");
ABSL_FLAG(int64_t, max_attention_map_bytes, kDefaults.limits.max_attention_map_bytes,
          "Most bytes of attention maps one request may ask for");
ABSL_FLAG(int64_t, max_adhoc_weight_bytes, kDefaults.limits.max_adhoc_weight_bytes,
          "Most weight bytes (as FP32) of an ad-hoc layer a request may carry or ask to be seeded");
ABSL_FLAG(int64_t, max_scratch_bytes, kDefaults.limits.max_scratch_bytes,
          "Most compute scratch one request may need (estimated before compute); more is "
          "INVALID_ARGUMENT");
ABSL_FLAG(int64_t, max_request_bytes, kDefaults.limits.max_request_bytes,
          "Most memory one request may hold while it runs (inputs, activations, scores, maps, "
          "response; estimated before compute); more is INVALID_ARGUMENT");
ABSL_FLAG(int64_t, max_inflight_bytes, kDefaults.max_inflight_bytes,
          "Most memory the admitted requests (queued or running) may hold together, by their "
          "estimates; a request that does not fit beside them is RESOURCE_EXHAUSTED (retry "
          "later), one larger than all of it INVALID_ARGUMENT");
ABSL_FLAG(int64_t, max_batch_tokens, kDefaults.max_batch_tokens,
          "Dynamic batching: most query tokens in one compute batch of compatible requests "
          "(same model, precision and causal flag; no maps, statistics or masks); 0: no batching");
ABSL_FLAG(int64_t, max_queue_delay_us, kDefaults.max_queue_delay_us,
          "Dynamic batching: how long (microseconds) a batch that is not full may wait for more "
          "requests; 0: a batch is what is queued when the executor is free");
ABSL_FLAG(int64_t, prefill_chunk_tokens, kDefaults.prefill_chunk_tokens,
          "Decode sessions: an Extend step of more new tokens (a long prefill) is computed in chunks "
          "of at most this many, each at most the work of such a chunk at the start of a sequence "
          "(later chunks, attending to more keys, are shorter), decode steps of other sessions "
          "running between its chunks (a value over "
          "--max_seq_len acts as --max_seq_len); 0: each step in one piece (at most --max_seq_len tokens)");
ABSL_FLAG(double, lame_duck_seconds, kDefaults.lame_duck_seconds,
          "On SIGTERM/SIGINT, how long health says NOT_SERVING while the server still listens");
ABSL_FLAG(double, drain_timeout_seconds, kDefaults.drain_timeout_seconds,
          "On SIGTERM/SIGINT, how long calls in flight may take to finish after the lame duck (those "
          "left then answer UNAVAILABLE); a second signal stops at once");
ABSL_FLAG(uint64_t, builtin_model_seed, kDefaults.builtin_model_seed,
          "Seed of the built-in model's weights (docs/seeded_weights.md)");
ABSL_FLAG(std::string, metrics_address, attnserve::server::kDefaultMetricsAddress,
          "host:port serving Prometheus metrics at /metrics (port 0 picks a free port, printed "
          "at start-up); empty: no metrics endpoint");
ABSL_FLAG(int, metrics_threads, kDefaults.metrics_threads,
          "Threads serving the metrics port, one connection each; a connection that has not sent "
          "its request headers within 5 s is closed");
ABSL_FLAG(std::string, http_address, kDefaults.http_address,
          "host:port of the HTTP port serving the Open Inference Protocol's REST form (/v2/...) "
          "and the attention explorer (open http://<host:port>/explorer/ in a browser; port 0 "
          "picks a free port, printed at start-up); empty (the default): no HTTP port. 0.0.0.0 "
          "exposes it on every interface (SECURITY.md)");
ABSL_FLAG(std::vector<std::string>, http_allowed_hosts, {},
          "Comma-separated host names the attention explorer (/explorer) accepts in the Host "
          "header besides localhost, 127.0.0.1, [::1] and --http_address's host, e.g. "
          "attn.lab.example when the port is reached by that name; any other Host gets 403 "
          "(a defence against DNS rebinding). The /v2 routes accept any Host");
ABSL_FLAG(std::string, explorer_web_dir, "",
          "Development: serve the attention explorer's page files (/explorer/...) from this "
          "folder, read at each request, instead of those built into the binary, so the page "
          "(server/explorer/web) can be edited without rebuilding. Empty (the default): the "
          "built-in files");
ABSL_FLAG(int, http_threads, kDefaults.http_threads,
          "Connections the HTTP port serves at once (a thread each); more wait in a short queue");
ABSL_FLAG(int64_t, http_max_body_bytes, kDefaults.http_max_body_bytes,
          "Largest HTTP request body in bytes; larger ones get 413 before they are read");
ABSL_FLAG(int, http_request_timeout_ms, kDefaults.http_request_timeout_ms,
          "An HTTP request's headers must be complete this many ms after its first byte, every "
          "read and write (body, answer) must progress within it, and its body must arrive within "
          "it plus a second per MiB; the connection is closed otherwise");
ABSL_FLAG(bool, access_log, kDefaults.access_log,
          "Log one JSON line per call to stderr (request id, method, model, shapes, status, "
          "queue and compute time)");

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for TLS on the gRPC port (with --tls_key); empty: plaintext");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert (unencrypted)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: clients must present a certificate signed by it (mutual TLS; needs "
          "--tls_cert)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "File of bearer tokens, one per line ('admin:<token>' marks an admin token; blank lines "
          "and # comments ignored): every AttentionService call then needs 'authorization: "
          "Bearer <token>' (health, reflection and the Open Inference Protocol's ServerLive and "
          "ServerReady stay open)");

ABSL_FLAG(int64_t, max_model_bytes, kDefaults.max_model_bytes,
          "Most bytes of weights one repository model may hold, as its checkpoint's header declares "
          "them (checked before reading); a model over it is FAILED while the others serve");
ABSL_FLAG(int, max_concurrent_streams, kDefaults.max_concurrent_streams,
          "Most calls open at once on one client connection (HTTP/2 streams)");
ABSL_FLAG(int64_t, max_connection_idle_seconds, kDefaults.max_connection_idle_seconds,
          "A connection with no call open for this long is closed");
ABSL_FLAG(int64_t, max_connection_age_seconds, kDefaults.max_connection_age_seconds,
          "A connection is closed after this long (its calls get "
          "--max_connection_age_grace_seconds to finish); 0: no age limit");
ABSL_FLAG(int64_t, max_connection_age_grace_seconds, kDefaults.max_connection_age_grace_seconds,
          "How long the calls of a connection closed for its age may take to finish");
ABSL_FLAG(int64_t, max_transport_bytes, kDefaults.max_transport_bytes,
          "Most bytes gRPC's transport may buffer for all connections together (resource quota)");
ABSL_FLAG(int64_t, min_open_files, kDefaults.min_open_files,
          "Start-up raises the open-file limit (RLIMIT_NOFILE) to its hard limit and refuses to "
          "start when that is below this");
ABSL_FLAG(double, watchdog_interval_seconds, kDefaults.watchdog_interval_seconds,
          "How often the watchdog checks that the gRPC port still accepts connections and that "
          "memory is within --max_rss_bytes; 0: no watchdog");
ABSL_FLAG(int, watchdog_failures, kDefaults.watchdog_failures,
          "Failed watchdog checks in a row after which the server turns NOT_SERVING and exits "
          "non-zero (exit code 3) for its supervisor to restart it");
ABSL_FLAG(int64_t, max_allocator_cache_bytes, kDefaults.max_allocator_cache_bytes,
          "Freed memory the allocator may keep for reuse by the next calls (no page faults for "
          "their buffers); over it, all of it is given back to the system (checked 4 times a "
          "second), and likewise after --allocator_cache_idle_ms without calls. 0: give it back "
          "at every check");
ABSL_FLAG(int64_t, allocator_cache_idle_ms, kDefaults.allocator_cache_idle_ms,
          "Milliseconds without calls after which the allocator's cache and the compute "
          "scratch are given back to the system (the next call then pays page faults for its "
          "buffers)");
ABSL_FLAG(int64_t, max_rss_bytes, kDefaults.max_rss_bytes,
          "Resident memory above which the watchdog counts a failed check; 0: no bound");

ABSL_FLAG(int64_t, kv_cache_bytes, kDefaults.sessions.kv_cache_bytes,
          "Decode sessions: most bytes the KV cache (every session's keys and values) may hold; "
          "a step that needs more evicts idle sessions, least recently used first");
ABSL_FLAG(int, kv_block_tokens, kDefaults.sessions.block_tokens,
          "Decode sessions: tokens per KV cache block");
ABSL_FLAG(int64_t, max_sessions, kDefaults.sessions.max_sessions,
          "Decode sessions open at once; opening one more evicts the least recently used idle one");
ABSL_FLAG(int64_t, max_session_tokens, kDefaults.sessions.max_session_tokens,
          "Decode sessions: most tokens a layer of a session may hold (a session may ask for fewer)");
ABSL_FLAG(double, session_ttl_seconds, absl::ToDoubleSeconds(kDefaults.sessions.default_idle_ttl),
          "Decode sessions: idle time after which a session ends, unless it asks for another");
ABSL_FLAG(double, max_session_ttl_seconds, absl::ToDoubleSeconds(kDefaults.sessions.max_idle_ttl),
          "Decode sessions: the longest idle time-to-live a session may ask for");
ABSL_FLAG(int64_t, max_sessions_per_token, kDefaults.sessions.max_sessions_per_owner,
          "Decode sessions one bearer token may hold open (0: no quota)");
ABSL_FLAG(int64_t, max_kv_bytes_per_token, kDefaults.sessions.max_kv_bytes_per_owner,
          "KV cache bytes one bearer token's sessions may hold (0: no quota)");

ABSL_FLAG(std::string, model_repository, "",
          "Folder of models (one subfolder each: config.json and safetensors weights; README "
          "'Model repository'): all are loaded at start-up, LoadModel/UnloadModel manage them. "
          "Empty: the built-in model serves");
// How the compute executor's OpenMP threads wait between parallel regions
// (server/openmp_wait.h): libgomp reads its environment when it is loaded, so
// the choice is made here, before any OpenMP code runs, and the binary runs
// again with it, unless the caller's environment chose already. Threads that
// spin long between requests take the cores from gRPC's threads (on 2 cores
// libgomp's default spin made the p99 of small requests 20-100x worse,
// docs/measurements.md "Thread arrangement"); threads that sleep at once pay a
// wake-up at every parallel region of a forward ("A spin bounded in time").
// The second start finds the variable set and logs the first's reason, which
// it receives in ATTNSERVE_OPENMP_WAIT_CHOICE as "<pid> <reason>" (execv keeps
// the pid): a value of another process's (an environment copied from a running
// server's) is not believed.
constexpr char kOpenMpWaitChoiceVariable[] = "ATTNSERVE_OPENMP_WAIT_CHOICE";

void ChooseOpenMpWait(char** argv) {
  const attnserve::server::OpenMpWaitPlan plan = attnserve::server::PlanOpenMpWait(
      std::getenv("OMP_WAIT_POLICY"), std::getenv("GOMP_SPINCOUNT"),
      absl::Microseconds(absl::GetFlag(FLAGS_openmp_spin_us)), attnserve::server::MeasurePauseCost);
  if (plan.environment.empty()) return;
  for (const auto& [name, value] : plan.environment) {
    setenv(name.c_str(), value.c_str(), /*overwrite=*/1);
  }
  setenv(kOpenMpWaitChoiceVariable, absl::StrCat(getpid(), " ", plan.description).c_str(),
         /*overwrite=*/1);
  execv("/proc/self/exe", argv);
  // exec failed: carry on with libgomp's default policy (the log says so).
  for (const auto& [name, value] : plan.environment) unsetenv(name.c_str());
  unsetenv(kOpenMpWaitChoiceVariable);
}

// The start-up log's line on the OpenMP wait: the first start's choice (taken
// out of the environment), or what the environment set.
std::string TakeOpenMpWaitDescription() {
  if (const char* handed = std::getenv(kOpenMpWaitChoiceVariable); handed != nullptr) {
    const std::pair<std::string, std::string> parts = absl::StrSplit(handed, absl::MaxSplits(' ', 1));
    unsetenv(kOpenMpWaitChoiceVariable);
    int64_t pid = 0;
    if (absl::SimpleAtoi(parts.first, &pid) && pid == getpid()) return parts.second;
  }
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin_count = std::getenv("GOMP_SPINCOUNT");
  if (wait_policy == nullptr && spin_count == nullptr) {
    return "OpenMP wait policy: libgomp's default (the server could not run itself again with "
           "its choice)";
  }
  return attnserve::server::PlanOpenMpWait(wait_policy, spin_count, absl::ZeroDuration(), nullptr)
      .description;
}

// The server's options from the flags and, for the block kernels, the
// environment (ATTNSERVE_BLOCK_KERNELS, read once here). INVALID_ARGUMENT
// naming the variable when its value is unknown.
absl::StatusOr<attnserve::server::ServerOptions> OptionsFromFlags() {
  attnserve::server::ServerOptions options;
  if (const char* kernels = std::getenv("ATTNSERVE_BLOCK_KERNELS"); kernels != nullptr) {
    absl::StatusOr<attnserve::core::BlockKernels> parsed =
        attnserve::core::ParseBlockKernels(kernels);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ATTNSERVE_BLOCK_KERNELS: ", parsed.status().message()));
    }
    options.block_kernels = *parsed;
  }
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.replica_name = absl::GetFlag(FLAGS_replica_name);
  if (options.replica_name.empty()) {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) == 0) options.replica_name = host;
  }
  if (options.replica_name.size() > 253 ||
      !std::all_of(options.replica_name.begin(), options.replica_name.end(),
                   [](char c) { return c >= 0x21 && c <= 0x7e; })) {
    return absl::InvalidArgumentError(
        "--replica_name: at most 253 printable ASCII characters without spaces (it travels as a "
        "response header)");
  }
  options.max_receive_message_bytes = absl::GetFlag(FLAGS_max_receive_message_bytes);
  options.max_send_message_bytes = absl::GetFlag(FLAGS_max_send_message_bytes);
  options.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  options.limits.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.limits.max_seq_len = absl::GetFlag(FLAGS_max_seq_len);
  options.limits.max_attention_map_bytes = absl::GetFlag(FLAGS_max_attention_map_bytes);
  options.limits.max_adhoc_weight_bytes = absl::GetFlag(FLAGS_max_adhoc_weight_bytes);
  options.limits.max_scratch_bytes = absl::GetFlag(FLAGS_max_scratch_bytes);
  options.limits.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  options.prefill_chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens);
  options.lame_duck_seconds = absl::GetFlag(FLAGS_lame_duck_seconds);
  options.drain_timeout_seconds = absl::GetFlag(FLAGS_drain_timeout_seconds);
  options.builtin_model_seed = absl::GetFlag(FLAGS_builtin_model_seed);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.metrics_threads = absl::GetFlag(FLAGS_metrics_threads);
  options.http_address = absl::GetFlag(FLAGS_http_address);
  options.http_threads = absl::GetFlag(FLAGS_http_threads);
  options.http_max_body_bytes = absl::GetFlag(FLAGS_http_max_body_bytes);
  options.http_request_timeout_ms = absl::GetFlag(FLAGS_http_request_timeout_ms);
  options.http_allowed_hosts = absl::GetFlag(FLAGS_http_allowed_hosts);
  options.explorer_web_dir = absl::GetFlag(FLAGS_explorer_web_dir);
  options.access_log = absl::GetFlag(FLAGS_access_log);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  options.model_repository = absl::GetFlag(FLAGS_model_repository);
  options.max_model_bytes = absl::GetFlag(FLAGS_max_model_bytes);
  options.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  options.max_connection_idle_seconds = absl::GetFlag(FLAGS_max_connection_idle_seconds);
  options.max_connection_age_seconds = absl::GetFlag(FLAGS_max_connection_age_seconds);
  options.max_connection_age_grace_seconds = absl::GetFlag(FLAGS_max_connection_age_grace_seconds);
  options.max_transport_bytes = absl::GetFlag(FLAGS_max_transport_bytes);
  options.min_open_files = absl::GetFlag(FLAGS_min_open_files);
  options.watchdog_interval_seconds = absl::GetFlag(FLAGS_watchdog_interval_seconds);
  options.watchdog_failures = absl::GetFlag(FLAGS_watchdog_failures);
  options.max_rss_bytes = absl::GetFlag(FLAGS_max_rss_bytes);
  options.sessions.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  options.sessions.block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  options.sessions.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.sessions.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  options.sessions.default_idle_ttl = absl::Seconds(absl::GetFlag(FLAGS_session_ttl_seconds));
  options.sessions.max_idle_ttl = absl::Seconds(absl::GetFlag(FLAGS_max_session_ttl_seconds));
  options.sessions.max_sessions_per_owner = absl::GetFlag(FLAGS_max_sessions_per_token);
  options.sessions.max_kv_bytes_per_owner = absl::GetFlag(FLAGS_max_kv_bytes_per_token);
  options.max_allocator_cache_bytes = absl::GetFlag(FLAGS_max_allocator_cache_bytes);
  options.allocator_cache_idle_ms = absl::GetFlag(FLAGS_allocator_cache_idle_ms);
  return options;
}

// What the server runs with and what it leaves open, logged at start-up.
void LogConfiguration(const attnserve::server::ServerOptions& options,
                      const attnserve::server::AttnServer& server,
                      const std::string& openmp_wait) {
  using attnserve::server::LogLine;
  LogLine(openmp_wait);
  LogLine(absl::StrCat("oneDNN's own primitive cache holds ",
                       attnserve::core::OneDnnPrimitiveCacheCapacity(),
                       " primitives (0 unless the environment sets "
                       "ONEDNN_PRIMITIVE_CACHE_CAPACITY; the compute worker caches its own)"));
  if (options.tls_cert_file.empty()) {
    LogLine("WARNING: serving plaintext gRPC (no --tls_cert): anyone on the network can read and "
            "alter calls");
  } else {
    LogLine(options.tls_client_ca_file.empty()
                ? "serving gRPC over TLS"
                : "serving gRPC over mutual TLS (client certificates required)");
  }
  if (options.auth_tokens_file.empty()) {
    LogLine("AttentionService calls are not authenticated (no --auth_tokens_file)");
  } else {
    LogLine("AttentionService calls need a bearer token (--auth_tokens_file)");
  }
  if (!options.model_repository.empty() && options.auth_tokens_file.empty()) {
    LogLine("WARNING: LoadModel/UnloadModel are open to every client (no --auth_tokens_file)");
  }
  if (options.limits.max_request_bytes > options.max_inflight_bytes) {
    LogLine("WARNING: --max_request_bytes is over --max_inflight_bytes: requests between the two "
            "are always refused");
  }
  if (options.http_address.empty()) {
    LogLine("HTTP port off (no --http_address)");
  } else {
    LogLine(absl::StrCat("HTTP on port ", server.http_port(), " (", options.http_address,
                         "): the Open Inference Protocol's REST form under /v2, the attention explorer "
                         "at /explorer/"));
  }
  if (options.metrics_address.empty()) {
    LogLine("metrics endpoint off (--metrics_address is empty)");
  } else {
    LogLine(absl::StrCat("metrics on port ", server.metrics_port(), " (",
                         options.metrics_address, "), path /metrics"));
  }
}

// Serves until a stop signal (false) or the watchdog's trip (true), then
// drains. A stop signal during a signal's drain exits at once; during the
// watchdog's drain the first (its supervisor's) is let through, a second
// exits at once.
bool ServeUntilStopped(const attnserve::server::ServerOptions& options,
                       attnserve::server::AttnServer& server, const sigset_t& stop_signals) {
  namespace cli = attnserve::cli;
  using attnserve::server::LogLine;
  // The watchdog ends a server that can no longer serve (exit 3), so that its
  // supervisor restarts it; a stop signal ends it as usual (exit 0).
  absl::Notification tripped;
  std::string trip_reason;  // written before tripped is notified
  std::atomic<bool> stopping{false};  // a trip after the stop began is ignored
  std::unique_ptr<attnserve::server::Watchdog> watchdog;
  if (options.watchdog_interval_seconds > 0) {
    watchdog = std::make_unique<attnserve::server::Watchdog>(attnserve::server::WatchdogOptions{
        .host = attnserve::server::ProbeHost(options.listen_address),
        .port = server.port(),
        .interval = absl::Seconds(options.watchdog_interval_seconds),
        .failures = options.watchdog_failures,
        .max_rss_bytes = options.max_rss_bytes,
        .on_trip =
            [&](const std::string& reason) {
              if (stopping.load()) return;
              trip_reason = reason;
              tripped.Notify();
            },
    });
  }
  const timespec poll = {.tv_sec = 0, .tv_nsec = 100 * 1000 * 1000};
  int signal_number = 0;
  while (!tripped.HasBeenNotified()) {
    signal_number = sigtimedwait(&stop_signals, nullptr, &poll);
    if (signal_number > 0) break;
  }
  stopping.store(true);
  const bool by_watchdog = tripped.HasBeenNotified();
  if (by_watchdog) {
    LogLine(absl::StrCat("watchdog: ", trip_reason, ": NOT_SERVING, draining calls in flight, then "
                         "exiting with status ", kExitWatchdog));
  } else {
    LogLine(absl::StrCat("received ", strsignal(signal_number),
                         ": NOT_SERVING, draining calls in flight (a second signal stops at once)"));
  }
  absl::Notification stopped;
  std::thread drain([&] {
    watchdog.reset();  // its probes would fail from here on
    server.Shutdown();
    stopped.Notify();
  });
  // A stop signal during a signal's drain stops at once; during the
  // watchdog's drain the first one (its supervisor's) lets the drain finish.
  int signals_left = by_watchdog ? 2 : 1;
  while (!stopped.HasBeenNotified()) {
    if (sigtimedwait(&stop_signals, nullptr, &poll) > 0 && --signals_left == 0) {
      LogLine("second stop signal: exiting without draining");
      _exit(by_watchdog ? kExitWatchdog : cli::kExitFailure);
    }
  }
  drain.join();
  return by_watchdog;
}

int main(int argc, char** argv) {
  namespace cli = attnserve::cli;
  // The command line first: --help, --version and mistakes need no OpenMP.
  const absl::StatusOr<cli::CommandLine> command_line = cli::ParseCommandLine(argc, argv);
  if (!command_line.ok()) return cli::UsageError("attnserve", command_line.status().message());
  if (command_line->action == cli::CommandLine::Action::kHelp) {
    std::fputs(cli::HelpText(kUsage).c_str(), stdout);
    return cli::kExitOk;
  }
  if (command_line->action == cli::CommandLine::Action::kVersion) {
    std::fputs(cli::VersionText("attnserve", LibraryVersions()).c_str(), stdout);
    return cli::kExitOk;
  }
  if (!command_line->positional.empty()) {
    return cli::UsageError("attnserve", absl::StrCat("unexpected argument '",
                                                     command_line->positional[0],
                                                     "' (attnserve takes only flags)"));
  }
  if (const int64_t spin_us = absl::GetFlag(FLAGS_openmp_spin_us);
      spin_us < 0 || spin_us > kMaxOpenMpSpinUs) {
    return cli::UsageError("attnserve", absl::StrCat("--openmp_spin_us must be 0 to ",
                                                     kMaxOpenMpSpinUs, ", not ", spin_us));
  }
  ChooseOpenMpWait(argv);
  const std::string openmp_wait = TakeOpenMpWaitDescription();
  const absl::Time process_start = absl::Now();
  attnserve::server::LimitProtobufLogs();

  absl::StatusOr<attnserve::server::ServerOptions> options_or = OptionsFromFlags();
  if (!options_or.ok()) return cli::UsageError("attnserve", options_or.status().message());
  const attnserve::server::ServerOptions& options = *options_or;

  // Block the stop signals before any thread starts, so every thread inherits
  // the mask and only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  using attnserve::server::LogLine;
  // Before any thread starts: many client connections must not run the
  // process out of descriptors.
  const absl::StatusOr<int64_t> open_files =
      attnserve::server::RaiseOpenFileLimit(options.min_open_files);
  if (!open_files.ok()) {
    LogLine(absl::StrCat("cannot start: ", open_files.status().message()));
    return cli::kExitFailure;
  }
  // What runs, as --version and attnserve_build_info say it.
  const attnserve::core::RuntimeInfo runtime = attnserve::core::GetRuntimeInfo();
  LogLine(absl::StrCat("attnserve ", cli::Version(), " (revision ", cli::Revision(), ", ",
                       cli::BuildType(), " build), oneDNN ", runtime.onednn_version, " on ",
                       runtime.cpu_isa, ", gRPC ", grpc::Version()));
  absl::StatusOr<std::unique_ptr<attnserve::server::AttnServer>> server =
      attnserve::server::AttnServer::Create(options);
  if (!server.ok()) {
    LogLine(absl::StrCat("cannot start: ", server.status().ToString()));
    return cli::kExitFailure;
  }
  LogLine(absl::StrCat("listening on port ", (*server)->port(), " (", options.listen_address,
                       ") as replica '", options.replica_name,
                       "'; health NOT_SERVING until the models are loaded; open-file limit ",
                       *open_files));
  LogConfiguration(options, **server, openmp_wait);
  if (absl::Status loaded = (*server)->LoadModelsAndServe(); !loaded.ok()) {
    LogLine(absl::StrCat("cannot load models: ", loaded.ToString()));
    return cli::kExitFailure;
  }
  LogLine(absl::StrCat("SERVING (", absl::FormatDuration(absl::Now() - process_start),
                       " after start)"));

  const bool by_watchdog = ServeUntilStopped(options, **server, stop_signals);
  LogLine("stopped");
  return by_watchdog ? kExitWatchdog : cli::kExitOk;
}
