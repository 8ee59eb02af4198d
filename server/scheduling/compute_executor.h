#ifndef ATTNSERVE_SERVER_SCHEDULING_COMPUTE_EXECUTOR_H_
#define ATTNSERVE_SERVER_SCHEDULING_COMPUTE_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attnserve::server {

struct ComputeExecutorOptions {
  // Tasks waiting to run; a Submit beyond this is refused.
  int64_t queue_capacity = 64;
  // OpenMP threads the worker gives oneDNN; 0: one per core.
  int compute_threads = 0;
};

// The one thread that runs attention: it owns the cores (through OpenMP) so
// gRPC threads never compute. Tasks run in submission order.
//
// Thread-safe.
class ComputeExecutor {
 public:
  using Task = std::function<void()>;

  // INVALID_ARGUMENT for a non-positive capacity or negative thread count.
  static absl::StatusOr<std::unique_ptr<ComputeExecutor>> Create(
      const ComputeExecutorOptions& options);
  // Runs what is queued, then joins the worker (see Shutdown).
  ~ComputeExecutor();
  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  // Queues `task`. RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE
  // after Shutdown; the task is then dropped without running.
  absl::Status Submit(Task task);

  // Refuses new tasks, runs every task already queued, joins the worker.
  // Idempotent.
  void Shutdown();

  // Tasks queued and not yet started.
  int64_t queue_depth() const;

 private:
  explicit ComputeExecutor(const ComputeExecutorOptions& options);
  void WorkerLoop();

  // Constant after construction.
  const ComputeExecutorOptions options_;

  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;

  std::thread worker_;  // started in Create, joined in Shutdown
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SCHEDULING_COMPUTE_EXECUTOR_H_
