#ifndef ATTNSERVE_SERVER_SESSIONS_SESSION_MANAGER_H_
#define ATTNSERVE_SERVER_SESSIONS_SESSION_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"
#include "server/sessions/ended_sessions.h"

namespace attnserve::server {

// Layers (models) a session may have.
inline constexpr size_t kMaxSessionLayers = 1024;

// What OpenSession asks for.
struct SessionSpec {
  // The layers, in order (one model: a session of one layer). Each a ready
  // model whose layer is self-attention (context_dim == d_model).
  std::vector<std::shared_ptr<const Model>> layers;
  core::KvPrecision kv_precision = core::KvPrecision::kFp32;
  // Tokens each layer may hold; 0: SessionLimits::max_session_tokens.
  int64_t max_tokens = 0;
  // Idle time-to-live; zero: SessionLimits::default_idle_ttl.
  absl::Duration idle_ttl = absl::ZeroDuration();
  // The RoPE position of the session's first token.
  int64_t first_position = 0;
};

// A session as GetSession reports it.
struct SessionInfo {
  std::string id;
  std::vector<std::string> models;     // the layers' models, in order
  std::vector<int64_t> layer_lengths;  // tokens each layer holds
  core::KvPrecision kv_precision = core::KvPrecision::kFp32;
  int64_t max_tokens = 0;
  absl::Duration idle_ttl;
  int64_t first_position = 0;
  // The KV blocks its layers hold (a block shared with a fork counts in
  // each holder) and their bytes.
  int64_t kv_blocks = 0;
  int64_t kv_bytes = 0;
  absl::Time last_used;
};

// What a layer's latest token attends to (SessionManager::LatestAttention).
struct LatestAttentionRead {
  int64_t length = 0;    // tokens the layer holds
  int64_t position = 0;  // the latest token's RoPE position
  int num_heads = 0;
  std::vector<float> maps;        // [num_heads, length]
  std::vector<float> entropy;     // [num_heads]
  std::vector<float> max_weight;  // [num_heads]
};

class SessionManager;

// A snapshot's place in its manager's count of the blocks snapshots hold
// (SessionManager::SnapshotLatest): leaves it when destroyed or reset.
// Movable, not copyable; must not outlive its manager. Not thread-safe (one
// owner at a time); Reset takes the manager's lock.
class SnapshotHold {
 public:
  SnapshotHold() = default;
  SnapshotHold(const SnapshotHold&) = delete;
  SnapshotHold& operator=(const SnapshotHold&) = delete;
  SnapshotHold(SnapshotHold&& other) noexcept { *this = std::move(other); }
  SnapshotHold& operator=(SnapshotHold&& other) noexcept;
  ~SnapshotHold() { Reset(); }
  void Reset();

 private:
  friend class SessionManager;
  SessionManager* manager_ = nullptr;
  uint64_t key_ = 0;
};

// A layer's latest token taken for a read (SessionManager::SnapshotLatest).
// Its blocks count against the owner's KV quota once no session holds them
// any more (closed, evicted, expired, truncated, or copied before a write)
// while it does. Release() gives them back (so does destruction).
struct LatestSnapshot {
  SnapshotHold hold;  // declared first: destroyed after the blocks go back
  std::unique_ptr<core::LayerKvCache> cache;  // sharing the layer's blocks
  std::shared_ptr<const Model> model;
  int64_t position = 0;  // the latest token's RoPE position
  int64_t map_bytes = 0;  // of the read's maps

