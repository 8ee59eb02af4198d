#include "server/scheduling/scheduler.h"

#include <atomic>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

// What the scheduler did with the test's work items.
struct Record {
  absl::Mutex mu;
  std::vector<std::vector<int>> batches ABSL_GUARDED_BY(mu);
  std::vector<BatchInfo> infos ABSL_GUARDED_BY(mu);
  std::vector<std::pair<int, absl::StatusCode>> skipped ABSL_GUARDED_BY(mu);
  // Rounds a work item still asks for after the one running (Requeue), by id.
  std::map<int, int> rounds_left ABSL_GUARDED_BY(mu);
  // The scheduler's reserved bytes as each batch ran.
  std::vector<int64_t> reserved ABSL_GUARDED_BY(mu);
};

class TestWork : public ScheduledWork {
 public:
  // `polled`, when given, counts the scheduler's IsCancelled polls (it polls
  // queued work when it sweeps the queue).
  TestWork(int id, uint64_t key, int64_t tokens, Record* record,
           const std::atomic<bool>* cancelled = nullptr, std::atomic<int>* polled = nullptr)
      : id_(id), record_(record), cancelled_(cancelled), polled_(polled) {
    batch_key = key;
    this->tokens = tokens;
  }
  int id() const { return id_; }
  bool IsCancelled() const override {
    if (polled_ != nullptr) ++*polled_;
    return cancelled_ != nullptr && cancelled_->load();
  }
  void Skip(absl::Status status) override {
    absl::MutexLock lock(&record_->mu);
    record_->skipped.emplace_back(id_, status.code());
  }

 private:
  const int id_;
  Record* const record_;
  const std::atomic<bool>* const cancelled_;
  std::atomic<int>* const polled_;
};

// An executor and a scheduler that record each batch.
struct Fixture {
  explicit Fixture(SchedulerOptions options) {
    executor = *ComputeExecutor::Create({.queue_capacity = 16});
    scheduler = *Scheduler::Create(
        options, executor.get(),
        [this](std::vector<std::unique_ptr<ScheduledWork>> batch, const BatchInfo& info) {
          std::vector<int> ids;
          for (const auto& work : batch) ids.push_back(static_cast<TestWork&>(*work).id());
          const int64_t reserved = scheduler->reserved_bytes();
          std::vector<std::unique_ptr<ScheduledWork>> again;
          {
            absl::MutexLock lock(&record.mu);
            record.batches.push_back(ids);
            record.infos.push_back(info);
            record.reserved.push_back(reserved);
            for (size_t i = 0; i < batch.size(); ++i) {
              auto left = record.rounds_left.find(ids[i]);
              if (left == record.rounds_left.end() || left->second == 0) continue;
              --left->second;
              again.push_back(std::move(batch[i]));
            }
          }
          for (auto& work : again) {
            work->tokens = 1;  // its next round's
            scheduler->Requeue(std::move(work));
          }
        });
  }
  // Occupies the executor until the returned notification is notified.
  std::shared_ptr<absl::Notification> Block() {
    auto release = std::make_shared<absl::Notification>();
    absl::Notification started;
    EXPECT_TRUE(executor->Submit([&started, release] {
                          started.Notify();
                          release->WaitForNotification();
                        })
                    .ok());
    started.WaitForNotification();
    return release;
  }
  absl::Status Submit(int id, uint64_t key, int64_t tokens, absl::Time deadline = absl::InfiniteFuture(),
                      const std::atomic<bool>* cancelled = nullptr, int64_t bytes = 0) {
    auto work = std::make_unique<TestWork>(id, key, tokens, &record, cancelled);
    work->deadline = deadline;
    work->memory_bytes = bytes;
    return scheduler->Submit(std::move(work));
  }

  Record record;
  std::unique_ptr<ComputeExecutor> executor;
  std::unique_ptr<Scheduler> scheduler;
};

TEST(Scheduler, BatchesQueuedRequestsOfOneKindWithinTheTokenBudget) {
  Fixture f({.queue_capacity = 10, .max_batch_tokens = 300});
  auto release = f.Block();
  ASSERT_TRUE(f.Submit(1, 7, 100).ok());
  ASSERT_TRUE(f.Submit(2, 9, 100).ok());
  ASSERT_TRUE(f.Submit(3, 7, 100).ok());
  ASSERT_TRUE(f.Submit(4, 7, 100).ok());
  ASSERT_TRUE(f.Submit(5, 7, 100).ok());
  ASSERT_TRUE(f.Submit(6, 7, 500).ok());  // over the budget: alone
  EXPECT_EQ(f.scheduler->queue_depth(), 6);
  release->Notify();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{1, 3, 4}, {2}, {5}, {6}};
  EXPECT_EQ(f.record.batches, expected);
  ASSERT_EQ(f.record.infos.size(), 4u);
  EXPECT_EQ(f.record.infos[0].requests, 3);
  EXPECT_EQ(f.record.infos[0].tokens, 300);
  EXPECT_EQ(f.record.infos[3].tokens, 500);
  EXPECT_TRUE(f.record.skipped.empty());
}

