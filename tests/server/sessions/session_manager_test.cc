// SessionManager without gRPC or compute: the tests play the compute
// executor's part by appending K/V rows to a StepLease's cache themselves.
// Ids and owners, steps and their retries, races on a layer, token limits,
// eviction for memory and for --max_sessions, time-to-live on a fake clock,
// fork and truncate over shared blocks, close during a step, quotas, and
// threads churning over one pool (label tsan).
#include "server/sessions/session_manager.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

// A layer of d_model 64, 4 query heads and 2 KV heads of 16: a block of 4
// tokens holds 2 (K, V) x 2 heads x 4 tokens x 16 x 4 bytes = 1 KiB in FP32.
constexpr int kBlockTokens = 4;
constexpr int64_t kBlockBytes = 1024;

std::shared_ptr<const Model> TestModel(const std::string& name) {
  core::HeadConfig requested;
  requested.d_model = 64;
  requested.num_heads = 4;
  requested.num_kv_heads = 2;
  const core::HeadConfig config = *core::ResolveHeadConfig(requested);
  auto model = std::make_shared<Model>();
  model->name = name;
  model->layer = *core::AttentionLayer::Create(config, core::SeededWeights(config, 1));
  model->causal = true;
  return model;
}

// A fake clock the tests move.
struct FakeClock {
  absl::Mutex mu;
  absl::Time now = absl::FromUnixSeconds(1000);
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu);
    now += d;
  }
  SessionManager::Clock clock() {
    return [this] {
      absl::MutexLock lock(&mu);
      return now;
    };
  }
};

class SessionManagerTest : public ::testing::Test {
 protected:
  std::unique_ptr<SessionManager> Make(SessionLimits limits = {}) {
    limits.block_tokens = kBlockTokens;
    absl::StatusOr<std::unique_ptr<SessionManager>> manager =
        SessionManager::Create(limits, {.clock = clock_.clock(),
                                        .period = absl::ZeroDuration(),
                                        .on_look = {}});
    EXPECT_TRUE(manager.ok()) << manager.status();
    return *std::move(manager);
  }

  SessionSpec Spec(int layers = 2) {
    SessionSpec spec;
    for (int i = 0; i < layers; ++i) spec.layers.push_back(layer_);
    return spec;
  }

  // What the compute would do: appends n tokens of K/V to the lease's cache
  // and ends the step with `output`.
  static void Step(SessionManager& manager, StepLease lease, int64_t n, std::string output) {
    ASSERT_NE(lease.cache(), nullptr);
    const std::vector<float> rows(static_cast<size_t>(n * 2 * 16), 0.5f);
    ASSERT_TRUE(lease.cache()->Append(rows, rows, n, lease.blocks_ahead()).ok());
    manager.EndStep(std::move(lease), absl::OkStatus(), std::move(output));
  }

  // Begins and completes a step of n tokens on `layer`, expecting `length`.
  static void Extend(SessionManager& manager, const std::string& id, int layer, int64_t length,
                     int64_t n, const std::string& owner = "") {
    absl::StatusOr<StepLease> lease = manager.BeginStep(id, owner, layer, length, n, 7);
    ASSERT_TRUE(lease.ok()) << lease.status();
    Step(manager, *std::move(lease), n, "out");
  }

  FakeClock clock_;
  std::shared_ptr<const Model> layer_ = TestModel("decoder");
};

TEST_F(SessionManagerTest, OpensSessionsWithUnguessableIdsTheirOwnersAloneSee) {
  auto manager = Make();
  SessionSpec spec = Spec();
  spec.first_position = 7;
  absl::StatusOr<SessionInfo> a = manager->Open(spec, "alice");
  absl::StatusOr<SessionInfo> b = manager->Open(spec, "alice");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->id.size(), 32u);
  EXPECT_NE(a->id, b->id);
  EXPECT_EQ(a->models, (std::vector<std::string>{"decoder", "decoder"}));
  EXPECT_EQ(a->layer_lengths, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(a->first_position, 7);
  EXPECT_EQ(a->max_tokens, SessionLimits().max_session_tokens);
  EXPECT_EQ(a->idle_ttl, SessionLimits().default_idle_ttl);
  EXPECT_TRUE(manager->Get(a->id, "alice").ok());
  // Another caller: NOT_FOUND, worded as for an id that never existed.
  absl::Status other = manager->Get(a->id, "mallory").status();
  absl::Status unknown = manager->Get(std::string(32, 'a'), "mallory").status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(other.message(), "unknown session")) << other;
  EXPECT_TRUE(absl::StrContains(unknown.message(), "unknown session")) << unknown;
  EXPECT_EQ(manager->Close(a->id, "mallory").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager->Get("../etc/passwd", "alice").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, RefusesSpecsOutsideTheLimitsNamingTheField) {
  auto manager = Make({.max_session_tokens = 100});
  const auto refused = [&](SessionSpec spec, absl::string_view field) {
    absl::Status status = manager->Open(spec, "").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(absl::StartsWith(status.message(), field)) << status;
  };
  refused(Spec(0), "models");
  SessionSpec spec = Spec();
  spec.max_tokens = 101;
  refused(spec, "max_tokens");
  spec = Spec();
  spec.idle_ttl = absl::Hours(2);
  refused(spec, "idle_ttl");
  spec = Spec();
  spec.first_position = -1;
  refused(spec, "first_position");
}

TEST_F(SessionManagerTest, StepsGrowEachLayerOnItsOwnAtTheRightPositions) {
  auto manager = Make();
  SessionSpec spec = Spec();
  spec.first_position = 100;
  const std::string id = manager->Open(spec, "")->id;
  absl::StatusOr<StepLease> prefill = manager->BeginStep(id, "", 0, 0, 5, 7);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  EXPECT_EQ(prefill->first_position(), 100);
  EXPECT_FALSE(prefill->replay());
  Step(*manager, *std::move(prefill), 5, "prefill");
  absl::StatusOr<StepLease> decode = manager->BeginStep(id, "", 0, 5, 1, 7);
  ASSERT_TRUE(decode.ok()) << decode.status();
  EXPECT_EQ(decode->first_position(), 105);
  Step(*manager, *std::move(decode), 1, "decode");
  absl::StatusOr<SessionInfo> info = manager->Get(id, "");
  EXPECT_EQ(info->layer_lengths, (std::vector<int64_t>{6, 0}));
  EXPECT_EQ(info->kv_blocks, 2);  // 6 tokens in blocks of 4
  EXPECT_EQ(info->kv_bytes, 2 * kBlockBytes);
  EXPECT_EQ(manager->stats().pool.bytes_in_use, 2 * kBlockBytes);
  EXPECT_EQ(manager->stats().reserved_bytes, 0);
}

