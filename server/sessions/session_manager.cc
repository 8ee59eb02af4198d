#include "server/sessions/session_manager.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/decode/latest_attention.h"
#include "core/validation.h"

namespace attnserve::server {

// One layer of a session. The cache belongs to the step in flight on the
// layer, if any; the mirrors are what the manager reads under its lock.
struct SessionLayer {
  std::shared_ptr<const Model> model;
  std::unique_ptr<core::LayerKvCache> cache;
  int64_t block_bytes = 0;  // of one block of the layer's layout
  // Mirrors of the cache, updated when it changes (outside a step) and when
  // a step ends.
  int64_t length = 0;
  int64_t blocks = 0;  // held: the table's and those ahead of the tokens
  int64_t blocks_ahead = 0;
  bool step_in_flight = false;
  // The last step, for a retry: its expected length, token count and output
  // (empty: nothing to replay).
  int64_t last_expected = -1;
  int64_t last_tokens = 0;
  uint64_t last_fingerprint = 0;
  std::string last_output;
  // The cache's latest query's bytes (counted with the stored answers).
  int64_t query_bytes = 0;
};

// A session. Its fields are guarded by the manager's mutex (but the caches
// during a step, see SessionLayer).
struct Session {
  std::string id;
  std::string owner;
  core::KvPrecision kv_precision = core::KvPrecision::kFp32;
  int64_t max_tokens = 0;
  absl::Duration idle_ttl;
  int64_t first_position = 0;
  std::vector<SessionLayer> layers;
  absl::Time last_used;
  int steps_in_flight = 0;

  // Idle (no step in flight) for longer than its TTL at `now`.
  bool ExpiredAt(absl::Time now) const {
    return steps_in_flight == 0 && now - last_used > idle_ttl;
  }
};

namespace {

// 128 bits from the kernel's CSPRNG (a session id is their 32 hex digits);
// INTERNAL when the kernel gives none.
absl::StatusOr<SessionKey> NewSessionKey() {
  SessionKey key;
  size_t got = 0;
  while (got < key.size()) {
    const ssize_t n = getrandom(key.data() + got, key.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      return absl::InternalError(
          absl::StrCat("session ids: getrandom failed: ", std::strerror(errno)));
    }
  }
  return key;
}

// Bytes of the answers a session keeps for retries and of its latest queries.
int64_t StoredBytes(const Session& session) {
  int64_t bytes = 0;
  for (const SessionLayer& layer : session.layers) {
    bytes += static_cast<int64_t>(layer.last_output.size()) + layer.query_bytes;
  }
  return bytes;
}

// OK when `layer` is one of the session's layers; else INVALID_ARGUMENT naming
// the field.
absl::Status CheckLayerIndex(const Session& session, int layer) {
  if (layer < 0 || layer >= static_cast<int>(session.layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " is outside [0, ", session.layers.size(), ")"));
  }
  return absl::OkStatus();
}

// Brings `layer.query_bytes`, and with it `stored_bytes` (the manager's
// total), to the latest query its cache keeps now.
void FollowLatestQueryBytes(SessionLayer& layer, int64_t& stored_bytes) {
  stored_bytes += layer.cache->latest_query_bytes() - layer.query_bytes;
  layer.query_bytes = layer.cache->latest_query_bytes();
}

}  // namespace

StepLease::StepLease(StepLease&& other) noexcept { *this = std::move(other); }

StepLease& StepLease::operator=(StepLease&& other) noexcept {
  if (this != &other) {
    if (session_ != nullptr && !ended_) {
      manager_->EndStepOf(*this, absl::CancelledError("the step was dropped"), {});
    }
    manager_ = other.manager_;
    session_ = std::move(other.session_);
    layer_ = other.layer_;
    expected_length_ = other.expected_length_;
    new_tokens_ = other.new_tokens_;
    fingerprint_ = other.fingerprint_;
    first_position_ = other.first_position_;
    reserved_bytes_ = other.reserved_bytes_;
    kv_bytes_ = other.kv_bytes_;
    unused_kv_bytes_ = other.unused_kv_bytes_;
    blocks_ahead_ = other.blocks_ahead_;
    replay_ = other.replay_;
    ended_ = other.ended_;
    other.session_ = nullptr;
  }
  return *this;
}

StepLease::~StepLease() {
  if (session_ != nullptr && !ended_) {
    manager_->EndStepOf(*this, absl::CancelledError("the step was dropped"), {});
  }
}

core::LayerKvCache* StepLease::cache() const {
  return replay_ ? nullptr : session_->layers[static_cast<size_t>(layer_)].cache.get();
}

