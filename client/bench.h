#ifndef ATTNSERVE_CLIENT_BENCH_H_
#define ATTNSERVE_CLIENT_BENCH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "client/attention_client.h"

namespace attnserve::client {

// How `attnctl bench` loads a server. Exactly one of concurrency (closed
// loop) and rate (open loop) is positive.
struct BenchOptions {
  // Closed loop: this many calls outstanding at all times; each completion
  // sends the next call.
  int64_t concurrency = 0;
  // Open loop: calls start at this many per second whatever the answers
  // (latency counts from each call's scheduled start, so a slow server is
  // not hidden by the client waiting for it).
  double rate = 0;
  // Stop after this many calls (0: by duration) ...
  int64_t requests = 0;
  // ... or after this long.
  double duration_seconds = 10;
  // Open loop: calls outstanding at most; a start beyond it is not sent and
  // counted as "CLIENT_BACKLOG" (the client, not the server, is the limit).
  int64_t max_outstanding = 4096;
};

// What a run measured. Latencies in milliseconds, of OK calls.
struct BenchResult {
  std::string mode;  // "closed" or "open"
  int64_t concurrency = 0;
  double rate = 0;
  double elapsed_seconds = 0;
  int64_t sent = 0;
  int64_t ok = 0;
  std::map<std::string, int64_t> errors;  // status code name -> calls
  int64_t tokens_per_request = 0;
  double throughput_rps = 0;  // OK calls per second
  double tokens_per_second = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0, mean_ms = 0;
  // The server's Timing, means over OK calls.
  double server_queue_ms = 0, server_compute_ms = 0, batch_size = 0, batch_tokens = 0;
};

// Progress: calls finished so far, seconds elapsed.
using BenchProgress = std::function<void(int64_t finished, double elapsed_seconds)>;

// OK when `options` make a run; else INVALID_ARGUMENT naming the flag
// (`--concurrency`, `--rate`, `--requests`, `--duration`). Needs no server.
absl::Status ValidateBenchOptions(const BenchOptions& options);

// Sends `request` to the server as `options` says and measures the answers.
// `progress` (optional) is called about ten times a second from another
// thread. INVALID_ARGUMENT (naming the field) for options that do not make a
// run; the calls' own errors are counted in the result, not returned.
absl::StatusOr<BenchResult> RunBench(const AttentionClient& client, const v1::AttendRequest& request,
                                     const BenchOptions& options, BenchProgress progress = nullptr);

// The nearest-rank p-th percentile (0 < p <= 100) of `sorted` (ascending);
// 0 when it is empty.
double Percentile(const std::vector<double>& sorted, double p);

// "[=====     ]": a 30-column bar `fraction` (clamped to [0, 1]) full.
std::string ProgressBar(double fraction);

// A human-readable summary, several lines.
std::string FormatBenchText(const BenchResult& result);
// One JSON object (for scripts), one line.
std::string FormatBenchJson(const BenchResult& result);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_BENCH_H_