// A step appended in parts (a chunked prefill): after each part the pool
// counts the blocks it took, and the reservation gives them back, so the two
// never count a block twice while the rest of the step waits.
TEST_F(SessionManagerTest, APartOfAStepAppendedGivesBackItsReservedBlocks) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(1), "")->id;
  absl::StatusOr<StepLease> step = manager->BeginStep(id, "", 0, 0, 10, 7);  // 3 blocks of 4
  ASSERT_TRUE(step.ok()) << step.status();
  const int64_t reserved = manager->stats().reserved_bytes;
  EXPECT_GE(reserved, 3 * kBlockBytes);
  const std::vector<float> rows(static_cast<size_t>(5 * 2 * 16), 0.5f);
  ASSERT_TRUE(step->cache()->Append(rows, rows, 5).ok());  // 2 blocks taken
  manager->NoteAppended(*step);
  EXPECT_EQ(manager->stats().pool.bytes_in_use, 2 * kBlockBytes);
  EXPECT_EQ(manager->stats().reserved_bytes, reserved - 2 * kBlockBytes);
  manager->NoteAppended(*step);  // nothing more taken: nothing more given back
  EXPECT_EQ(manager->stats().reserved_bytes, reserved - 2 * kBlockBytes);
  ASSERT_TRUE(step->cache()->Append(rows, rows, 5).ok());  // the third block
  manager->NoteAppended(*step);
  EXPECT_EQ(manager->stats().reserved_bytes, reserved - 3 * kBlockBytes);
  manager->EndStep(*std::move(step), absl::OkStatus(), "prefill");
  EXPECT_EQ(manager->stats().reserved_bytes, 0);
  EXPECT_EQ(manager->stats().pool.bytes_in_use, 3 * kBlockBytes);
  EXPECT_EQ(manager->Get(id, "")->layer_lengths, (std::vector<int64_t>{10}));
}

TEST_F(SessionManagerTest, ARetryOfTheLastStepReplaysItAndOtherMismatchesAreAborted) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(), "")->id;
  Extend(*manager, id, 0, 0, 3);
  absl::StatusOr<StepLease> step = manager->BeginStep(id, "", 0, 3, 1, 7);
  Step(*manager, *std::move(step), 1, "the fourth token's output");
  // The same step again: its stored output, nothing appended.
  absl::StatusOr<StepLease> retry = manager->BeginStep(id, "", 0, 3, 1, 7);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(retry->replay());
  EXPECT_EQ(retry->cache(), nullptr);
  EXPECT_EQ(retry->stored_output(), "the fourth token's output");
  manager->EndStep(*std::move(retry), absl::OkStatus(), "");
  EXPECT_EQ(manager->Get(id, "")->layer_lengths[0], 4);
  // The same length and count with other inputs is another step.
  EXPECT_EQ(manager->BeginStep(id, "", 0, 3, 1, 8).status().code(), absl::StatusCode::kAborted);
  // Anything else that does not start at the layer's length.
  for (auto [expected, n] : {std::pair<int64_t, int64_t>{3, 2}, {2, 1}, {5, 1}}) {
    absl::Status status = manager->BeginStep(id, "", 0, expected, n, 7).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << expected << " " << n;
    EXPECT_TRUE(absl::StrContains(status.message(), "holds 4 tokens")) << status;
  }
}

TEST_F(SessionManagerTest, ASecondStepOnALayerInFlightIsAbortedAndOtherLayersProceed) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(), "")->id;
  absl::StatusOr<StepLease> first = manager->BeginStep(id, "", 0, 0, 1, 7);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(manager->BeginStep(id, "", 0, 0, 1, 7).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(manager->Fork(id, "").status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(manager->Truncate(id, "", 0, 0).status().code(), absl::StatusCode::kAborted);
  absl::StatusOr<StepLease> other_layer = manager->BeginStep(id, "", 1, 0, 1, 7);
  ASSERT_TRUE(other_layer.ok()) << other_layer.status();
  Step(*manager, *std::move(other_layer), 1, "x");
  Step(*manager, *std::move(first), 1, "y");
  EXPECT_TRUE(manager->BeginStep(id, "", 0, 1, 1, 7).ok());
}

TEST_F(SessionManagerTest, ALeaseDroppedWithoutEndStepFreesItsLayer) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(), "")->id;
  { absl::StatusOr<StepLease> dropped = manager->BeginStep(id, "", 0, 0, 2, 7); }
  EXPECT_EQ(manager->stats().reserved_bytes, 0);
  EXPECT_TRUE(manager->BeginStep(id, "", 0, 0, 2, 7).ok());
}

TEST_F(SessionManagerTest, AStepPastMaxTokensIsOutOfRange) {
  auto manager = Make();
  SessionSpec spec = Spec();
  spec.max_tokens = 5;
  const std::string id = manager->Open(spec, "")->id;
  Extend(*manager, id, 0, 0, 4);
  absl::Status status = manager->BeginStep(id, "", 0, 4, 2, 7).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(absl::StrContains(status.message(), "max_tokens of 5")) << status;
  Extend(*manager, id, 0, 4, 1);
}