const Model& StepLease::model() const {
  return *session_->layers[static_cast<size_t>(layer_)].model;
}

const std::string& StepLease::stored_output() const {
  return session_->layers[static_cast<size_t>(layer_)].last_output;
}

absl::StatusOr<std::unique_ptr<SessionManager>> SessionManager::Create(const SessionLimits& limits,
                                                                       Upkeep upkeep) {
  const auto positive = [](int64_t value, absl::string_view flag) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(absl::StrCat(flag, ": must be positive"));
  };
  for (const absl::Status& status :
       {positive(limits.kv_cache_bytes, "--kv_cache_bytes"),
        positive(limits.max_sessions, "--max_sessions"),
        positive(limits.max_session_tokens, "--max_session_tokens")}) {
    if (!status.ok()) return status;
  }
  if (limits.max_session_tokens > core::kMaxPositionOffset) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_session_tokens: at most ", core::kMaxPositionOffset));
  }
  if (limits.default_idle_ttl <= absl::ZeroDuration() ||
      limits.max_idle_ttl < limits.default_idle_ttl) {
    return absl::InvalidArgumentError(
        "--session_ttl_seconds: must be positive and at most --max_session_ttl_seconds");
  }
  if (limits.max_sessions_per_owner < 0 || limits.max_kv_bytes_per_owner < 0) {
    return absl::InvalidArgumentError(
        "--max_sessions_per_token, --max_kv_bytes_per_token: must be >= 0 (0: no quota)");
  }
  absl::StatusOr<std::unique_ptr<core::KvBlockPool>> pool = core::KvBlockPool::Create(
      {.budget_bytes = limits.kv_cache_bytes, .block_tokens = limits.block_tokens});
  if (!pool.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_block_tokens or --kv_cache_bytes: ", pool.status().message()));
  }
  return std::unique_ptr<SessionManager>(
      new SessionManager(limits, std::move(upkeep), *std::move(pool)));
}

SessionManager::SessionManager(const SessionLimits& limits, Upkeep upkeep,
                               std::unique_ptr<core::KvBlockPool> pool)
    : limits_(limits),
      upkeep_(std::move(upkeep)),
      pool_(std::move(pool)),
      ended_sessions_(kRememberedEnds) {
  if (upkeep_.period > absl::ZeroDuration()) {
    upkeep_thread_ = std::thread([this] { UpkeepLoop(); });
  }
}

SessionManager::~SessionManager() {
  stop_upkeep_.Notify();
  if (upkeep_thread_.joinable()) upkeep_thread_.join();
  absl::MutexLock lock(&mu_);
  sessions_.clear();  // the caches go before the pool
}

void SessionManager::UpkeepLoop() {
  do {  // a first look at once, so the metrics exist from start-up
    ExpireIdle();
    if (upkeep_.on_look) upkeep_.on_look(stats());
  } while (!stop_upkeep_.WaitForNotificationWithTimeout(upkeep_.period));
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::FindLocked(absl::string_view id,
                                                                    absl::string_view owner) {
  const std::optional<SessionKey> key = ParseSessionId(id);
  if (!key.has_value()) {
    return absl::NotFoundError("session_id: not a session id (32 hex digits)");
  }
  const auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->owner != owner) {
    // Why a session is gone is its owner's to know; others see "unknown".
    const std::optional<Why> why =
        it == sessions_.end() ? ended_sessions_.Find(*key, owner) : std::nullopt;
    if (!why.has_value()) {
      return absl::NotFoundError(absl::StrCat("session ", id, ": unknown session"));
    }
    switch (*why) {
      case Why::kExpired:
        return absl::NotFoundError(absl::StrCat("session ", id, ": expired (idle past its TTL)"));
      case Why::kEvictedForMemory:
        return absl::NotFoundError(absl::StrCat(
            "session ", id, ": evicted while idle, for the KV cache's memory (--kv_cache_bytes)"));
      case Why::kEvictedForSessions:
        return absl::NotFoundError(absl::StrCat(
            "session ", id, ": evicted while idle, for a new session (--max_sessions)"));
      case Why::kClosed:
        return absl::NotFoundError(absl::StrCat("session ", id, ": closed"));
    }
  }
  std::shared_ptr<Session> session = it->second;
  if (session->ExpiredAt(clock_())) {
    RemoveLocked(session->id, Why::kExpired);
    ++expiries_;
    return absl::NotFoundError(absl::StrCat("session ", id, ": expired (idle past its TTL)"));
  }
  return session;
}

