#include "server/scheduling/compute_executor.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

TEST(ComputeExecutor, RunsTasksInSubmissionOrderOnOneThread) {
  auto executor = ComputeExecutor::Create({.queue_capacity = 100});
  ASSERT_TRUE(executor.ok()) << executor.status();
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  absl::Notification done;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE((*executor)
                    ->Submit([&, i] {
                      order.push_back(i);
                      threads.push_back(std::this_thread::get_id());
                      if (i == 49) done.Notify();
                    })
                    .ok());
  }
  done.WaitForNotification();
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
  for (const auto& id : threads) EXPECT_EQ(id, threads[0]);
  EXPECT_NE(threads[0], std::this_thread::get_id());
}

TEST(ComputeExecutor, FullQueueIsResourceExhaustedAndFreesWhenDrained) {
  auto executor = ComputeExecutor::Create({.queue_capacity = 2});
  ASSERT_TRUE(executor.ok());
  absl::Notification started, release;
  // Occupies the worker, so the next tasks stay queued.
  ASSERT_TRUE((*executor)->Submit([&] { started.Notify(); release.WaitForNotification(); }).ok());
  started.WaitForNotification();
  std::atomic<int> ran{0};
  ASSERT_TRUE((*executor)->Submit([&] { ++ran; }).ok());
  ASSERT_TRUE((*executor)->Submit([&] { ++ran; }).ok());
  EXPECT_EQ((*executor)->queue_depth(), 2);
  absl::Status refused = (*executor)->Submit([&] { ++ran; });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  release.Notify();
  (*executor)->Shutdown();
  EXPECT_EQ(ran.load(), 2);
}

TEST(ComputeExecutor, ShutdownRunsQueuedTasksThenRefusesNewOnes) {
  auto executor = ComputeExecutor::Create({.queue_capacity = 10});
  ASSERT_TRUE(executor.ok());
  std::atomic<int> ran{0};
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*executor)->Submit([&] { ++ran; }).ok());
  (*executor)->Shutdown();
  EXPECT_EQ(ran.load(), 5);
  EXPECT_EQ((*executor)->Submit([&] { ++ran; }).code(), absl::StatusCode::kUnavailable);
  (*executor)->Shutdown();  // idempotent
}

TEST(ComputeExecutor, RejectsBadOptions) {
  EXPECT_EQ(ComputeExecutor::Create({.queue_capacity = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeExecutor::Create({.queue_capacity = 1, .compute_threads = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve::server