TEST_F(SessionManagerTest, AFullCacheEvictsTheLeastRecentlyUsedIdleSession) {
  // A step reserves its KV blocks and room for the answer kept for a retry
  // (n x 64 x 4 bytes here). Room for 7 KiB: two sessions of 8 tokens (2 KiB
  // of blocks each, and 2 KiB reserved while a step runs) fit; a third step
  // of 8 tokens does not.
  auto manager = Make({.kv_cache_bytes = 7 * kBlockBytes});
  const std::string old_id = manager->Open(Spec(1), "")->id;
  Extend(*manager, old_id, 0, 0, 8);
  clock_.Advance(absl::Seconds(1));
  const std::string recent = manager->Open(Spec(1), "")->id;
  Extend(*manager, recent, 0, 0, 8);
  EXPECT_EQ(manager->stats().evictions_for_memory, 0);
  clock_.Advance(absl::Seconds(1));
  const std::string newcomer = manager->Open(Spec(1), "")->id;
  Extend(*manager, newcomer, 0, 0, 8);  // needs room: the oldest goes
  absl::Status gone = manager->Get(old_id, "").status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(gone.message(), "--kv_cache_bytes")) << gone;
  EXPECT_TRUE(manager->Get(recent, "").ok());
  EXPECT_EQ(manager->stats().evictions_for_memory, 1);
  EXPECT_LE(manager->stats().pool.bytes_held, 7 * kBlockBytes);
  // With every other session busy, a step that needs memory is refused.
  absl::StatusOr<StepLease> busy = manager->BeginStep(recent, "", 0, 8, 1, 7);
  ASSERT_TRUE(busy.ok());
  absl::Status refused = manager->BeginStep(newcomer, "", 0, 8, 8, 7).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(manager->Get(newcomer, "").ok());
  // Nobody else learns why an id is gone.
  EXPECT_TRUE(absl::StrContains(manager->Get(old_id, "mallory").status().message(),
                                "unknown session"));
}

// A step that crosses into a new block takes a run of blocks ahead (its
// cache took 16 blocks: a run of 4) where the cache has room for the run as
// well; where it has room for the block it needs only, it takes that one and
// evicts nobody for the rest.
TEST_F(SessionManagerTest, AStepTakesARunOfBlocksAheadOnlyWhereThereIsRoomWithoutEvicting) {
  using BlocksAhead = core::LayerKvCache::BlocksAhead;
  for (const bool room : {true, false}) {
    SCOPED_TRACE(room ? "room for the run" : "room for one block");
    // Held before the step: 17 blocks and under 1 KiB of stored answers. The
    // step reserves its blocks, 256 bytes for its answer and 256 for its query.
    auto manager = Make({.kv_cache_bytes = 17 * kBlockBytes + 512 + (room ? 5 : 2) * kBlockBytes});
    const std::string idle = manager->Open(Spec(1), "")->id;
    Extend(*manager, idle, 0, 0, 4);
    clock_.Advance(absl::Seconds(1));
    const std::string id = manager->Open(Spec(1), "")->id;
    for (int64_t length = 0; length < 64; length += 8) Extend(*manager, id, 0, length, 8);
    ASSERT_EQ(manager->stats().pool.blocks_in_use, 17);
    ASSERT_LT(manager->stats().stored_bytes, 1024);
    absl::StatusOr<StepLease> step = manager->BeginStep(id, "", 0, 64, 1, 7);
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ(step->blocks_ahead(), room ? BlocksAhead::kTake : BlocksAhead::kNone);
    Step(*manager, *std::move(step), 1, "decode");
    EXPECT_EQ(manager->Get(id, "")->kv_blocks, room ? 20 : 17);
    EXPECT_EQ(manager->stats().pool.blocks_in_use, room ? 21 : 18);
    EXPECT_EQ(manager->stats().blocks_ahead, room ? 3 : 0);
    EXPECT_EQ(manager->stats().reserved_bytes, 0);
    EXPECT_EQ(manager->stats().evictions_for_memory, 0);
    EXPECT_TRUE(manager->Get(idle, "").ok());
    if (room) {  // the next three blocks' tokens take nothing more from the pool
      for (int64_t length = 65; length < 65 + 12; length += 4) Extend(*manager, id, 0, length, 4);
      EXPECT_EQ(manager->Get(id, "")->kv_blocks, 20);
      EXPECT_EQ(manager->stats().pool.blocks_in_use, 21);
      EXPECT_EQ(manager->stats().blocks_ahead, 0);
      EXPECT_EQ(manager->stats().evictions_for_memory, 0);
    }
  }
}