TEST(Scheduler, KeyZeroAndNoBudgetRunEveryRequestAlone) {
  for (int64_t budget : {int64_t{0}, int64_t{1000}}) {
    Fixture f({.max_batch_tokens = budget});
    auto release = f.Block();
    ASSERT_TRUE(f.Submit(1, budget == 0 ? 7 : 0, 10).ok());
    ASSERT_TRUE(f.Submit(2, budget == 0 ? 7 : 0, 10).ok());
    release->Notify();
    f.executor->Shutdown();
    absl::MutexLock lock(&f.record.mu);
    const std::vector<std::vector<int>> expected = {{1}, {2}};
    EXPECT_EQ(f.record.batches, expected) << "budget " << budget;
  }
}

TEST(Scheduler, ExpiredDeadlineIsSkippedWithoutRunning) {
  Fixture f({});
  auto release = f.Block();
  const absl::Time deadline = absl::Now() + absl::Milliseconds(1);
  ASSERT_TRUE(f.Submit(1, 7, 10, deadline).ok());
  ASSERT_TRUE(f.Submit(2, 7, 10).ok());
  // 1 expires while the executor is busy.
  while (absl::Now() <= deadline) absl::SleepFor(absl::Milliseconds(1));
  release->Notify();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{2}};
  EXPECT_EQ(f.record.batches, expected);
  ASSERT_EQ(f.record.skipped.size(), 1u);
  EXPECT_EQ(f.record.skipped[0].first, 1);
  EXPECT_EQ(f.record.skipped[0].second, absl::StatusCode::kDeadlineExceeded);
}

TEST(Scheduler, FullQueueIsResourceExhausted) {
  Fixture f({.queue_capacity = 2});
  auto release = f.Block();
  ASSERT_TRUE(f.Submit(1, 7, 10).ok());
  ASSERT_TRUE(f.Submit(2, 7, 10).ok());
  const absl::Status refused = f.Submit(3, 7, 10);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("queue is full"), absl::string_view::npos) << refused;
  release->Notify();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{1, 2}};
  EXPECT_EQ(f.record.batches, expected);
}

TEST(Scheduler, CancelledRequestReleasesItsSlot) {
  Fixture f({.queue_capacity = 1});
  auto release = f.Block();
  std::atomic<bool> cancelled{false};
  ASSERT_TRUE(f.Submit(1, 7, 10, absl::InfiniteFuture(), &cancelled).ok());
  EXPECT_EQ(f.Submit(2, 7, 10).code(), absl::StatusCode::kResourceExhausted);
  cancelled = true;
  // The full queue is swept: 1 is skipped at once and 2 takes its slot.
  ASSERT_TRUE(f.Submit(3, 7, 10).ok());
  {
    absl::MutexLock lock(&f.record.mu);
    ASSERT_EQ(f.record.skipped.size(), 1u);
    EXPECT_EQ(f.record.skipped[0].first, 1);
    EXPECT_EQ(f.record.skipped[0].second, absl::StatusCode::kCancelled);
  }
  release->Notify();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{3}};
  EXPECT_EQ(f.record.batches, expected);
}

TEST(Scheduler, InflightMemoryBudgetIsReservedAtAdmissionAndReleasedAfterwards) {
  Fixture f({.max_inflight_bytes = 1000});
  // More than the whole budget never fits: the request's fault, not load.
  const absl::Status too_big = f.Submit(1, 7, 10, absl::InfiniteFuture(), nullptr, 1001);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument) << too_big;
  EXPECT_NE(too_big.message().find("--max_inflight_bytes"), absl::string_view::npos) << too_big;
  auto release = f.Block();
  ASSERT_TRUE(f.Submit(2, 7, 10, absl::InfiniteFuture(), nullptr, 600).ok());
  EXPECT_EQ(f.scheduler->reserved_bytes(), 600);
  // What fits the budget but not beside what is reserved is load: later it fits.
  const absl::Status busy = f.Submit(3, 7, 10, absl::InfiniteFuture(), nullptr, 600);
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted) << busy;
  EXPECT_NE(busy.message().find("budget is taken"), absl::string_view::npos) << busy;
  ASSERT_TRUE(f.Submit(4, 7, 10, absl::InfiniteFuture(), nullptr, 400).ok());
  EXPECT_EQ(f.scheduler->reserved_bytes(), 1000);
  release->Notify();
  f.executor->Shutdown();
  EXPECT_EQ(f.scheduler->reserved_bytes(), 0);
  {
    absl::MutexLock lock(&f.record.mu);
    const std::vector<std::vector<int>> expected = {{2, 4}};
    EXPECT_EQ(f.record.batches, expected);
  }
}

