#include "server/scheduling/compute_executor.h"

#include <omp.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve::server {

absl::StatusOr<std::unique_ptr<ComputeExecutor>> ComputeExecutor::Create(
    const ComputeExecutorOptions& options) {
  if (options.queue_capacity <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity: must be positive, got ", options.queue_capacity));
  }
  if (options.compute_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute_threads: must be >= 0, got ", options.compute_threads));
  }
  std::unique_ptr<ComputeExecutor> executor(new ComputeExecutor(options));
  executor->worker_ = std::thread([raw = executor.get()] { raw->WorkerLoop(); });
  return executor;
}

ComputeExecutor::ComputeExecutor(const ComputeExecutorOptions& options) : options_(options) {}

ComputeExecutor::~ComputeExecutor() { Shutdown(); }

absl::Status ComputeExecutor::Submit(Task task) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.queue_capacity) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "compute queue is full (", options_.queue_capacity, " requests waiting); retry later"));
  }
  queue_.push_back(std::move(task));
  return absl::OkStatus();
}

void ComputeExecutor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
  }
  if (worker_.joinable()) worker_.join();
}

int64_t ComputeExecutor::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void ComputeExecutor::WorkerLoop() {
  // OpenMP's thread count is a per-thread setting: set it on the thread that
  // enters oneDNN's parallel regions.
  if (options_.compute_threads > 0) omp_set_num_threads(options_.compute_threads);
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !queue_.empty() || shutting_down_;
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // shutting down and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace attnserve::server