// Room for 8 KiB here. A step of 8 tokens needs 4352 bytes: 2 KiB of blocks,
// 2 KiB reserved for its answer (8 x 64 x 4), 256 for its query.
TEST_F(SessionManagerTest, EvictionForMemoryCountsASharedSessionAsUsedWhenItsSharersWere) {
  auto manager = Make({.kv_cache_bytes = 8 * kBlockBytes});
  // A prefix and its fork share two blocks; a fork of the fork uses them
  // later, after another session of 2 blocks of its own.
  const std::string prefix = manager->Open(Spec(1), "")->id;
  Extend(*manager, prefix, 0, 0, 8);
  const std::string fork = manager->Fork(prefix, "")->id;
  clock_.Advance(absl::Seconds(1));
  const std::string own = manager->Open(Spec(1), "")->id;
  Extend(*manager, own, 0, 0, 8);
  clock_.Advance(absl::Seconds(1));
  const std::string fork_of_fork = manager->Fork(fork, "")->id;
  clock_.Advance(absl::Seconds(1));

  // The prefix is the least recently used, but evicting it gives nothing
  // back while its forks hold its blocks, and they were used after `own`:
  // `own` goes, alone (least recently used first took the prefix as well).
  const std::string newcomer = manager->Open(Spec(1), "")->id;
  Extend(*manager, newcomer, 0, 0, 8);
  EXPECT_EQ(manager->Get(own, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager->Get(prefix, "").ok());
  EXPECT_TRUE(manager->Get(fork, "").ok());
  EXPECT_TRUE(manager->Get(fork_of_fork, "").ok());
  EXPECT_EQ(manager->stats().evictions_for_memory, 1);
  EXPECT_EQ(manager->stats().pool.blocks_in_use, 4);
  clock_.Advance(absl::Seconds(1));

  // The three sharers, all used before the newcomer, go before it: the first
  // two give nothing back, the third then frees the blocks.
  const std::string next = manager->Open(Spec(1), "")->id;
  Extend(*manager, next, 0, 0, 8);
  for (const std::string& id : {prefix, fork, fork_of_fork}) {
    EXPECT_EQ(manager->Get(id, "").status().code(), absl::StatusCode::kNotFound) << id;
  }
  EXPECT_TRUE(manager->Get(newcomer, "").ok());
  EXPECT_EQ(manager->stats().evictions_for_memory, 4);
  EXPECT_EQ(manager->stats().pool.blocks_in_use, 4);
  EXPECT_LE(manager->stats().pool.bytes_held, 8 * kBlockBytes);
}

TEST_F(SessionManagerTest, OpeningAtMaxSessionsEvictsTheLeastRecentlyUsedIdleOne) {
  auto manager = Make({.max_sessions = 2});
  const std::string a = manager->Open(Spec(1), "")->id;
  clock_.Advance(absl::Seconds(1));
  const std::string b = manager->Open(Spec(1), "")->id;
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(manager->Get(a, "").ok());  // a Get is not a use: a stays older
  ASSERT_TRUE(manager->Open(Spec(1), "").ok());
  absl::Status gone = manager->Get(a, "").status();
  EXPECT_TRUE(absl::StrContains(gone.message(), "--max_sessions")) << gone;
  EXPECT_TRUE(manager->Get(b, "").ok());
  EXPECT_EQ(manager->stats().evictions_for_sessions, 1);
  EXPECT_EQ(manager->stats().sessions, 2);
}

TEST_F(SessionManagerTest, ForkingAtMaxSessionsNeverEvictsTheParent) {
  auto manager = Make({.max_sessions = 2});
  const std::string parent = manager->Open(Spec(1), "")->id;  // the least recently used
  clock_.Advance(absl::Seconds(1));
  const std::string other = manager->Open(Spec(1), "")->id;
  absl::StatusOr<SessionInfo> child = manager->Fork(parent, "");
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_TRUE(manager->Get(parent, "").ok());
  EXPECT_EQ(manager->Get(other, "").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, IdleSessionsExpireAtTheirTtlButNotWithAStepInFlight) {
  auto manager = Make();
  SessionSpec spec = Spec(1);
  spec.idle_ttl = absl::Seconds(10);
  const std::string idle = manager->Open(spec, "")->id;
  const std::string busy = manager->Open(spec, "")->id;
  absl::StatusOr<StepLease> step = manager->BeginStep(busy, "", 0, 0, 1, 7);
  clock_.Advance(absl::Seconds(11));
  absl::Status expired = manager->Get(idle, "").status();
  EXPECT_EQ(expired.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(expired.message(), "expired")) << expired;
  EXPECT_EQ(manager->ExpireIdle(), 0);  // busy has a step in flight
  Step(*manager, *std::move(step), 1, "x");
  clock_.Advance(absl::Seconds(11));
  EXPECT_EQ(manager->ExpireIdle(), 1);
  EXPECT_EQ(manager->stats().sessions, 0);
  EXPECT_EQ(manager->stats().expiries, 2);
  EXPECT_EQ(manager->stats().pool.bytes_in_use, 0);
}

// Room wanted, for memory or for --max_sessions: a session idle past its TTL
// goes first, as an expiry, though another idle one was used longer ago.
TEST_F(SessionManagerTest, ASessionPastItsTtlGoesBeforeTheLeastRecentlyUsedOne) {
  SessionSpec short_lived = Spec(1);
  short_lived.idle_ttl = absl::Seconds(10);
  {
    auto manager = Make({.max_sessions = 2});
    const std::string oldest = manager->Open(Spec(1), "")->id;  // the default TTL
    clock_.Advance(absl::Seconds(1));
    const std::string expired = manager->Open(short_lived, "")->id;
    clock_.Advance(absl::Seconds(11));
    ASSERT_TRUE(manager->Open(Spec(1), "").ok());
    // The counters first: a lookup of an expired session would expire it too.
    EXPECT_EQ(manager->stats().expiries, 1);
    EXPECT_EQ(manager->stats().evictions_for_sessions, 0);
    EXPECT_TRUE(manager->Get(oldest, "").ok());
    const absl::Status gone = manager->Get(expired, "").status();
    EXPECT_TRUE(absl::StrContains(gone.message(), "expired")) << gone;
  }
  {
    // Room for two sessions of 8 tokens (as in AFullCacheEvicts... above).
    auto manager = Make({.kv_cache_bytes = 7 * kBlockBytes});
    const std::string oldest = manager->Open(Spec(1), "")->id;
    Extend(*manager, oldest, 0, 0, 8);
    clock_.Advance(absl::Seconds(1));
    const std::string expired = manager->Open(short_lived, "")->id;
    Extend(*manager, expired, 0, 0, 8);
    clock_.Advance(absl::Seconds(11));
    const std::string newcomer = manager->Open(Spec(1), "")->id;
    Extend(*manager, newcomer, 0, 0, 8);  // needs room
    EXPECT_EQ(manager->stats().expiries, 1);
    EXPECT_EQ(manager->stats().evictions_for_memory, 0);
    EXPECT_TRUE(manager->Get(oldest, "").ok());
    const absl::Status gone = manager->Get(expired, "").status();
    EXPECT_TRUE(absl::StrContains(gone.message(), "expired")) << gone;
    EXPECT_LE(manager->stats().pool.bytes_held, 7 * kBlockBytes);
  }
}

TEST_F(SessionManagerTest, AForkSharesEveryBlockAndCopiesOnlyTheLastPartialOneToDiverge) {
  auto manager = Make();
  const std::string parent = manager->Open(Spec(1), "")->id;
  Extend(*manager, parent, 0, 0, 10);  // blocks of 4, 4, 2 tokens
  const int64_t before = manager->stats().pool.blocks_in_use;
  absl::StatusOr<SessionInfo> child = manager->Fork(parent, "");
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->layer_lengths[0], 10);
  EXPECT_EQ(manager->stats().pool.blocks_in_use, before);  // nothing copied
  Extend(*manager, child->id, 0, 10, 1);  // copies the shared partial block
  EXPECT_EQ(manager->stats().pool.blocks_in_use, before + 1);
  Extend(*manager, parent, 0, 10, 1);  // the parent's is its own again
  EXPECT_EQ(manager->stats().pool.blocks_in_use, before + 1);
  // The fork belongs to the same owner, and is gone with everything else.
  ASSERT_TRUE(manager->Close(parent, "").ok());
  ASSERT_TRUE(manager->Close(child->id, "").ok());
  EXPECT_EQ(manager->stats().pool.bytes_in_use, 0);
}

TEST_F(SessionManagerTest, TruncateReleasesBlocksAndForgetsTheLastStep) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(), "")->id;
  Extend(*manager, id, 0, 0, 9);
  Extend(*manager, id, 1, 0, 9);
  EXPECT_EQ(manager->Truncate(id, "", 0, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager->Truncate(id, "", 2, 1).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<SessionInfo> one = manager->Truncate(id, "", 0, 4);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->layer_lengths, (std::vector<int64_t>{4, 9}));
  EXPECT_EQ(one->kv_blocks, 1 + 3);
  absl::StatusOr<SessionInfo> all = manager->Truncate(id, "", -1, 2);
  EXPECT_EQ(all->layer_lengths, (std::vector<int64_t>{2, 2}));
  // The step before the truncation cannot be replayed.
  EXPECT_EQ(manager->BeginStep(id, "", 1, 0, 9, 7).status().code(), absl::StatusCode::kAborted);
  Extend(*manager, id, 1, 2, 1);
}