void SessionManager::RemoveLocked(const std::string& id, Why why) {
  const auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  stored_bytes_ -= StoredBytes(*it->second);
  // Every id in the table is the hex of a NewSessionKey (AddLocked).
  ended_sessions_.Remember(*ParseSessionId(id), it->second->owner, why);
  sessions_.erase(it);
}

bool SessionManager::FreesKvBlockLocked(const Session& session) const {
  for (const SessionLayer& layer : session.layers) {
    if (!layer.cache->blocks_ahead().empty() || pool_->AnyUnshared(layer.cache->blocks())) {
      return true;
    }
  }
  return false;
}

absl::flat_hash_map<int32_t, SessionManager::BlockUse> SessionManager::BlockUsesLocked() const {
  absl::flat_hash_map<int32_t, BlockUse> uses;
  auto note = [&uses](const core::KvBlockHandle& block, absl::Time when) {
    BlockUse& use = uses[block.id];
    use.latest = std::max(use.latest, when);
    ++use.holders;
  };
  for (const auto& [id, session] : sessions_) {
    for (const SessionLayer& layer : session->layers) {
      // A layer in a step is the compute's until the step ends: its blocks
      // are not read here (its sharers see a holder they cannot name).
      if (layer.step_in_flight) continue;
      for (const core::KvBlockHandle& block : layer.cache->blocks()) note(block, session->last_used);
    }
  }
  for (const auto& [key, held] : snapshots_) {
    for (const core::KvBlockHandle& block : held.blocks) note(block, absl::InfiniteFuture());
  }
  return uses;
}

absl::Time SessionManager::SharersLastUseLocked(
    const Session& session, const absl::flat_hash_map<int32_t, BlockUse>& uses) const {
  absl::Time latest = session.last_used;
  for (const SessionLayer& layer : session.layers) {
    for (const core::KvBlockHandle& block : layer.cache->blocks()) {
      const auto it = uses.find(block.id);
      // Held by no one else in sight: by a layer in a step, a step's lease
      // or a read: in use now.
      if (it == uses.end() || it->second.holders < 2) return absl::InfiniteFuture();
      latest = std::max(latest, it->second.latest);
    }
  }
  return latest;
}

bool SessionManager::EvictOneLocked(const Session* keep, Why why) {
  std::vector<const Session*> idle;
  const absl::Time now = clock_();
  for (const auto& [id, session] : sessions_) {
    if (session.get() == keep || session->steps_in_flight != 0) continue;
    if (session->ExpiredAt(now)) {
      // Expired already: it goes before any session its caller may still use.
      RemoveLocked(session->id, Why::kExpired);
      ++expiries_;
      return true;
    }
    idle.push_back(session.get());
  }
  if (idle.empty()) return false;
  const auto by_last_use = [](const Session* a, const Session* b) {
    return a->last_used < b->last_used;
  };
  const Session* victim = *std::min_element(idle.begin(), idle.end(), by_last_use);
  if (why == Why::kEvictedForMemory) {
    // Evicting a session whose every block others hold (forks, reads) gives
    // no block back until they go too: such a session counts as used when
    // the latest of them was. The least recently used by that measure goes.
    // A session that frees a block counts as its own last use, and every
    // session after it in the order of last use counts later.
    std::sort(idle.begin(), idle.end(), by_last_use);
    std::optional<absl::flat_hash_map<int32_t, BlockUse>> uses;  // built when first needed
    victim = nullptr;
    absl::Time victim_use;
    for (const Session* session : idle) {
      if (victim != nullptr && session->last_used >= victim_use) break;
      absl::Time use = session->last_used;
      if (!FreesKvBlockLocked(*session)) {
        if (!uses) uses = BlockUsesLocked();
        use = SharersLastUseLocked(*session, *uses);
      }
      if (victim == nullptr || use < victim_use) {
        victim = session;
        victim_use = use;
      }
    }
  }
  RemoveLocked(victim->id, why);
  ++(why == Why::kEvictedForMemory ? evictions_for_memory_ : evictions_for_sessions_);
  return true;
}

