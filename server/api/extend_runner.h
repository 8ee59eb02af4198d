#ifndef ATTNSERVE_SERVER_API_EXTEND_RUNNER_H_
#define ATTNSERVE_SERVER_API_EXTEND_RUNNER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention_inputs.h"
#include "server/api/attend_runner.h"
#include "server/api/tensor_codec.h"
#include "server/common/server_options.h"
#include "server/sessions/session_manager.h"

namespace attnserve::server {

// Steps one Extend request may carry.
inline constexpr int kMaxExtendSteps = 1024;

// The scheduler's batch key of every Extend call and ExtendStream message
// (ScheduledWork::batch_key): they join one batch, never one of Attend calls
// (whose keys, BatchKey in attend_runner.h, are a model's address shifted
// left by 2: never below 4).
inline constexpr uint64_t kExtendBatchKey = 1;

// One step of an Extend request once planned: refused (status, no lease), or
// admitted (its lease holds the session's layer until the step ends).
struct ExtendStepPlan {
  absl::Status status;
  std::optional<StepLease> lease;
  TensorSpec hidden_states;  // [n, d_model], when admitted
  int64_t tokens = 0;        // n
  int64_t map_elements = 0;  // num_heads x n x length after the step, when maps are asked
  bool head_statistics = false;  // asked for, and the step computes (not a replay)
  std::vector<float> head_mask;
  // Across rounds (RunExtendRound): the new tokens computed so far, the
  // inputs as FP32 and the response's tensors being filled.
  int64_t done = 0;
  std::unique_ptr<FloatValues> input;
  std::unique_ptr<OutputTensor> output, maps;
  std::unique_ptr<OutputTensor> entropy, max_weight;  // [num_heads, n], when head_statistics
  // The layer's latest query before the step, put back when a step stopped
  // between chunks is truncated (the truncation drops a later one).
  std::vector<float> query_before;
};

// An Extend request that passed validation, its steps begun on the sessions.
struct ExtendPlan {
  std::vector<ExtendStepPlan> steps;  // one per request step, in order
  core::Precision precision = core::Precision::kFp32;
  v1::DataType output_dtype = v1::DATA_TYPE_FP32;
  int64_t tokens = 0;        // new tokens of the admitted steps that compute
  int64_t memory_bytes = 0;  // what they hold while they run (the scheduler's budget)
  // New tokens a step computes per round at most (0: a step's whole tokens
  // in one round): a longer step is a prefill computed chunk by chunk.
  int64_t chunk_tokens = 0;
  // Set by the rounds: the response's results exist; what the last core call
  // ran.
  bool started = false;
  core::ForwardInfo info;
};

// Validates `request` and begins its steps on `sessions` for `owner`. Returns
// INVALID_ARGUMENT (naming the field) for a request that is malformed as a
// whole: no steps or more than kMaxExtendSteps, an unknown precision or
// output dtype, maps or a response over the server's limits (head
// statistics count in the response, and the FP32 maps they are computed from
// count against --max_attention_map_bytes when the maps are not asked for). A step that
// fails on its own gets its status in the plan and no lease:
// INVALID_ARGUMENT naming "steps[i].<field>", or SessionManager::BeginStep's
// NOT_FOUND, ABORTED, OUT_OF_RANGE, RESOURCE_EXHAUSTED. The leases end in
// RunExtend / RunExtendRound, or in EndExtend (as failed).
//
// `chunk_tokens` > 0 (--prefill_chunk_tokens): a step of more new tokens is
// computed in chunks of at most chunk_tokens (RunExtendRound; their length
// from PrefillChunkTokens, shorter as the layer grows), and a step may carry up
// to its session's token limit (BeginStep's OUT_OF_RANGE past it); the
// memory estimate counts one chunk's compute scratch. 0: each step in one
// piece, at most limits.max_seq_len tokens.
absl::StatusOr<ExtendPlan> PlanExtend(const v1::ExtendRequest& request, SessionManager& sessions,
                                      absl::string_view owner, const RequestLimits& limits,
                                      int64_t max_response_bytes, int64_t chunk_tokens = 0);

// What one AttentionLayer::Extend of a call computed (for metrics).
struct ExtendComputed {
  std::string model;
  std::string kernel_path;
  int64_t tokens = 0;  // new tokens of its steps that succeeded
  // KV cache bytes its attention read: for each step that succeeded, the keys
  // and values of every token the layer holds after the step, once.
  int64_t kv_read_bytes = 0;
  absl::Duration duration;
};

// Runs the admitted steps (on the compute executor: one AttentionLayer::Extend
// per model and head mask over its steps), ends every lease, appends what
// each Extend computed to `computed` (when given), and fills `response`: one
// result per request step (output, maps, head statistics, the layer's
// length, or the step's status), the kernel path and precision. A replayed step gets its stored
// output without computing. Returns the call's own error (CANCELLED by
// `compute.should_stop`, INTERNAL): the steps of the Extend that failed keep
// their layers as before the call; the caller then answers the whole call
// with that error (steps of models that ran before it stay appended, and a
// retry of the call replays them).
absl::Status RunExtend(const v1::ExtendRequest& request, ExtendPlan& plan,
                       SessionManager& sessions, const ComputeContext& compute,
                       v1::ExtendResponse* response,
                       std::vector<ExtendComputed>* computed = nullptr);

// One Extend call (or ExtendStream message) of a batch run by RunExtendRound.
struct ExtendMember {
  const v1::ExtendRequest* request = nullptr;
  ExtendPlan* plan = nullptr;  // planned from *request
  v1::ExtendResponse* response = nullptr;
  // True when its caller no longer wants it (cancelled, past its deadline).
  // Empty: never.
  std::function<bool()> should_stop;
  // Set by RunExtendRound: the call's own error (as RunExtend returns it),
  // and whether it is finished (every lease ended, the response filled when
  // `status` is OK). Not finished: steps have chunks left, for another round.
  absl::Status status;
  bool finished = false;
  int64_t tokens = 0;  // new tokens of it computed OK in this round
};

// One round of a batch of Extend calls, on the compute executor. Each member
// that is not finished computes the next chunk of each of its steps (at
// most plan.chunk_tokens new tokens a step; a whole step with 0), and the
// chunks of all members run together: one AttentionLayer::Extend per
// (model, head mask, precision) over the chunks of every member that has
// one (one projection over all their new tokens, paged attention per
// (step, KV head)), stopping (CANCELLED) only when every member with a chunk
// in it wants to stop. A step whose last chunk ran OK ends (its output kept
// for a replay); a step that fails ends failed with its layer truncated
// back to the step's expected length (what earlier chunks appended goes).
// A member whose core call failed as a whole gets that error (`status`) and
// ends its steps that are not done (truncated back); the others go on.
// Finished members' responses are filled as RunExtend's (replays,
// refusals, kernel path, precision). `computed` (when given) gets one entry
// per core call that ran OK. Members must not share a session layer (their
// leases ensure it).
void RunExtendRound(absl::Span<ExtendMember> members, SessionManager& sessions,
                    const ComputeContext& compute, std::vector<ExtendComputed>* computed);

// New tokens the next RunExtendRound computes for `plan`.
int64_t RoundTokens(const ExtendPlan& plan);

// A chunk of a prefill is never shorter than chunk_tokens / this (unless it
// is the step's last).
inline constexpr int64_t kMinChunkFraction = 8;

// Tokens of a prefill's next chunk (`chunk_tokens`: --prefill_chunk_tokens,
// > 0) into a layer that holds `keys_before` tokens, for a layer of
// `d_model`, `q_width` (heads x head_dim) and `kv_width`: at most
// chunk_tokens, and at most the work of a chunk of chunk_tokens at the start
// of a sequence, counting a chunk's work as tokens x (keys attended +
// projection_keys), where projection_keys = d_model (q_width + kv_width) /
// q_width is what a token's four projections cost in keys attended. So the
// chunks late in a long prefill, which attend to more keys, are shorter
// (each costs about as much as the first), and a decode step queued behind
// one waits about as long wherever the prefill is; never under chunk_tokens /
// kMinChunkFraction (at least 1). Pure; thread-safe.
int64_t PrefillChunkTokens(int64_t chunk_tokens, int64_t keys_before, int64_t d_model,
                           int64_t q_width, int64_t kv_width);

// Ends every step of `plan` that has not ended as failed with `status`,
// truncating its layer back to the step's expected length (what earlier
// chunks of it appended goes, and the layer's latest query is as before the
// step): a call stopped between chunks (cancelled, past its deadline, the
// drain) leaves the layers of its unfinished steps as before it. Its steps
// that finished in earlier rounds (shorter steps of the same call) stay
// appended: a retry of the call replays them when their answers were kept
// (SessionManager::kMaxStoredOutputBytes), and otherwise gets ABORTED saying
// the layer's length. Call it where no round of the plan runs (the leases
// make the layers the plan's).
void EndExtend(ExtendPlan& plan, const absl::Status& status, SessionManager& sessions);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_EXTEND_RUNNER_H_