TEST(Scheduler, MemoryKeptAfterRunStaysReservedUntilItsOwnerReleasesIt) {
  Fixture f({.max_inflight_bytes = 1000});
  // Run: 300 of its 700 bytes stay reserved (a response still being sent).
  auto kept = std::make_unique<TestWork>(1, 0, 10, &f.record);
  kept->memory_bytes = 700;
  kept->memory_kept_after_run = 300;
  ASSERT_TRUE(f.scheduler->Submit(std::move(kept)).ok());
  // Skipped: it never ran, so nothing of it stays reserved.
  auto release = f.Block();
  const std::atomic<bool> cancelled{true};
  auto skipped = std::make_unique<TestWork>(2, 0, 10, &f.record, &cancelled);
  skipped->memory_bytes = 200;
  skipped->memory_kept_after_run = 200;
  ASSERT_TRUE(f.scheduler->Submit(std::move(skipped)).ok());
  release->Notify();
  f.executor->Shutdown();
  EXPECT_EQ(f.scheduler->reserved_bytes(), 300);
  f.scheduler->ReleaseKept(300);
  EXPECT_EQ(f.scheduler->reserved_bytes(), 0);
}

TEST(Scheduler, QueueDelayHoldsABatchOpenUntilTheBudgetIsReached) {
  // A delay far longer than the test: the batch starts only because the
  // second request fills the budget.
  Fixture f({.max_batch_tokens = 200, .max_queue_delay = absl::Seconds(60)});
  std::atomic<int> polled{0};
  auto first = std::make_unique<TestWork>(1, 7, 100, &f.record, nullptr, &polled);
  ASSERT_TRUE(f.scheduler->Submit(std::move(first)).ok());
  // The executor has swept the queue (it polls 1 there): it holds the lock
  // from that sweep until it waits for the batch to fill, so the next Submit
  // comes while the batch is held open.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (polled.load() == 0) {
    ASSERT_LT(absl::Now(), give_up) << "the executor never looked at the queue";
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(f.Submit(2, 7, 100).ok());
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{1, 2}};
  EXPECT_EQ(f.record.batches, expected);
}

TEST(Scheduler, QueueDelayEndsABatchThatDoesNotFill) {
  Fixture f({.max_batch_tokens = 1000, .max_queue_delay = absl::Milliseconds(5)});
  ASSERT_TRUE(f.Submit(1, 7, 100).ok());
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{1}};
  EXPECT_EQ(f.record.batches, expected);
}

TEST(Scheduler, EveryRequestFromManyThreadsRunsOrIsRefusedExactlyOnce) {
  Fixture f({.queue_capacity = 8, .max_batch_tokens = 50,
             .max_queue_delay = absl::Microseconds(100), .max_inflight_bytes = 4000});
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  constexpr int kThreads = 4, kPerThread = 200;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&f, &refused, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int id = t * kPerThread + i;
        const absl::Time deadline =
            i % 7 == 0 ? absl::Now() + absl::Microseconds(50) : absl::InfiniteFuture();
        if (!f.Submit(id, 1 + id % 3, 1 + id % 20, deadline, nullptr, 100).ok()) ++refused;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  std::vector<int> seen(kThreads * kPerThread, 0);
  for (const auto& batch : f.record.batches) {
    for (int id : batch) ++seen[id];
  }
  for (const auto& [id, code] : f.record.skipped) ++seen[id];
  int handled = 0;
  for (int count : seen) {
    EXPECT_LE(count, 1);
    handled += count;
  }
  EXPECT_EQ(handled + refused.load(), kThreads * kPerThread);
  for (const BatchInfo& info : f.record.infos) EXPECT_LE(info.tokens, 50);
  EXPECT_EQ(f.scheduler->reserved_bytes(), 0);
}

// A prefill computed chunk by chunk: each round puts the request back
// (Requeue) behind what was queued meanwhile, holding its reservation.
TEST(Scheduler, ARequeuedRequestRunsAgainAfterWhatWasQueuedBehindIt) {
  Fixture f({.queue_capacity = 2, .max_batch_tokens = 0, .max_inflight_bytes = 1000});
  {
    absl::MutexLock lock(&f.record.mu);
    f.record.rounds_left[1] = 2;
  }
  auto release = f.Block();
  ASSERT_TRUE(f.Submit(1, 7, 300, absl::InfiniteFuture(), nullptr, 100).ok());
  ASSERT_TRUE(f.Submit(2, 7, 1, absl::InfiniteFuture(), nullptr, 10).ok());
  release->Notify();
  f.executor->Shutdown();  // runs what is queued, requeued rounds too
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{1}, {2}, {1}, {1}};
  EXPECT_EQ(f.record.batches, expected);
  // While 1 ran its later rounds it still held its 100 bytes (2's were gone).
  const std::vector<int64_t> reserved = {110, 110, 100, 100};
  EXPECT_EQ(f.record.reserved, reserved);
  EXPECT_EQ(f.record.infos[2].tokens, 1);  // the requeued round's tokens
  EXPECT_EQ(f.scheduler->reserved_bytes(), 0);
  EXPECT_TRUE(f.record.skipped.empty());
}

