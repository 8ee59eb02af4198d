#ifndef ATTNSERVE_SERVER_SERVER_OPTIONS_H_
#define ATTNSERVE_SERVER_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

namespace attnserve::server {

// What one Attend request may ask for. Over a limit: RESOURCE_EXHAUSTED.
struct RequestLimits {
  int64_t max_batch = 64;
  // Scores take num_heads x seq^2 x 4 bytes of scratch per sequence: 192 MiB
  // for the built-in model at 2048.
  int64_t max_seq_len = 2048;
  int64_t max_attention_map_bytes = int64_t{64} << 20;
};

struct ServerOptions {
  // host:port to serve gRPC on; port 0 picks a free port (see AttnServer::port).
  std::string listen_address = "0.0.0.0:50051";
  int64_t max_receive_message_bytes = int64_t{64} << 20;
  int64_t max_send_message_bytes = int64_t{128} << 20;
  // OpenMP threads for the compute executor; 0: one per core.
  int compute_threads = 0;
  // Requests admitted and waiting for the compute executor.
  int64_t max_queued_requests = 64;
  // On shutdown, how long calls in flight may take to finish before they are
  // cancelled.
  double drain_timeout_seconds = 30;
  // Seed of the built-in model's weights (see docs/seeded_weights.md).
  uint64_t builtin_model_seed = 0;
  RequestLimits limits;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SERVER_OPTIONS_H_