absl::Status SessionManager::AdmitSessionLocked(absl::string_view owner, const Session* keep) {
  if (limits_.max_sessions_per_owner > 0) {
    int64_t owned = 0;
    for (const auto& [id, session] : sessions_) owned += session->owner == owner ? 1 : 0;
    if (owned >= limits_.max_sessions_per_owner) {
      return absl::ResourceExhaustedError(
          absl::StrCat("this caller has ", owned, " sessions open, its quota "
                       "(--max_sessions_per_token); close one first"));
    }
  }
  while (static_cast<int64_t>(sessions_.size()) >= limits_.max_sessions) {
    if (!EvictOneLocked(keep, Why::kEvictedForSessions)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("every one of the server's ", limits_.max_sessions,
                       " sessions (--max_sessions) has a step in flight; retry"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::AddLocked(absl::string_view owner) {
  auto session = std::make_shared<Session>();
  SessionKey key;
  do {
    absl::StatusOr<SessionKey> drawn = NewSessionKey();
    if (!drawn.ok()) return drawn.status();
    key = *drawn;
    session->id = absl::BytesToHexString(
        absl::string_view(reinterpret_cast<const char*>(key.data()), key.size()));
  } while (sessions_.contains(session->id) || ended_sessions_.Contains(key));
  session->owner = std::string(owner);
  session->last_used = clock_();
  sessions_[session->id] = session;
  return session;
}

SessionInfo SessionManager::InfoLocked(const Session& session) const {
  SessionInfo info;
  info.id = session.id;
  info.kv_precision = session.kv_precision;
  info.max_tokens = session.max_tokens;
  info.idle_ttl = session.idle_ttl;
  info.first_position = session.first_position;
  info.last_used = session.last_used;
  for (const SessionLayer& layer : session.layers) {
    info.models.push_back(layer.model->name);
    info.layer_lengths.push_back(layer.length);
    info.kv_blocks += layer.blocks;
    info.kv_bytes += layer.blocks * layer.block_bytes;
  }
  return info;
}

SessionManager::OwnerKvBytes SessionManager::OwnerBytesLocked(absl::string_view owner) const {
  OwnerKvBytes bytes;
  for (const auto& [id, session] : sessions_) {
    if (session->owner != owner) continue;
    for (const SessionLayer& layer : session->layers) {
      bytes.sessions += layer.blocks * layer.block_bytes;
    }
  }
  // A block of a waiting read's snapshot counts once every reference to it
  // is a snapshot's: its session let it go (closed, truncated, evicted, or
  // copied it before writing) and no fork holds it. Otherwise a read waiting
  // in the queue would let its owner close the session and fill the quota
  // again while the old blocks stay taken. Each block counts once, however
  // many reads hold it.
  if (std::none_of(snapshots_.begin(), snapshots_.end(),
                   [&](const auto& entry) { return entry.second.owner == owner; })) {
    return bytes;
  }
  absl::flat_hash_map<int32_t, int> snapshot_references;
  for (const auto& [key, held] : snapshots_) {
    for (const core::KvBlockHandle& block : held.blocks) ++snapshot_references[block.id];
  }
  for (const auto& [key, held] : snapshots_) {
    if (held.owner != owner) continue;
    for (const core::KvBlockHandle& block : held.blocks) {
      auto it = snapshot_references.find(block.id);
      if (it->second == 0) continue;  // counted already
      if (pool_->ReferenceCount(block) == it->second) bytes.waiting_reads += held.block_bytes;
      it->second = 0;
    }
  }
  return bytes;
}

void SessionManager::ForgetSnapshot(uint64_t key) {
  absl::MutexLock lock(&mu_);
  snapshots_.erase(key);
}

SnapshotHold& SnapshotHold::operator=(SnapshotHold&& other) noexcept {
  if (this != &other) {
    Reset();
    manager_ = std::exchange(other.manager_, nullptr);
    key_ = std::exchange(other.key_, 0);
  }
  return *this;
}

void SnapshotHold::Reset() {
  if (manager_ != nullptr) manager_->ForgetSnapshot(key_);
  manager_ = nullptr;
  key_ = 0;
}

absl::StatusOr<SessionInfo> SessionManager::Open(const SessionSpec& spec,
                                                 absl::string_view owner) {
  if (spec.layers.empty() || spec.layers.size() > kMaxSessionLayers) {
    return absl::InvalidArgumentError(absl::StrCat("models: between 1 and ", kMaxSessionLayers,
                                                   " models (the layers, in order)"));
  }
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const core::HeadConfig& config = spec.layers[i]->layer->config();
    if (config.context_dim != config.d_model) {
      return absl::InvalidArgumentError(absl::StrCat(
          "models[", i, "]: '", spec.layers[i]->name,
          "' is a cross-attention layer (context_dim != d_model); sessions cache self-attention"));
    }
  }
  const int64_t max_tokens = spec.max_tokens == 0 ? limits_.max_session_tokens : spec.max_tokens;
  if (max_tokens < 0 || max_tokens > limits_.max_session_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens: ", spec.max_tokens, " is outside [0, ", limits_.max_session_tokens,
        "] (--max_session_tokens)"));
  }
  const absl::Duration ttl =
      spec.idle_ttl == absl::ZeroDuration() ? limits_.default_idle_ttl : spec.idle_ttl;
  if (ttl < absl::ZeroDuration() || ttl > limits_.max_idle_ttl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idle_ttl: ", absl::FormatDuration(spec.idle_ttl), " is outside [0, ",
        absl::FormatDuration(limits_.max_idle_ttl), "] (--max_session_ttl_seconds)"));
  }
  if (spec.first_position < 0 || spec.first_position > core::kMaxPositionOffset - max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_position: ", spec.first_position, " is outside [0, ",
        core::kMaxPositionOffset - max_tokens, "] (positions up to 2^30 with max_tokens more)"));
  }
  std::vector<SessionLayer> layers(spec.layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    const core::HeadConfig& config = spec.layers[i]->layer->config();
    const core::KvLayout layout{.num_kv_heads = static_cast<int>(config.num_kv_heads),
                                .head_dim = static_cast<int>(config.head_dim),
                                .precision = spec.kv_precision};
    absl::StatusOr<std::unique_ptr<core::LayerKvCache>> cache =
        core::LayerKvCache::Create(pool_.get(), layout);
    if (!cache.ok()) return cache.status();
    layers[i].model = spec.layers[i];
    layers[i].cache = *std::move(cache);
    layers[i].block_bytes = core::KvBlockBytes(layout, limits_.block_tokens);
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status admitted = AdmitSessionLocked(owner, nullptr); !admitted.ok()) {
    return admitted;
  }
  absl::StatusOr<std::shared_ptr<Session>> added = AddLocked(owner);
  if (!added.ok()) return added.status();
  Session* session = added->get();
  session->kv_precision = spec.kv_precision;
  session->max_tokens = max_tokens;
  session->idle_ttl = ttl;
  session->first_position = spec.first_position;
  session->layers = std::move(layers);
  return InfoLocked(*session);
}