  void Release() {
    cache.reset();
    hold.Reset();
  }
};

// What the KV cache and the sessions hold, read together (for metrics).
struct SessionStats {
  int64_t sessions = 0;
  core::KvBlockPoolStats pool;
  // Of the pool's blocks in use: those sessions hold ahead of their tokens
  // (core::LayerKvCache takes growth blocks in runs), as of their last step.
  int64_t blocks_ahead = 0;
  int64_t kv_budget_bytes = 0;
  int64_t reserved_bytes = 0;  // promised to steps in flight
  int64_t stored_bytes = 0;    // answers kept for retries, latest queries
  int64_t evictions_for_memory = 0;
  int64_t evictions_for_sessions = 0;
  int64_t expiries = 0;
};

struct Session;

// How a SessionManager looks after itself.
struct SessionUpkeep {
  std::function<absl::Time()> clock = &absl::Now;
  // Every `period` (zero: never) a thread of the manager's removes the
  // sessions idle past their TTL (SessionManager::ExpireIdle), then calls
  // `on_look` with the stats (for metrics); the first time at once.
  absl::Duration period = absl::ZeroDuration();
  std::function<void(const SessionStats&)> on_look;
};

// A step admitted on one layer of one session (SessionManager::BeginStep):
// the layer is the step's until SessionManager::EndStep, and the KV bytes the
// step needs are reserved, so appending them cannot fail for want of memory
// while it runs. A replay (a retry of the layer's last step) carries that
// step's stored output and must not touch the cache.
//
// Movable, not copyable; pass it back to EndStep (a lease destroyed without
// it ends its step as failed).
class StepLease {
 public:
  StepLease(StepLease&&) noexcept;
  StepLease& operator=(StepLease&&) noexcept;
  ~StepLease();

  // The layer's cache, for the compute executor to extend; null for a replay.
  core::LayerKvCache* cache() const;
  // Whether the step's appends may take a run of blocks ahead (BeginStep
  // reserved room for it; ExtendItem::blocks_ahead).
  core::LayerKvCache::BlocksAhead blocks_ahead() const { return blocks_ahead_; }
  const Model& model() const;
  // The RoPE position of the step's first new token.
  int64_t first_position() const { return first_position_; }
  bool replay() const { return replay_; }
  // A replay: the output the step gave the first time.
  const std::string& stored_output() const;

 private:
  friend class SessionManager;
  StepLease() = default;

  SessionManager* manager_ = nullptr;
  std::shared_ptr<Session> session_;
  int layer_ = 0;
  int64_t expected_length_ = 0;
  int64_t new_tokens_ = 0;
  uint64_t fingerprint_ = 0;
  int64_t first_position_ = 0;
  int64_t reserved_bytes_ = 0;
  // Of reserved_bytes_ at BeginStep: for the step's KV blocks; and the part
  // still kept for blocks it has not taken (NoteAppended gives back the rest).
  int64_t kv_bytes_ = 0;
  int64_t unused_kv_bytes_ = 0;
  core::LayerKvCache::BlocksAhead blocks_ahead_ = core::LayerKvCache::BlocksAhead::kNone;
  bool replay_ = false;
  bool ended_ = false;
};

// The decode sessions: ids, owners, each layer's KV cache over one block pool,
// time-to-live, eviction and quotas. No gRPC and no compute: the service turns
// requests into calls here, and the compute executor extends a StepLease's
// cache between BeginStep and EndStep.
//
// Ids are 128 random bits from the kernel's CSPRNG (32 hex digits). A session
// belongs to the caller that opened it (`owner`: its token's identity, "" with
// authentication off): any other caller gets NOT_FOUND, as for an unknown id.
// NOT_FOUND says whether the id is unknown, expired (idle past its TTL),
// evicted (for the KV cache's memory, or for a new session at
// --max_sessions) or closed, for the last kRememberedEnds ids removed (their
// memory is taken at construction: EndedSessions).
//
// Memory: the KV cache never holds more than kv_cache_bytes. A step that
// needs blocks beyond it evicts idle sessions, least recently used first
// (never one with a step in flight); a session whose every block a fork or a
// waiting read also holds counts as used when the latest of them was (its
// eviction alone gives no block back). Only when none is left does the step
// get RESOURCE_EXHAUSTED.
//
// Thread-safe. The models a session holds live as long as it does.
class SessionManager {
 public:
  // The largest answer kept for a retry, per layer of a session (decode
  // steps and short chunks; a repeated longer prefill is ABORTED: truncate
  // and send it again).
  static constexpr int64_t kMaxStoredOutputBytes = int64_t{256} << 10;
  // Ended sessions whose NOT_FOUND says why they ended (older ones: "unknown
  // session"). About 0.5 MiB, all of it taken at construction.
  static constexpr size_t kRememberedEnds = 16384;

  using Clock = std::function<absl::Time()>;
  using Upkeep = SessionUpkeep;

