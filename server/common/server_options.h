#ifndef ATTNSERVE_SERVER_COMMON_SERVER_OPTIONS_H_
#define ATTNSERVE_SERVER_COMMON_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/attention_inputs.h"

namespace attnserve::server {

// What one Attend request may ask for. Over a limit: INVALID_ARGUMENT naming
// the flag (such a request can never succeed on this server).
struct RequestLimits {
  int64_t max_batch = 64;
  int64_t max_seq_len = 2048;
  int64_t max_attention_map_bytes = int64_t{64} << 20;
  // The most weight bytes (as FP32) of an ad-hoc layer a request may carry or
  // ask to be seeded: 64 MiB holds a d_model 2048 layer.
  int64_t max_adhoc_weight_bytes = int64_t{64} << 20;
  // The most compute scratch one request may need: its route's scratch
  // (core::MakeRoute; projections, then per chunk of sequences the
  // materialized scores and masks, or the blocked path's per-thread blocks). Requests with maps or statistics at long sequences and ad-hoc
  // layers with very many or very wide heads reach it; the blocked path
  // stays far below it.
  int64_t max_scratch_bytes = int64_t{2} << 30;
  // The most memory one request may hold while it runs (AttendPlan's
  // memory_bytes: inputs, scratch, output, maps, response), estimated from
  // validated sizes before anything is allocated for it.
  int64_t max_request_bytes = int64_t{3} << 30;
};

// The server's limits on decode sessions (flags of the same names).
struct SessionLimits {
  // The KV cache's memory: every session's blocks together (--kv_cache_bytes).
  int64_t kv_cache_bytes = int64_t{1} << 30;
  // Tokens per KV block (--kv_block_tokens).
  int block_tokens = 32;
  // Sessions open at once (--max_sessions); at the limit, opening one evicts
  // the least recently used idle session.
  int64_t max_sessions = 1024;
  // Tokens a layer of a session may hold (--max_session_tokens); a session
  // may ask for fewer.
  int64_t max_session_tokens = 32768;
  // A session's idle time-to-live when it asks for none, and the most it may
  // ask for (--session_ttl_seconds, --max_session_ttl_seconds).
  absl::Duration default_idle_ttl = absl::Minutes(5);
  absl::Duration max_idle_ttl = absl::Hours(1);
  // Per caller (bearer token) quotas; 0: none (--max_sessions_per_token,
  // --max_kv_bytes_per_token).
  int64_t max_sessions_per_owner = 0;
  int64_t max_kv_bytes_per_owner = 0;
};

struct ServerOptions {
  // host:port to serve gRPC on; port 0 picks a free port (see AttnServer::port).
  std::string listen_address = "0.0.0.0:50051";
  // Named in every response's `attnserve-replica` header (the attnserve
  // binary: --replica_name, default the host name). Empty: no header.
  std::string replica_name;
  int64_t max_receive_message_bytes = int64_t{64} << 20;
  int64_t max_send_message_bytes = int64_t{128} << 20;
  // OpenMP threads for the compute executor; 0: one per core.
  int compute_threads = 0;
  // Which kernels run the blocked attention path's blocks (the attnserve
  // binary reads it from ATTNSERVE_BLOCK_KERNELS at start-up).
  core::BlockKernels block_kernels = core::BlockKernels::kAuto;
  // Requests admitted and waiting for the compute executor.
  int64_t max_queued_requests = 64;
  // On shutdown, how long health says NOT_SERVING while the server still
  // listens (new calls get UNAVAILABLE), so checkers and balancers notice.
  double lame_duck_seconds = 1;
  // On shutdown, how long calls in flight may take to finish before they are
  // cancelled, counted from the signal. Below Kubernetes' default 30 s grace.
  double drain_timeout_seconds = 25;
  // Seed of the built-in model's weights (see docs/seeded_weights.md).
  uint64_t builtin_model_seed = 0;
  // host:port serving Prometheus metrics at /metrics; port 0 picks a free
  // port (see AttnServer::metrics_port). Empty: no endpoint. Off here, so an
  // embedding program or a test opens no port it did not ask for; the
  // attnserve binary's --metrics_address defaults to kDefaultMetricsAddress.
  std::string metrics_address;
  // Threads of the metrics endpoint: each serves one HTTP connection at a
  // time, and a connection whose request headers are not complete within
  // 5 s (MetricsOptions::kRequestTimeoutMs) is closed, so /metrics keeps answering while
  // fewer connections than this dribble their headers.
  int metrics_threads = 256;
  // host:port of the HTTP port (server/http): the Open Inference Protocol's
  // REST form; port 0 picks a free port (see AttnServer::http_port). Empty:
  // no HTTP port (the default here and in the attnserve binary).
  std::string http_address;
  // Connections the HTTP port serves at once (a thread each); more wait in a
  // queue (HttpFrontOptions).
  int http_threads = 16;
  // Largest HTTP request body (413 beyond, before it is read).
  int64_t http_max_body_bytes = int64_t{64} << 20;
  // An HTTP request's headers must be complete this long after its first
  // byte, every read and write (body, answer) must progress within it, and
  // its body must arrive within it plus a second per MiB.
  int http_request_timeout_ms = 30000;
  // Host names (besides localhost, 127.0.0.1, [::1] and --http_address's
  // host) that the HTTP port's browser-facing routes (the attention explorer,
  // /explorer) accept in the Host header; others get 403 (DNS rebinding).
  std::vector<std::string> http_allowed_hosts;
  // The attention explorer's page files are read from this folder at each
  // request instead of those built into the binary (for editing the page
  // without rebuilding). Empty: the built-in files.
  std::string explorer_web_dir;
  // One JSON line per call on stderr (server/observability/access_log.h).
  bool access_log = false;
  // TLS on the gRPC port: PEM certificate chain and private key. Both empty:
  // plaintext (a warning is logged at start-up).
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA bundle: when set (needs TLS), clients must present a certificate
  // signed by it (mutual TLS).
  std::string tls_client_ca_file;
  // Bearer tokens (server/security/auth.h): when set, every AttentionService call
  // needs "authorization: Bearer <token>"; health and reflection stay open.
  std::string auth_tokens_file;
  RequestLimits limits;
  // Decode sessions (server/sessions/session_manager.h).
  SessionLimits sessions;
  // A model repository (server/models/model_repository.h): every model folder in it
  // is loaded at start-up, and LoadModel / UnloadModel manage them at run
  // time. Empty: the built-in model serves.
  std::string model_repository;
  // Dynamic batching (server/scheduling/scheduler.h): the most query tokens one compute
  // batch may hold (0 or 1: no batching), and how long a batch that is not
  // full may wait for more requests (0: it takes what is queued when the
  // executor is free).
  int64_t max_batch_tokens = 4096;
  int64_t max_queue_delay_us = 0;
  // Decode sessions: an Extend step of more new tokens (a long prefill) is
  // computed in chunks of at most this many (and at most the work of such a
  // chunk at the start of a sequence: PrefillChunkTokens), going back into
  // the compute queue between chunks so that decode steps queued behind it
  // run in between (or join its chunks' batches); above limits.max_seq_len it
  // acts as max_seq_len. 0: each step in one piece, at most --max_seq_len
  // tokens. 256: with 32 sessions decoding at context 2048 on the built-in
  // model, a 4096-token prefill arriving kept the decode steps' p99 within
  // 2x of their p99 without it (six runs), where plain 512-token chunks let
  // it reach 2.3-4.7x
  // (docs/measurements.md, "Decode steps beside a long prefill").
  int64_t prefill_chunk_tokens = 256;
  // Bytes that admitted requests (queued or running) may hold together, by
  // their estimates; a request that does not fit beside the admitted ones is
  // RESOURCE_EXHAUSTED (retry later), one larger than all of it INVALID_ARGUMENT.
  int64_t max_inflight_bytes = int64_t{6} << 30;
  // Most bytes a repository model's weights may take (as the checkpoint's
  // header declares them, checked before anything is read or allocated); a
  // model over it is FAILED with that reason while the others serve.
  int64_t max_model_bytes = int64_t{4} << 30;
  // The hostile-network defences (SECURITY.md, "What the hostile-client suite
  // shows"). Most concurrent calls on one HTTP/2 connection.
  int max_concurrent_streams = 100;
  // A connection with no call open for this long is closed (GOAWAY).
  int64_t max_connection_idle_seconds = 300;
  // A connection is closed after this long, open calls given
  // max_connection_age_grace_seconds to finish; 0: no age limit.
  int64_t max_connection_age_seconds = 0;
  int64_t max_connection_age_grace_seconds = 30;
  // Bytes gRPC's transport may hold for all connections together (its
  // resource quota: read buffers, flow-control windows).
  int64_t max_transport_bytes = int64_t{1} << 30;
  // The start-up raises the soft RLIMIT_NOFILE to the hard limit and refuses
  // to start when it stays below this many.
  int64_t min_open_files = 4096;
  // The watchdog: every watchdog_interval_seconds it opens a connection to
  // the gRPC port; when `watchdog_failures` probes in a row get no answer (the
  // listener no longer accepts), or the process' RSS stays above
  // max_rss_bytes (0: no bound) as long, health turns NOT_SERVING and the
  // process exits non-zero so that its supervisor restarts it. 0: no watchdog.
  double watchdog_interval_seconds = 5;
  int watchdog_failures = 3;
  int64_t max_rss_bytes = 0;
  // Freed memory the allocator may keep for the next calls (jemalloc builds;
  // server/allocator_cache.h): over it, all of it is given back (checked every
  // 250 ms), and likewise (with the compute workspace's scratch) after
  // allocator_cache_idle_ms without calls.
  int64_t max_allocator_cache_bytes = int64_t{512} << 20;
  int64_t allocator_cache_idle_ms = 2000;
};

// The attnserve binary's default --metrics_address. Not Prometheus' own 9090:
// a Prometheus server on the same host (Debian's package starts one) would
// take it.
inline constexpr char kDefaultMetricsAddress[] = "0.0.0.0:9464";

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_COMMON_SERVER_OPTIONS_H_