TEST_F(SessionManagerTest, CloseDuringAStepFreesTheMemoryWhenTheStepEnds) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(1), "")->id;
  absl::StatusOr<StepLease> step = manager->BeginStep(id, "", 0, 0, 6, 7);
  ASSERT_TRUE(manager->Close(id, "").ok());
  absl::Status closed = manager->Get(id, "").status();
  EXPECT_TRUE(absl::StrContains(closed.message(), "closed")) << closed;
  Step(*manager, *std::move(step), 6, "x");
  EXPECT_EQ(manager->stats().pool.bytes_in_use, 0);
  EXPECT_EQ(manager->stats().reserved_bytes, 0);
}

TEST_F(SessionManagerTest, TheLastEndedSessionsSayWhyAndTheOneBeforeThemIsUnknown) {
  auto manager = Make();
  constexpr size_t kRemembered = SessionManager::kRememberedEnds;
  std::vector<std::string> ids;
  for (size_t i = 0; i <= kRemembered; ++i) {  // the last one ends the first's record
    absl::StatusOr<SessionInfo> opened = manager->Open(Spec(1), i % 2 == 0 ? "alice" : "");
    ASSERT_TRUE(opened.ok()) << opened.status();
    ids.push_back(opened->id);
    ASSERT_TRUE(manager->Close(opened->id, i % 2 == 0 ? "alice" : "").ok());
    if (i == 0) {
      EXPECT_EQ(manager->Get(ids[0], "alice").status(),
                absl::NotFoundError(absl::StrCat("session ", ids[0], ": closed")));
    }
  }
  // The first of kRemembered + 1: forgotten, as if it never existed.
  EXPECT_EQ(manager->Get(ids[0], "alice").status(),
            absl::NotFoundError(absl::StrCat("session ", ids[0], ": unknown session")));
  // The second (an owner of "") and the last (alice's): remembered, for their owners.
  EXPECT_EQ(manager->Get(ids[1], "").status(),
            absl::NotFoundError(absl::StrCat("session ", ids[1], ": closed")));
  EXPECT_EQ(manager->Get(ids[1], "alice").status(),
            absl::NotFoundError(absl::StrCat("session ", ids[1], ": unknown session")));
  EXPECT_EQ(manager->Close(ids.back(), "alice"),
            absl::NotFoundError(absl::StrCat("session ", ids.back(), ": closed")));
  EXPECT_EQ(manager->Get(ids.back(), "").status(),
            absl::NotFoundError(absl::StrCat("session ", ids.back(), ": unknown session")));
  // An id that is not 32 lowercase hex digits is answered before any lookup,
  // a remembered one in capitals included.
  std::string upper = ids.back();
  for (char& c : upper) c = absl::ascii_toupper(c);
  ASSERT_NE(upper, ids.back());
  for (const std::string& bad :
       {std::string(), ids.back().substr(1), ids.back() + "0", upper,
        ids.back().substr(0, 31) + "g", std::string("../etc/passwd")}) {
    EXPECT_EQ(manager->Get(bad, "alice").status(),
              absl::NotFoundError("session_id: not a session id (32 hex digits)"))
        << bad;
  }
  EXPECT_EQ(manager->stats().sessions, 0);
}

TEST_F(SessionManagerTest, QuotasBoundEachCallersSessionsAndKvBytes) {
  auto manager = Make({.max_sessions_per_owner = 2, .max_kv_bytes_per_owner = 3 * kBlockBytes});
  const std::string a = manager->Open(Spec(1), "alice")->id;
  ASSERT_TRUE(manager->Open(Spec(1), "alice").ok());
  absl::Status third = manager->Open(Spec(1), "alice").status();
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(third.message(), "--max_sessions_per_token")) << third;
  EXPECT_TRUE(manager->Open(Spec(1), "bob").ok());
  Extend(*manager, a, 0, 0, 12, "alice");  // 3 blocks: the quota
  absl::Status more = manager->BeginStep(a, "alice", 0, 12, 1, 7).status();
  EXPECT_EQ(more.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(more.message(), "--max_kv_bytes_per_token")) << more;
}

TEST(SessionManagerThreads, ChurnOverOnePoolLeavesNothingBehind) {
  SessionLimits limits;
  limits.kv_cache_bytes = 64 * kBlockBytes;
  limits.block_tokens = kBlockTokens;
  limits.max_sessions = 16;
  auto manager = *SessionManager::Create(limits);
  const std::shared_ptr<const Model> model = TestModel("decoder");
  std::atomic<int64_t> steps{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::vector<std::string> mine;
      for (int i = 0; i < 300; ++i) {
        SessionSpec spec;
        spec.layers = {model, model};
        if (mine.empty() || rng() % 8 == 0) {
          absl::StatusOr<SessionInfo> opened = manager->Open(spec, "");
          if (opened.ok()) mine.push_back(opened->id);
          continue;
        }
        const std::string& id = mine[rng() % mine.size()];
        absl::StatusOr<SessionInfo> info = manager->Get(id, "");
        if (!info.ok()) continue;  // evicted by another thread's steps
        const int layer = static_cast<int>(rng() % 2);
        switch (rng() % 6) {
          case 0:
            if (absl::StatusOr<SessionInfo> child = manager->Fork(id, ""); child.ok()) {
              mine.push_back(child->id);
            }
            break;
          case 1:
            (void)manager->Truncate(id, "", layer, info->layer_lengths[layer] / 2);
            break;
          case 2:
            (void)manager->Close(id, "");
            break;
          default: {
            const int64_t n = 1 + rng() % 5;
            absl::StatusOr<StepLease> lease =
                manager->BeginStep(id, "", layer, info->layer_lengths[layer], n, 7);
            if (!lease.ok()) break;
            const std::vector<float> rows(static_cast<size_t>(n * 2 * 16), 1.0f);
            absl::Status appended = lease->cache()->Append(rows, rows, n);
            EXPECT_TRUE(appended.ok()) << appended;  // the reservation holds
            manager->EndStep(*std::move(lease), appended, "out");
            ++steps;
          }
        }
        if (rng() % 16 == 0) manager->ExpireIdle();
        (void)manager->stats();
      }
      for (const std::string& id : mine) (void)manager->Close(id, "");
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_GT(steps.load(), 100);
  const SessionStats stats = manager->stats();
  EXPECT_EQ(stats.sessions, 0);
  EXPECT_EQ(stats.reserved_bytes, 0);
  EXPECT_EQ(stats.pool.bytes_in_use, 0);
  EXPECT_LE(stats.pool.bytes_held, limits.kv_cache_bytes);
}

TEST(SessionManagerUpkeep, ExpiresIdleSessionsOnItsOwnAndReportsTheStats) {
  SessionLimits limits;
  limits.block_tokens = kBlockTokens;
  absl::Mutex mu;
  std::vector<SessionStats> looks;
  auto manager = *SessionManager::Create(
      limits, {.period = absl::Milliseconds(5), .on_look = [&](const SessionStats& stats) {
                 absl::MutexLock lock(&mu);
                 looks.push_back(stats);
               }});
  SessionSpec spec;
  spec.layers = {TestModel("decoder")};
  spec.idle_ttl = absl::Milliseconds(1);
  ASSERT_TRUE(manager->Open(spec, "").ok());
  // Wait for what we can observe: a look that saw the session expired.
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::vector<SessionStats>* seen) { return !seen->empty() && seen->back().expiries == 1; },
      &looks));
  EXPECT_EQ(looks.back().sessions, 0);
}