absl::StatusOr<SessionInfo> SessionManager::Get(absl::string_view id, absl::string_view owner) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> session = FindLocked(id, owner);
  if (!session.ok()) return session.status();
  return InfoLocked(**session);
}

absl::Status SessionManager::Close(absl::string_view id, absl::string_view owner) {
  std::shared_ptr<Session> closed;  // freed after the lock is released
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> session = FindLocked(id, owner);
  if (!session.ok()) return session.status();
  closed = *session;
  RemoveLocked(closed->id, Why::kClosed);
  return absl::OkStatus();
}

absl::StatusOr<SessionInfo> SessionManager::Fork(absl::string_view id, absl::string_view owner) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> found = FindLocked(id, owner);
  if (!found.ok()) return found.status();
  const std::shared_ptr<Session> parent = *found;
  if (parent->steps_in_flight > 0) {
    return absl::AbortedError(
        absl::StrCat("session ", parent->id, ": a step is in flight; fork between steps"));
  }
  if (absl::Status admitted = AdmitSessionLocked(owner, parent.get()); !admitted.ok()) {
    return admitted;
  }
  absl::StatusOr<std::shared_ptr<Session>> added = AddLocked(owner);
  if (!added.ok()) return added.status();
  Session* child = added->get();
  child->kv_precision = parent->kv_precision;
  child->max_tokens = parent->max_tokens;
  child->idle_ttl = parent->idle_ttl;
  child->first_position = parent->first_position;
  child->layers.resize(parent->layers.size());
  for (size_t i = 0; i < parent->layers.size(); ++i) {
    const SessionLayer& from = parent->layers[i];
    SessionLayer& to = child->layers[i];
    to.model = from.model;
    to.cache = from.cache->Fork();
    to.block_bytes = from.block_bytes;
    to.length = from.length;
    to.blocks = to.cache->blocks_held();  // the table's: a fork takes none ahead
    to.query_bytes = from.query_bytes;
    stored_bytes_ += to.query_bytes;
  }
  parent->last_used = child->last_used;
  return InfoLocked(*child);
}

