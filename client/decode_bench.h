#ifndef ATTNSERVE_CLIENT_DECODE_BENCH_H_
#define ATTNSERVE_CLIENT_DECODE_BENCH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "client/attention_client.h"

namespace attnserve::client {

// How `attnctl bench --decode` drives a server as a decoder would: open
// `sessions` sessions over `model`, prefill each with `context` tokens (all
// sessions in one Extend per chunk of at most `prefill_chunk` tokens), then
// `steps` decode rounds, each one Extend carrying one new token for every
// session (a micro-batch), then close them. With `stream`, the prefill and
// the rounds are messages of one ExtendStream call instead of Extend calls.
struct DecodeBenchOptions {
  std::string model = "default";
  int64_t sessions = 8;
  int64_t context = 512;
  int64_t steps = 32;
  int64_t prefill_chunk = 512;
  v1::DataType kv_dtype = v1::DATA_TYPE_FP32;
  uint64_t seed = 1;
  bool stream = false;
  // Deadline of each Extend call; with `stream`, of each message (the
  // stream's deadline is this times the messages it carries).
  double timeout_seconds = 30;
  // > 0: mixed traffic. After the `steps` rounds above, `steps` more rounds,
  // and when a quarter of them have run, one Extend call (from another
  // thread) prefills a new session with this many tokens in one step (the
  // server computes it in chunks of its --prefill_chunk_tokens); the second
  // rounds' latencies are reported beside the first's.
  int64_t prefill_during = 0;
};

// What a run measured. Step latencies in milliseconds (one Extend round).
struct DecodeBenchResult {
  DecodeBenchOptions options;
  int64_t d_model = 0;
  double prefill_seconds = 0;
  // The decode rounds' calls, summed (each timed from its send to its
  // answer: the client drawing the next round's inputs is not counted).
  double decode_seconds = 0;
  double tokens_per_second = 0;  // decode: sessions x steps / decode_seconds
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;
  double server_compute_ms = 0;  // mean of the decode rounds' compute
  // Each round's latency less the compute its response reports (what the
  // call, the wire and the queue add): median and mean.
  double overhead_p50_ms = 0, overhead_mean_ms = 0;
  // Of it, the server's part before the compute (the responses' timing.queue:
  // from the call's arrival, through its validation and admission, to its
  // batch's start): median.
  double server_queue_p50_ms = 0;
  std::string kernel_path;
  // With prefill_during: the second rounds' step latencies (all of them, and
  // those that overlapped the prefill call), how many overlapped, the
  // prefill call's own latency, and p99 with / p99 without.
  double with_p50_ms = 0, with_p99_ms = 0, with_max_ms = 0;
  double during_p50_ms = 0, during_p99_ms = 0;
  int64_t during_rounds = 0;
  double prefill_call_ms = 0;
  double p99_ratio = 0;
};

// OK when `options` make a run; else INVALID_ARGUMENT naming the flag
// (`--sessions`, `--context`, `--steps`, `--prefill_chunk`, `--prefill_during`).
// Needs no server.
absl::Status ValidateDecodeBenchOptions(const DecodeBenchOptions& options);

// Runs the decode load; `progress(done, total)` after each Extend. The first
// error of a call or of a step, as the server said it (the sessions opened are
// closed first).
absl::StatusOr<DecodeBenchResult> RunDecodeBench(
    const AttentionClient& client, const DecodeBenchOptions& options,
    const std::function<void(int64_t done, int64_t total)>& progress);

// The result as text (a few lines) and as one JSON object.
std::string FormatDecodeBenchText(const DecodeBenchResult& result);
std::string FormatDecodeBenchJson(const DecodeBenchResult& result);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_DECODE_BENCH_H_