  // INVALID_ARGUMENT naming the flag when a limit is out of range.
  static absl::StatusOr<std::unique_ptr<SessionManager>> Create(const SessionLimits& limits,
                                                                Upkeep upkeep = {});
  // Stops the upkeep thread; the sessions go (their steps must have ended).
  ~SessionManager();
  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  // Opens an empty session. INVALID_ARGUMENT naming the field ("models",
  // "max_tokens", "idle_ttl", "first_position"); RESOURCE_EXHAUSTED when the
  // owner is at its session quota, or at --max_sessions with every session
  // busy (a step in flight).
  absl::StatusOr<SessionInfo> Open(const SessionSpec& spec, absl::string_view owner);
  // NOT_FOUND as above.
  absl::StatusOr<SessionInfo> Get(absl::string_view id, absl::string_view owner);
  // Removes the session (a step in flight finishes first, then its memory
  // goes). NOT_FOUND as above.
  absl::Status Close(absl::string_view id, absl::string_view owner);
  // A new session of the same owner holding the same tokens, every KV block
  // shared (copy on write: nothing is copied now). NOT_FOUND; ABORTED while a
  // step is in flight on the session; RESOURCE_EXHAUSTED as Open.
  absl::StatusOr<SessionInfo> Fork(absl::string_view id, absl::string_view owner);
  // Keeps the first `length` tokens of layer `layer` (-1: of every layer).
  // NOT_FOUND; INVALID_ARGUMENT naming "layer" or "length" (over the
  // layer's length); ABORTED while a step is in flight on a layer it touches.
  absl::StatusOr<SessionInfo> Truncate(absl::string_view id, absl::string_view owner, int layer,
                                       int64_t length);

  // The model of a session's layer, to validate a step against before it is
  // admitted. NOT_FOUND; INVALID_ARGUMENT naming "layer".
  absl::StatusOr<std::shared_ptr<const Model>> LayerModel(absl::string_view id,
                                                          absl::string_view owner, int layer);

  // Takes layer `layer`'s latest token for a read of what it attends to
  // (ReadLatest), without extending the session or renewing its idle time:
  // a copy-on-write snapshot of the layer's cache (its blocks shared, so a
  // step that begins meanwhile runs as usual), taken under the lock.
  // NOT_FOUND as above; INVALID_ARGUMENT naming "layer"; ABORTED while a
  // step on the layer is in flight (as a second step would be);
  // FAILED_PRECONDITION when the layer holds no tokens or was truncated
  // since its last step (extend it by a token first); RESOURCE_EXHAUSTED
  // when the maps (num_heads x length x 4 bytes) would pass `max_map_bytes`
  // (`limit_flags` named in the message). The snapshot must go before the
  // manager does.
  absl::StatusOr<LatestSnapshot> SnapshotLatest(absl::string_view id, absl::string_view owner,
                                                int layer, int64_t max_map_bytes,
                                                absl::string_view limit_flags);
  // What a snapshot's latest token attends to: its query, kept from the step
  // that appended it, against every key the layer holds, per head
  // (core::LatestAttention). Thread-safe, without the manager's lock: the
  // compute executor's part. INTERNAL only for a broken invariant.
  static absl::StatusOr<LatestAttentionRead> ReadLatest(const LatestSnapshot& snapshot);

  // After a part of a step (a chunk of a long prefill) appended to the
  // lease's cache: the KV bytes reserved for the blocks it took are given
  // back, since the pool now counts those blocks (the reservation would
  // count them twice while the rest of the step waits for its next round).
  // Call it on the thread that extends the cache, between its appends.
  void NoteAppended(StepLease& lease);

  // Admits a step of `new_tokens` (>= 1) tokens on layer `layer` that
  // expects the layer to hold `expected_length` tokens; `fingerprint` is
  // what the step's inputs and options hash to. A retry of the layer's last
  // step (the same expected length, token count and fingerprint, the layer
  // now `new_tokens` longer) is a replay of its stored output, when that was
  // kept (answers of at most kMaxStoredOutputBytes). NOT_FOUND;
  // INVALID_ARGUMENT naming "layer" or "hidden_states" (new_tokens < 1);
  // ABORTED when another step on the layer is in flight, or the length is
  // not the expected one (the message says the layer's length); OUT_OF_RANGE
  // when the step would take the layer past the session's max_tokens;
  // RESOURCE_EXHAUSTED when its blocks do not fit the KV cache even after
  // evicting every idle session, or its owner's KV quota.
  absl::StatusOr<StepLease> BeginStep(absl::string_view id, absl::string_view owner, int layer,
                                      int64_t expected_length, int64_t new_tokens,
                                      uint64_t fingerprint);
  // Ends a step: `status` OK with the step's `output` (kept when it is at
  // most kMaxStoredOutputBytes, so a retry of the same step gets it again;
  // counted in the KV cache's budget), or the error it failed with (the
  // cache is as the compute left it: unchanged). Releases the reservation.
  void EndStep(StepLease lease, const absl::Status& status, std::string output);