absl::StatusOr<SessionInfo> SessionManager::Truncate(absl::string_view id,
                                                     absl::string_view owner, int layer,
                                                     int64_t length) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> found = FindLocked(id, owner);
  if (!found.ok()) return found.status();
  Session& session = **found;
  const int layers = static_cast<int>(session.layers.size());
  if (layer < -1 || layer >= layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " is outside [0, ", layers, ") (or -1: every layer)"));
  }
  const int first = layer == -1 ? 0 : layer;
  const int last = layer == -1 ? layers - 1 : layer;
  for (int l = first; l <= last; ++l) {
    const SessionLayer& s = session.layers[static_cast<size_t>(l)];
    if (s.step_in_flight) {
      return absl::AbortedError(absl::StrCat("session ", session.id, ": a step on layer ", l,
                                             " is in flight; truncate between steps"));
    }
    if (length < 0 || length > s.length) {
      return absl::InvalidArgumentError(absl::StrCat("length: ", length, " is outside [0, ",
                                                     s.length, "], layer ", l, "'s length"));
    }
  }
  for (int l = first; l <= last; ++l) {
    SessionLayer& s = session.layers[static_cast<size_t>(l)];
    if (absl::Status truncated = s.cache->Truncate(length); !truncated.ok()) return truncated;
    s.length = length;
    s.blocks = s.cache->blocks_held();
    s.blocks_ahead = static_cast<int64_t>(s.cache->blocks_ahead().size());
    s.last_expected = -1;
    stored_bytes_ -= static_cast<int64_t>(s.last_output.size());
    s.last_output.clear();
    FollowLatestQueryBytes(s, stored_bytes_);
  }
  session.last_used = clock_();
  return InfoLocked(session);
}

absl::StatusOr<std::shared_ptr<const Model>> SessionManager::LayerModel(absl::string_view id,
                                                                        absl::string_view owner,
                                                                        int layer) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> found = FindLocked(id, owner);
  if (!found.ok()) return found.status();
  const Session& session = **found;
  if (absl::Status status = CheckLayerIndex(session, layer); !status.ok()) return status;
  return session.layers[static_cast<size_t>(layer)].model;
}

absl::StatusOr<LatestSnapshot> SessionManager::SnapshotLatest(absl::string_view id,
                                                              absl::string_view owner, int layer,
                                                              int64_t max_map_bytes,
                                                              absl::string_view limit_flags) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> found = FindLocked(id, owner);
  if (!found.ok()) return found.status();
  const Session& session = **found;
  if (absl::Status status = CheckLayerIndex(session, layer); !status.ok()) return status;
  const SessionLayer& target = session.layers[static_cast<size_t>(layer)];
  if (target.step_in_flight) {
    return absl::AbortedError(absl::StrCat("session ", session.id, ": a step on layer ", layer,
                                           " is in flight; read between steps"));
  }
  if (target.length == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session.id, ": layer ", layer,
        " holds no tokens, so it has no latest token; extend it by a token first"));
  }
  if (target.cache->latest_query().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session.id, ": layer ", layer,
        " was truncated since its last step, so its latest token's query is not kept; "
        "extend it by a token first"));
  }
  const int64_t heads = target.model->layer->config().num_heads;
  // heads <= kMaxHeads and length <= 2^30: no overflow.
  const int64_t bytes = heads * target.length * 4;
  if (bytes > max_map_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session.id, ": layer ", layer, "'s maps (", heads, " heads x ", target.length,
        " tokens x 4 bytes = ", bytes, " bytes) would pass this server's limit of ", max_map_bytes,
        " bytes (", limit_flags, ")"));
  }
  LatestSnapshot snapshot;
  snapshot.cache = target.cache->Fork();
  snapshot.model = target.model;
  snapshot.position = session.first_position + target.length - 1;
  snapshot.map_bytes = bytes;
  const uint64_t key = next_snapshot_key_++;
  const absl::Span<const core::KvBlockHandle> blocks = snapshot.cache->blocks();
  snapshots_[key] = HeldSnapshot{session.owner, {blocks.begin(), blocks.end()},
                                 target.block_bytes};
  snapshot.hold.manager_ = this;
  snapshot.hold.key_ = key;
  return snapshot;
}

absl::StatusOr<LatestAttentionRead> SessionManager::ReadLatest(const LatestSnapshot& snapshot) {
  const core::HeadConfig& config = snapshot.model->layer->config();
  LatestAttentionRead read;
  read.num_heads = static_cast<int>(config.num_heads);
  read.length = snapshot.cache->length();
  read.position = snapshot.position;
  read.maps.resize(static_cast<size_t>(read.num_heads * read.length));
  read.entropy.resize(static_cast<size_t>(read.num_heads));
  read.max_weight.resize(static_cast<size_t>(read.num_heads));
  if (absl::Status status = core::LatestAttention(*snapshot.cache, read.num_heads, config.scale,
                                                  absl::MakeSpan(read.maps),
                                                  absl::MakeSpan(read.entropy),
                                                  absl::MakeSpan(read.max_weight));
      !status.ok()) {
    return absl::InternalError(
        absl::StrCat("the latest attention refused a checked layer: ", status.message()));
  }
  return read;
}

