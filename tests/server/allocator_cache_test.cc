#include "server/allocator_cache.h"

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

// What the keeper sees and does, as the test drives it: when calls were last
// active (set by the test), how often it looked and called on_idle.
class Probe {
 public:
  // As AttentionServiceImpl::last_activity: now while a call is in flight,
  // else when the last one ended.
  void BeginCall() {
    absl::MutexLock lock(&mu_);
    in_flight_ = true;
  }
  void EndCall() {
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
    last_activity_ = absl::Now();
  }
  absl::Time last_activity() {
    absl::MutexLock lock(&mu_);
    return in_flight_ ? absl::Now() : last_activity_;
  }
  void OnIdle() {
    absl::MutexLock lock(&mu_);
    ++idle_calls_;
  }
  void OnLook() {
    absl::MutexLock lock(&mu_);
    ++looks_;
  }
  int64_t looks() {
    absl::MutexLock lock(&mu_);
    return looks_;
  }
  // Waits (without a time limit: the test's timeout bounds it) until on_idle
  // has been called `calls` times, then returns the looks made so far.
  int64_t AwaitIdleCalls(int64_t calls) {
    absl::MutexLock lock(&mu_);
    auto told = [this, calls]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return idle_calls_ >= calls; };
    mu_.Await(absl::Condition(&told));
    return looks_;
  }
  // Waits until the keeper has made `more` looks after the first `since`,
  // then returns on_idle's calls.
  int64_t AwaitLooks(int64_t since, int64_t more) {
    absl::MutexLock lock(&mu_);
    auto looked = [this, since, more]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return looks_ >= since + more;
    };
    mu_.Await(absl::Condition(&looked));
    return idle_calls_;
  }

 private:
  absl::Mutex mu_;
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_activity_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t idle_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t looks_ ABSL_GUARDED_BY(mu_) = 0;
};

AllocatorCacheOptions OptionsFor(Probe& probe) {
  return {.idle = absl::Milliseconds(20),
          .interval = absl::Milliseconds(2),
          .last_activity = [&probe] { return probe.last_activity(); },
          .on_idle = [&probe] { probe.OnIdle(); },
          .on_look = [&probe](int64_t, AllocatorCacheOptions::Release) { probe.OnLook(); }};
}

TEST(AllocatorCacheKeeper, TellsItsOwnerOnceEachTimeCallsTurnIdle) {
  Probe probe;
  AllocatorCacheKeeper keeper(OptionsFor(probe));
  // Never active: idle from the start, told once however long it lasts.
  const int64_t looks = probe.AwaitIdleCalls(1);
  EXPECT_EQ(probe.AwaitLooks(looks, 20), 1);

  // A call in flight for a while (however long the looks take), then quiet
  // again: told a second time, and again only once.
  probe.BeginCall();
  EXPECT_EQ(probe.AwaitLooks(probe.looks(), 5), 1) << "told while a call was in flight";
  const absl::Time before_end = absl::Now();
  probe.EndCall();
  const int64_t looks_again = probe.AwaitIdleCalls(2);
  EXPECT_GE(absl::Now() - before_end, absl::Milliseconds(20))
      << "told before the calls had been idle for the idle time";
  EXPECT_EQ(probe.AwaitLooks(looks_again, 20), 2);
}

TEST(AllocatorCacheKeeper, DoesNotTellWhileCallsAreActive) {
  Probe probe;
  probe.BeginCall();  // and it never ends
  AllocatorCacheKeeper keeper(OptionsFor(probe));
  EXPECT_EQ(probe.AwaitLooks(0, 30), 0);
}

}  // namespace
}  // namespace attnserve::server