  // Removes the sessions idle past their TTL (not those with a step in
  // flight); returns how many. Called periodically by the server.
  int ExpireIdle();

  SessionStats stats() const;
  const SessionLimits& limits() const { return limits_; }

 private:
  friend class StepLease;
  friend class SnapshotHold;
  SessionManager(const SessionLimits& limits, Upkeep upkeep,
                 std::unique_ptr<core::KvBlockPool> pool);
  void UpkeepLoop();

  // EndStep's work, once per lease (later calls do nothing).
  void EndStepOf(StepLease& lease, const absl::Status& status, std::string output);

  using Why = SessionEnd;

  // The caller's session, or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Session>> FindLocked(absl::string_view id,
                                                      absl::string_view owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a session from the table (its memory goes with its last lease),
  // remembering why.
  void RemoveLocked(const std::string& id, Why why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room by one session other than `keep`: one idle past its TTL goes
  // first, as the expiry it is (the upkeep would end it at its next look);
  // otherwise the least recently used idle session is evicted (for memory, a
  // session whose every block others also hold counts as used when the latest
  // of them was). False when no session is idle.
  bool EvictOneLocked(const Session* keep, Why why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a block of the idle `session` has no other holder (a fork, a
  // waiting read's snapshot).
  bool FreesKvBlockLocked(const Session& session) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Of a KV block: the latest use of the sessions (and waiting reads: now)
  // that hold it, and how many do (layers in a step not counted).
  struct BlockUse {
    absl::Time latest = absl::InfinitePast();
    int holders = 0;
  };
  absl::flat_hash_map<int32_t, BlockUse> BlockUsesLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The latest use of the idle `session` and of everything that shares its
  // blocks (infinite future when one of them is held out of sight).
  absl::Time SharersLastUseLocked(const Session& session,
                                  const absl::flat_hash_map<int32_t, BlockUse>& uses) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room for a new session: the owner's quota, then --max_sessions
  // (never evicting `keep`).
  absl::Status AdmitSessionLocked(absl::string_view owner, const Session* keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new session entry with a fresh id; INTERNAL when no id can be drawn.
  absl::StatusOr<std::shared_ptr<Session>> AddLocked(absl::string_view owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionInfo InfoLocked(const Session& session) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // KV bytes an owner holds: its sessions' blocks, and the blocks its
  // waiting reads' snapshots hold that no session holds any more.
  struct OwnerKvBytes {
    int64_t sessions = 0;
    int64_t waiting_reads = 0;
    int64_t total() const { return sessions + waiting_reads; }
  };
  OwnerKvBytes OwnerBytesLocked(absl::string_view owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A snapshot's blocks leave the owners' count (SnapshotHold::Reset).
  void ForgetSnapshot(uint64_t key) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const SessionLimits limits_;
  const Upkeep upkeep_;
  const Clock& clock_ = upkeep_.clock;
  const std::unique_ptr<core::KvBlockPool> pool_;
  absl::Notification stop_upkeep_;
  std::thread upkeep_thread_;  // with upkeep_.period > 0

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  // The last kRememberedEnds ids removed, why, and whose.
  EndedSessions ended_sessions_ ABSL_GUARDED_BY(mu_);
  // The blocks of each snapshot not yet released (the reads queued or
  // running), for their owners' quota.
  struct HeldSnapshot {
    std::string owner;
    std::vector<core::KvBlockHandle> blocks;
    int64_t block_bytes = 0;
  };
  absl::flat_hash_map<uint64_t, HeldSnapshot> snapshots_ ABSL_GUARDED_BY(mu_);
  uint64_t next_snapshot_key_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // The answers kept for retries and the layers' latest queries, every
  // session's (within the KV budget).
  int64_t stored_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_for_memory_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_for_sessions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expiries_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SESSIONS_SESSION_MANAGER_H_