absl::StatusOr<StepLease> SessionManager::BeginStep(absl::string_view id, absl::string_view owner,
                                                    int layer, int64_t expected_length,
                                                    int64_t new_tokens, uint64_t fingerprint) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::shared_ptr<Session>> found = FindLocked(id, owner);
  if (!found.ok()) return found.status();
  std::shared_ptr<Session> session = *found;
  if (absl::Status status = CheckLayerIndex(*session, layer); !status.ok()) return status;
  if (new_tokens < 1) {
    return absl::InvalidArgumentError("hidden_states: at least one new token");
  }
  SessionLayer& target = session->layers[static_cast<size_t>(layer)];
  if (target.step_in_flight) {
    return absl::AbortedError(absl::StrCat("session ", session->id, ": a step on layer ", layer,
                                           " is in flight; steps of one layer go one at a time"));
  }
  bool replay = false;
  int64_t reserved = 0;
  int64_t reserved_kv = 0;  // of `reserved`, for KV blocks
  core::LayerKvCache::BlocksAhead blocks_ahead = core::LayerKvCache::BlocksAhead::kNone;
  if (expected_length != target.length) {
    const bool retry = expected_length == target.last_expected &&
                       new_tokens == target.last_tokens && fingerprint == target.last_fingerprint &&
                       expected_length + new_tokens == target.length && !target.last_output.empty();
    if (!retry) {
      return absl::AbortedError(absl::StrCat("session ", session->id, ": layer ", layer, " holds ",
                                             target.length, " tokens, the step expected ",
                                             expected_length));
    }
    replay = true;
  } else {
    if (new_tokens > session->max_tokens - target.length) {
      return absl::OutOfRangeError(absl::StrCat(
          "session ", session->id, ": layer ", layer, " holds ", target.length, " tokens; ",
          new_tokens, " more pass its max_tokens of ", session->max_tokens));
    }
    // Blocks for the new tokens (and a copy of a shared last block), and a
    // run ahead of them when the cache would take one and there is room for
    // it without evicting and within the owner's quota.
    using BlocksAhead = core::LayerKvCache::BlocksAhead;
    const int64_t needed = target.cache->BlocksToTake(new_tokens, BlocksAhead::kNone);
    const int64_t run = target.cache->BlocksToTake(new_tokens, BlocksAhead::kTake);
    // And room for the answer kept for a retry.
    const int64_t answer = new_tokens * target.model->layer->config().d_model * 4;
    // And for the latest query it keeps.
    const int64_t query = target.model->layer->config().q_width() * 4;
    const int64_t other_bytes = (answer <= kMaxStoredOutputBytes ? answer : 0) + query;
    const bool quota = limits_.max_kv_bytes_per_owner > 0;
    const OwnerKvBytes held = quota ? OwnerBytesLocked(owner) : OwnerKvBytes{};
    const int64_t run_bytes = run * target.block_bytes;
    if (run > needed && (!quota || held.total() + run_bytes <= limits_.max_kv_bytes_per_owner) &&
        pool_->stats().bytes_in_use + reserved_bytes_ + stored_bytes_ + run_bytes + other_bytes <=
            limits_.kv_cache_bytes) {
      blocks_ahead = BlocksAhead::kTake;
    }
    const int64_t kv_bytes =
        (blocks_ahead == BlocksAhead::kTake ? run : needed) * target.block_bytes;
    const int64_t bytes = kv_bytes + other_bytes;
    if (quota) {
      if (held.total() + kv_bytes > limits_.max_kv_bytes_per_owner) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "this caller's sessions hold ", held.sessions, " bytes of KV cache",
            held.waiting_reads > 0
                ? absl::StrCat(" and its waiting GetLatestAttention reads ", held.waiting_reads,
                               " more (until they end)")
                : "",
            "; ", kv_bytes,
            " more pass its quota (--max_kv_bytes_per_token); close or truncate sessions"));
      }
    }
    while (pool_->stats().bytes_in_use + reserved_bytes_ + stored_bytes_ + bytes >
           limits_.kv_cache_bytes) {
      if (!EvictOneLocked(session.get(), Why::kEvictedForMemory)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the KV cache is full (--kv_cache_bytes ", limits_.kv_cache_bytes,
            ") with sessions that have steps in flight; this step needs ", bytes,
            " bytes more; retry"));
      }
    }
    reserved_bytes_ += bytes;
    reserved = bytes;
    reserved_kv = kv_bytes;
  }
  // The lease is made last: one dropped on an error path above would end a
  // step that never began.
  StepLease lease;
  lease.manager_ = this;
  lease.session_ = session;
  lease.layer_ = layer;
  lease.expected_length_ = expected_length;
  lease.new_tokens_ = new_tokens;
  lease.fingerprint_ = fingerprint;
  lease.replay_ = replay;
  lease.reserved_bytes_ = reserved;
  lease.kv_bytes_ = reserved_kv;
  lease.blocks_ahead_ = blocks_ahead;
  lease.unused_kv_bytes_ = reserved_kv;
  lease.first_position_ = session->first_position + expected_length;
  target.step_in_flight = true;
  ++session->steps_in_flight;
  session->last_used = clock_();
  return lease;
}