// The latest token's query and the K rows a test's steps append, with the
// float64 reference of what the query attends to.
struct LatestRows {
  std::mt19937 random{42};
  std::vector<float> keys;  // [L, 2 KV heads, 16], every step's
  // A step of n tokens: random K (and V) rows and a random query [4, 16]
  // for its last token, kept in the lease's cache as Extend keeps it.
  void Step(SessionManager& manager, StepLease lease, int64_t n) {
    std::normal_distribution<float> normal;
    std::vector<float> k(static_cast<size_t>(n * 2 * 16)), q(4 * 16);
    for (float& x : k) x = normal(random);
    for (float& x : q) x = normal(random);
    ASSERT_NE(lease.cache(), nullptr);
    ASSERT_TRUE(lease.cache()->Append(k, k, n).ok());
    lease.cache()->SetLatestQuery(q);
    keys.insert(keys.end(), k.begin(), k.end());
    query = q;
    manager.EndStep(std::move(lease), absl::OkStatus(), "out");
  }
  // softmax(q_h . K_g[j] / sqrt(16)) over the first `length` tokens, g = h / 2.
  std::vector<double> Reference(int64_t length) const {
    std::vector<double> maps(static_cast<size_t>(4 * length));
    for (int h = 0; h < 4; ++h) {
      std::vector<double> s(static_cast<size_t>(length));
      double m = -1e300, sum = 0;
      for (int64_t j = 0; j < length; ++j) {
        double dot = 0;
        for (int d = 0; d < 16; ++d) {
          dot += double{query[static_cast<size_t>(h * 16 + d)]} *
                 keys[static_cast<size_t>((j * 2 + h / 2) * 16 + d)];
        }
        s[static_cast<size_t>(j)] = dot / 4.0;
        m = std::max(m, s[static_cast<size_t>(j)]);
      }
      for (double& x : s) sum += (x = std::exp(x - m));
      for (int64_t j = 0; j < length; ++j) {
        maps[static_cast<size_t>(h * length + j)] = s[static_cast<size_t>(j)] / sum;
      }
    }
    return maps;
  }
  std::vector<float> query;
};

constexpr int64_t kNoMapLimit = int64_t{1} << 30;
constexpr char kFlags[] = "--max_attention_map_bytes";

// GetLatestAttention's two parts as the service runs them: the snapshot under
// the manager's lock, then the read without it.
absl::StatusOr<LatestAttentionRead> ReadLatestAttention(SessionManager& manager,
                                                        absl::string_view id,
                                                        absl::string_view owner, int layer,
                                                        int64_t max_map_bytes) {
  absl::StatusOr<LatestSnapshot> snapshot =
      manager.SnapshotLatest(id, owner, layer, max_map_bytes, kFlags);
  if (!snapshot.ok()) return snapshot.status();
  return SessionManager::ReadLatest(*snapshot);
}

TEST_F(SessionManagerTest, LatestAttentionIsTheKeptQueryOverEveryCachedKey) {
  auto manager = Make();
  SessionSpec spec = Spec(2);
  spec.first_position = 5;
  const std::string id = manager->Open(spec, "alice")->id;
  LatestRows rows;
  // Layer 0: a prefill of 6 (two blocks), then a decode step.
  rows.Step(*manager, *manager->BeginStep(id, "alice", 0, 0, 6, 1), 6);
  for (int64_t length : {6, 7}) {
    if (length == 7) rows.Step(*manager, *manager->BeginStep(id, "alice", 0, 6, 1, 2), 1);
    absl::StatusOr<LatestAttentionRead> read =
        ReadLatestAttention(*manager, id, "alice", 0, kNoMapLimit);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->length, length);
    EXPECT_EQ(read->position, 5 + length - 1);
    ASSERT_EQ(read->num_heads, 4);
    ASSERT_EQ(read->maps.size(), static_cast<size_t>(4 * length));
    const std::vector<double> reference = rows.Reference(length);
    for (size_t i = 0; i < reference.size(); ++i) {
      EXPECT_NEAR(read->maps[i], reference[i], 1e-6) << "at " << i;
    }
    for (int h = 0; h < 4; ++h) {
      double entropy = 0, max_weight = 0;
      for (int64_t j = 0; j < length; ++j) {
        const double p = reference[static_cast<size_t>(h * length + j)];
        entropy -= p * std::log(p);
        max_weight = std::max(max_weight, p);
      }
      EXPECT_NEAR(read->entropy[static_cast<size_t>(h)], entropy, 1e-5);
      EXPECT_NEAR(read->max_weight[static_cast<size_t>(h)], max_weight, 1e-6);
    }
  }
  // The query counts with the stored answers: 4 heads x 16 floats.
  EXPECT_EQ(manager->stats().stored_bytes, 4 * 16 * 4 + 3);
  // Layer 1 has no tokens; a layer out of range; another owner; the limit.
  absl::Status empty = ReadLatestAttention(*manager, id, "alice", 1, kNoMapLimit).status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(empty.message(), "holds no tokens")) << empty;
  EXPECT_TRUE(absl::StrContains(empty.message(), "extend it by a token first")) << empty;
  absl::Status bad = ReadLatestAttention(*manager, id, "alice", 2, kNoMapLimit).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(bad.message(), "layer:")) << bad;
  EXPECT_EQ(ReadLatestAttention(*manager, id, "alice", -1, kNoMapLimit).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status other = ReadLatestAttention(*manager, id, "mallory", 0, kNoMapLimit).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(other.message(), "unknown session")) << other;
  // 4 heads x 7 tokens x 4 bytes = 112 bytes.
  EXPECT_TRUE(ReadLatestAttention(*manager, id, "alice", 0, 112).ok());
  absl::Status over = ReadLatestAttention(*manager, id, "alice", 0, 111).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.message(), kFlags)) << over;
}

