#ifndef ATTNSERVE_CLIENT_DECODE_CHURN_H_
#define ATTNSERVE_CLIENT_DECODE_CHURN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attnserve::client {

// How `attnctl bench --decode --churn` loads a server's session table and KV
// cache: for `duration_seconds`, one operation after another at random on a
// set of at most `sessions` live sessions over `model` (FP32 or BF16 KV at
// random): open (each of at most `context` tokens; a quarter with an idle TTL
// of `short_ttl_seconds`), extend (a micro-batch of up to 8 sessions, each
// one decode token or a short prefill of up to 64), fork, truncate, get,
// close, and park (a short-TTL session left alone until twice its TTL has
// passed, then described: it must be gone). Sessions the server ends on its
// own (expiry, eviction for memory or for --max_sessions) are dropped.
//
// Every answer is checked: a step's returned length is exactly the length
// before it plus its tokens, and a session described, forked or truncated
// holds exactly the tokens the client counted (no token lost or
// duplicated). Refusals a churning client must expect are counted by code:
// NOT_FOUND (a session expired, evicted or closed) and RESOURCE_EXHAUSTED
// (the KV cache or the queue full). Anything else -- another code, a wrong
// length, a parked session still there -- is a failure.
struct DecodeChurnOptions {
  std::string model = "default";
  double duration_seconds = 60;
  int64_t sessions = 48;
  int64_t context = 512;
  double short_ttl_seconds = 1;
  uint64_t seed = 1;
  double timeout_seconds = 30;
};

struct DecodeChurnResult {
  DecodeChurnOptions options;
  double seconds = 0;
  std::map<std::string, int64_t> operations;  // by kind: "open", "extend", ...
  int64_t tokens_appended = 0;
  int64_t steps = 0;  // session steps answered OK (a micro-batch counts each)
  // Refusals by code name, and sessions the server ended, by what its
  // NOT_FOUND message said ("expired", "evicted for memory", "evicted for
  // sessions").
  std::map<std::string, int64_t> refusals;
  std::map<std::string, int64_t> ended;
  int64_t failures = 0;
  std::vector<std::string> first_failures;  // at most 10
};

// OK when `options` make a run; else INVALID_ARGUMENT naming the flag
// (`--duration`, `--sessions`, `--context`, `--ttl_seconds`). Needs no server.
absl::Status ValidateDecodeChurnOptions(const DecodeChurnOptions& options);

// Runs the churn; `progress(result so far, live sessions)` about once a
// second. Errors only when the run cannot start (the model unknown, the
// server unreachable); what happens during the run is in the result
// (failures > 0: the server lost or duplicated a token or refused with an
// undocumented code). The sessions still open are closed at the end.
absl::StatusOr<DecodeChurnResult> RunDecodeChurn(
    const AttentionClient& client, const DecodeChurnOptions& options,
    const std::function<void(const DecodeChurnResult& so_far, int64_t live)>& progress);

// The result as text (a few lines) and as one JSON object.
std::string FormatDecodeChurnText(const DecodeChurnResult& result);
std::string FormatDecodeChurnJson(const DecodeChurnResult& result);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_DECODE_CHURN_H_