void SessionManager::NoteAppended(StepLease& lease) {
  if (lease.session_ == nullptr || lease.ended_ || lease.replay_) return;
  absl::MutexLock lock(&mu_);
  const SessionLayer& layer = lease.session_->layers[static_cast<size_t>(lease.layer_)];
  // Blocks the step's appends took beyond those the layer held when it began
  // (a copied shared last block stays reserved: at most one block over).
  const int64_t taken =
      std::max<int64_t>(0, layer.cache->blocks_held() - layer.blocks) *
      layer.block_bytes;
  const int64_t still_needed = std::max<int64_t>(0, lease.kv_bytes_ - taken);
  const int64_t give_back = lease.unused_kv_bytes_ - still_needed;
  if (give_back <= 0) return;
  lease.unused_kv_bytes_ -= give_back;
  lease.reserved_bytes_ -= give_back;
  reserved_bytes_ -= give_back;
}

void SessionManager::EndStep(StepLease lease, const absl::Status& status, std::string output) {
  EndStepOf(lease, status, std::move(output));
}

void SessionManager::EndStepOf(StepLease& lease, const absl::Status& status, std::string output) {
  if (lease.session_ == nullptr || lease.ended_) return;
  lease.ended_ = true;
  absl::MutexLock lock(&mu_);
  Session& session = *lease.session_;
  SessionLayer& layer = session.layers[static_cast<size_t>(lease.layer_)];
  reserved_bytes_ -= lease.reserved_bytes_;
  layer.step_in_flight = false;
  --session.steps_in_flight;
  session.last_used = clock_();
  if (lease.replay_) return;
  const auto live = sessions_.find(session.id);
  const bool removed = live == sessions_.end() || live->second.get() != &session;
  layer.length = layer.cache->length();
  layer.blocks = layer.cache->blocks_held();
  layer.blocks_ahead = static_cast<int64_t>(layer.cache->blocks_ahead().size());
  if (!removed) FollowLatestQueryBytes(layer, stored_bytes_);  // a removed session's went with it
  if (status.ok() && !removed) {  // a closed session keeps no answer
    stored_bytes_ -= static_cast<int64_t>(layer.last_output.size());
    layer.last_expected = lease.expected_length_;
    layer.last_tokens = lease.new_tokens_;
    layer.last_fingerprint = lease.fingerprint_;
    layer.last_output.clear();
    if (static_cast<int64_t>(output.size()) <= kMaxStoredOutputBytes) {
      layer.last_output = std::move(output);
      stored_bytes_ += static_cast<int64_t>(layer.last_output.size());
    }
  }
}

int SessionManager::ExpireIdle() {
  std::vector<std::shared_ptr<Session>> expired;  // freed after the lock is released
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_();
  for (const auto& [id, session] : sessions_) {
    if (session->ExpiredAt(now)) {
      expired.push_back(session);
    }
  }
  for (const std::shared_ptr<Session>& session : expired) {
    RemoveLocked(session->id, Why::kExpired);
  }
  expiries_ += static_cast<int64_t>(expired.size());
  return static_cast<int>(expired.size());
}

SessionStats SessionManager::stats() const {
  absl::MutexLock lock(&mu_);
  int64_t blocks_ahead = 0;
  for (const auto& [id, session] : sessions_) {
    for (const SessionLayer& layer : session->layers) blocks_ahead += layer.blocks_ahead;
  }
  return {.sessions = static_cast<int64_t>(sessions_.size()),
          .pool = pool_->stats(),
          .blocks_ahead = blocks_ahead,
          .kv_budget_bytes = limits_.kv_cache_bytes,
          .reserved_bytes = reserved_bytes_,
          .stored_bytes = stored_bytes_,
          .evictions_for_memory = evictions_for_memory_,
          .evictions_for_sessions = evictions_for_sessions_,
          .expiries = expiries_};
}

}  // namespace attnserve::server