TEST_F(SessionManagerTest, LatestAttentionFollowsForksRetriesTruncatesAndSteps) {
  auto manager = Make();
  const std::string id = manager->Open(Spec(1), "")->id;
  LatestRows rows;
  rows.Step(*manager, *manager->BeginStep(id, "", 0, 0, 5, 1), 5);
  rows.Step(*manager, *manager->BeginStep(id, "", 0, 5, 1, 2), 1);
  const std::vector<float> before = ReadLatestAttention(*manager, id, "", 0, kNoMapLimit)->maps;

  // A fork reads the same; the parent's next step does not change the fork's.
  const std::string fork = manager->Fork(id, "")->id;
  EXPECT_EQ(ReadLatestAttention(*manager, fork, "", 0, kNoMapLimit)->maps, before);
  EXPECT_EQ(manager->stats().stored_bytes, 2 * 4 * 16 * 4 + 3);

  // A retry of the last step replays: nothing changes.
  absl::StatusOr<StepLease> retry = manager->BeginStep(id, "", 0, 5, 1, 2);
  ASSERT_TRUE(retry.ok() && retry->replay()) << retry.status();
  // While a step is in flight on the layer: ABORTED, as a second step.
  absl::Status racing = ReadLatestAttention(*manager, id, "", 0, kNoMapLimit).status();
  EXPECT_EQ(racing.code(), absl::StatusCode::kAborted) << racing;
  manager->EndStep(*std::move(retry), absl::OkStatus(), "out");
  EXPECT_EQ(ReadLatestAttention(*manager, id, "", 0, kNoMapLimit)->maps, before);

  // A failed step leaves the cache and its query as they were.
  manager->EndStep(*manager->BeginStep(id, "", 0, 6, 1, 3), absl::InternalError("compute"), "");
  EXPECT_EQ(ReadLatestAttention(*manager, id, "", 0, kNoMapLimit)->maps, before);

  rows.Step(*manager, *manager->BeginStep(id, "", 0, 6, 1, 4), 1);
  EXPECT_EQ(ReadLatestAttention(*manager, fork, "", 0, kNoMapLimit)->maps, before);
  EXPECT_EQ(ReadLatestAttention(*manager, id, "", 0, kNoMapLimit)->length, 7);

  // Truncating to the same length keeps the query; shorter drops it.
  ASSERT_TRUE(manager->Truncate(id, "", 0, 7).ok());
  EXPECT_TRUE(ReadLatestAttention(*manager, id, "", 0, kNoMapLimit).ok());
  ASSERT_TRUE(manager->Truncate(id, "", 0, 4).ok());
  absl::Status dropped = ReadLatestAttention(*manager, id, "", 0, kNoMapLimit).status();
  EXPECT_EQ(dropped.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(dropped.message(), "truncated since its last step")) << dropped;
  EXPECT_TRUE(absl::StrContains(dropped.message(), "extend it by a token first")) << dropped;
  EXPECT_EQ(manager->stats().stored_bytes, 4 * 16 * 4);  // the fork's query only
  // One more step and the read works again, over the 5 tokens.
  rows.keys.resize(4 * 2 * 16);
  rows.Step(*manager, *manager->BeginStep(id, "", 0, 4, 1, 5), 1);
  absl::StatusOr<LatestAttentionRead> again =
      ReadLatestAttention(*manager, id, "", 0, kNoMapLimit);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<double> reference = rows.Reference(5);
  ASSERT_EQ(again->maps.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) EXPECT_NEAR(again->maps[i], reference[i], 1e-6);
  ASSERT_TRUE(manager->Close(fork, "").ok());
  ASSERT_TRUE(manager->Close(id, "").ok());
  EXPECT_EQ(manager->stats().stored_bytes, 0);
}