TEST(Scheduler, ARequeuedRequestJoinsTheBatchOfWhatWasQueuedBehindIt) {
  Fixture f({.queue_capacity = 4, .max_batch_tokens = 100});
  {
    absl::MutexLock lock(&f.record.mu);
    f.record.rounds_left[1] = 1;
  }
  auto release = f.Block();
  ASSERT_TRUE(f.Submit(1, 7, 90).ok());
  ASSERT_TRUE(f.Submit(2, 7, 20).ok());  // does not fit beside 1's first round
  ASSERT_TRUE(f.Submit(3, 9, 1).ok());   // another kind
  release->Notify();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  const std::vector<std::vector<int>> expected = {{1}, {2, 1}, {3}};
  EXPECT_EQ(f.record.batches, expected);
}

// Its caller gone between rounds: skipped once, as any queued request, and
// all of its reservation released.
TEST(Scheduler, ARequeuedRequestWhoseCallerCancelledIsSkippedOnce) {
  Fixture f({.queue_capacity = 4, .max_batch_tokens = 0, .max_inflight_bytes = 1000});
  std::atomic<bool> cancelled{false};
  {
    absl::MutexLock lock(&f.record.mu);
    f.record.rounds_left[1] = 5;
  }
  auto release = f.Block();
  ASSERT_TRUE(f.Submit(1, 7, 10, absl::InfiniteFuture(), &cancelled, 100).ok());
  // 2's round cancels 1, which is queued again behind it by then.
  auto work = std::make_unique<TestWork>(2, 7, 1, &f.record);
  ASSERT_TRUE(f.scheduler->Submit(std::move(work)).ok());
  {
    absl::MutexLock lock(&f.record.mu);
    f.record.rounds_left[2] = 0;
  }
  release->Notify();
  // Waits until 1's first round and 2 ran, then cancels 1 (queued again).
  {
    absl::MutexLock lock(&f.record.mu);
    f.record.mu.Await(absl::Condition(
        +[](Record* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) { return r->batches.size() >= 1; },
        &f.record));
  }
  cancelled = true;
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  int skipped = 0;
  for (const auto& [id, code] : f.record.skipped) {
    EXPECT_EQ(id, 1);
    EXPECT_EQ(code, absl::StatusCode::kCancelled);
    ++skipped;
  }
  int rounds = 0;
  for (const auto& batch : f.record.batches) rounds += batch[0] == 1 ? 1 : 0;
  // Skipped exactly once unless every round ran before the cancel was seen.
  EXPECT_EQ(skipped + (rounds == 6 ? 1 : 0), 1) << rounds << " rounds";
  EXPECT_EQ(f.scheduler->reserved_bytes(), 0);
}

// Requests submitted from threads while one requests round after round:
// each runs once, the requeued one every round, and nothing stays reserved.
TEST(Scheduler, RequeuedRoundsAndSubmitsFromManyThreadsAllRun) {
  Fixture f({.queue_capacity = 64, .max_batch_tokens = 40, .max_inflight_bytes = 100000});
  constexpr int kRounds = 30, kThreads = 3, kPerThread = 100;
  {
    absl::MutexLock lock(&f.record.mu);
    f.record.rounds_left[-1] = kRounds - 1;
  }
  ASSERT_TRUE(f.Submit(-1, 7, 10, absl::InfiniteFuture(), nullptr, 50).ok());
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&f, &refused, t] {
      for (int i = 0; i < kPerThread; ++i) {
        if (!f.Submit(t * kPerThread + i, 7, 1 + i % 5, absl::InfiniteFuture(), nullptr, 10).ok()) {
          ++refused;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  f.executor->Shutdown();
  absl::MutexLock lock(&f.record.mu);
  std::map<int, int> runs;
  for (const auto& batch : f.record.batches) {
    for (int id : batch) ++runs[id];
  }
  EXPECT_EQ(runs[-1], kRounds);
  int others = 0;
  for (const auto& [id, count] : runs) {
    if (id < 0) continue;
    EXPECT_EQ(count, 1) << id;
    ++others;
  }
  EXPECT_EQ(others + refused.load(), kThreads * kPerThread);
  EXPECT_TRUE(f.record.skipped.empty());
  EXPECT_EQ(f.scheduler->reserved_bytes(), 0);
}

}  // namespace
}  // namespace attnserve::server