// A read waiting in the queue holds its layer's blocks through a snapshot.
// While the session holds them too they count once; once the session lets
// them go (closed here) they count against the owner until the read ends, so
// closing and reopening cannot take more than the quota.
TEST_F(SessionManagerTest, BlocksAWaitingReadHoldsCountAgainstItsOwnerOnceTheSessionLetsThemGo) {
  auto manager = Make({.max_kv_bytes_per_owner = 6 * kBlockBytes});
  const std::string first = manager->Open(Spec(1), "alice")->id;
  LatestRows rows;
  rows.Step(*manager, *manager->BeginStep(first, "alice", 0, 0, 12, 1), 12);  // 3 blocks
  absl::StatusOr<LatestSnapshot> waiting =
      manager->SnapshotLatest(first, "alice", 0, kNoMapLimit, kFlags);
  ASSERT_TRUE(waiting.ok()) << waiting.status();

  // The snapshot adds nothing while the session holds its blocks: a second
  // session takes the other 3 blocks of the quota.
  const std::string second = manager->Open(Spec(1), "alice")->id;
  Extend(*manager, second, 0, 0, 12, "alice");
  absl::Status full = manager->BeginStep(second, "alice", 0, 12, 1, 7).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  ASSERT_TRUE(manager->Close(second, "alice").ok());

  // Closed, the first session's 3 blocks stay taken by the read: they count.
  ASSERT_TRUE(manager->Close(first, "alice").ok());
  EXPECT_EQ(manager->stats().pool.blocks_in_use, 3);
  const std::string third = manager->Open(Spec(1), "alice")->id;
  Extend(*manager, third, 0, 0, 12, "alice");  // 3 + 3 blocks: the quota
  absl::Status over = manager->BeginStep(third, "alice", 0, 12, 1, 7).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.message(), "--max_kv_bytes_per_token")) << over;
  EXPECT_TRUE(absl::StrContains(over.message(), "sessions hold 3072 bytes of KV cache and its "
                                                "waiting GetLatestAttention reads 3072 more"))
      << over;
  // Another owner's quota is its own.
  const std::string bobs = manager->Open(Spec(1), "bob")->id;
  Extend(*manager, bobs, 0, 0, 24, "bob");  // 6 blocks

  // The read still sees what it took, against the reference.
  absl::StatusOr<LatestAttentionRead> read = SessionManager::ReadLatest(*waiting);
  ASSERT_TRUE(read.ok()) << read.status();
  const std::vector<double> reference = rows.Reference(12);
  ASSERT_EQ(read->maps.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_NEAR(read->maps[i], reference[i], 1e-6) << "at " << i;
  }

  // The read ends: its blocks go back to the pool and leave alice's count.
  waiting->Release();
  EXPECT_EQ(manager->stats().pool.blocks_in_use, 3 + 6);
  rows.Step(*manager, *manager->BeginStep(third, "alice", 0, 12, 1, 9), 1);  // 4 blocks
  // A snapshot destroyed without Release leaves the count as well.
  {
    absl::StatusOr<LatestSnapshot> dropped =
        manager->SnapshotLatest(third, "alice", 0, kNoMapLimit, kFlags);
    ASSERT_TRUE(dropped.ok()) << dropped.status();
    ASSERT_TRUE(manager->Truncate(third, "alice", 0, 0).ok());
    absl::Status taken = manager->BeginStep(third, "alice", 0, 0, 9, 8).status();
    EXPECT_EQ(taken.code(), absl::StatusCode::kResourceExhausted) << taken;
  }
  Extend(*manager, third, 0, 0, 24, "alice");  // 6 blocks: the whole quota again
}

// The blocks count by which ones no session holds: two reads of one layer
// count its blocks once, a fork that still holds them keeps them uncounted,
// and a layer truncated and extended again does not hide the old blocks the
// read still holds.
TEST_F(SessionManagerTest, WaitingReadsCountEachBlockOnceAndOnlyWhenNoSessionHoldsIt) {
  auto manager = Make({.max_kv_bytes_per_owner = 8 * kBlockBytes});
  LatestRows rows;
  const std::string a = manager->Open(Spec(1), "alice")->id;
  rows.Step(*manager, *manager->BeginStep(a, "alice", 0, 0, 16, 1), 16);  // 4 blocks
  const std::string fork = manager->Fork(a, "alice")->id;  // counts its 4 shared blocks too
  absl::StatusOr<LatestSnapshot> one = manager->SnapshotLatest(a, "alice", 0, kNoMapLimit, kFlags);
  absl::StatusOr<LatestSnapshot> two = manager->SnapshotLatest(a, "alice", 0, kNoMapLimit, kFlags);
  ASSERT_TRUE(one.ok() && two.ok());
  ASSERT_TRUE(manager->Close(a, "alice").ok());
  // The fork holds the blocks: the reads add nothing, the fork may grow into
  // the 4 blocks a's close gave back.
  Extend(*manager, fork, 0, 16, 16, "alice");
  ASSERT_TRUE(manager->Close(fork, "alice").ok());
  // Now only the two reads hold a's 4 blocks: counted once.
  const std::string b = manager->Open(Spec(1), "alice")->id;
  rows.Step(*manager, *manager->BeginStep(b, "alice", 0, 0, 16, 2), 16);  // 4 + 4: the quota
  EXPECT_EQ(manager->BeginStep(b, "alice", 0, 16, 1, 3).status().code(),
            absl::StatusCode::kResourceExhausted);
  one->Release();
  two->Release();

  // A read of b, then b truncated and extended again: the read's 4 old
  // blocks are no session's, though b holds as many blocks as before.
  absl::StatusOr<LatestSnapshot> three =
      manager->SnapshotLatest(b, "alice", 0, kNoMapLimit, kFlags);
  ASSERT_TRUE(three.ok()) << three.status();
  ASSERT_TRUE(manager->Truncate(b, "alice", 0, 0).ok());
  Extend(*manager, b, 0, 0, 16, "alice");  // 4 + 4: the quota
  absl::Status over = manager->BeginStep(b, "alice", 0, 16, 1, 4).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  three->Release();
  Extend(*manager, b, 0, 16, 16, "alice");  // 8 blocks: the whole quota again
}


// A session whose blocks a waiting GetLatestAttention read also holds gives
// nothing back while the read waits: it counts as used now.
TEST_F(SessionManagerTest, EvictionForMemoryPassesOverASessionAWaitingReadHolds) {
  auto manager = Make({.kv_cache_bytes = 8 * kBlockBytes});
  LatestRows rows;
  const std::string read_one = manager->Open(Spec(1), "")->id;
  rows.Step(*manager, *manager->BeginStep(read_one, "", 0, 0, 8, 1), 8);  // 2 blocks
  absl::StatusOr<LatestSnapshot> waiting =
      manager->SnapshotLatest(read_one, "", 0, kNoMapLimit, kFlags);
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  clock_.Advance(absl::Seconds(1));
  const std::string own = manager->Open(Spec(1), "")->id;
  Extend(*manager, own, 0, 0, 8);
  clock_.Advance(absl::Seconds(1));
  const std::string newcomer = manager->Open(Spec(1), "")->id;
  Extend(*manager, newcomer, 0, 0, 8);
  EXPECT_EQ(manager->Get(own, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager->Get(read_one, "").ok());
  EXPECT_EQ(manager->stats().evictions_for_memory, 1);
  // The read still answers against the reference.
  absl::StatusOr<LatestAttentionRead> read = SessionManager::ReadLatest(*waiting);
  ASSERT_TRUE(read.ok()) << read.status();
  const std::vector<double> reference = rows.Reference(8);
  ASSERT_EQ(read->maps.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_NEAR(read->maps[i], reference[i], 1e-6) << "at " << i;
  }
}
}  // namespace
}  // namespace attnserve::server
