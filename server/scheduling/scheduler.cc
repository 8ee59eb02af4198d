#include "server/scheduling/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve::server {

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(const SchedulerOptions& options,
                                                             ComputeExecutor* executor,
                                                             RunBatch run_batch) {
  if (options.queue_capacity <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity: must be positive, got ", options.queue_capacity));
  }
  if (options.max_batch_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch_tokens: must be >= 0, got ", options.max_batch_tokens));
  }
  if (options.max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_queue_delay: must be >= 0");
  }
  if (options.max_inflight_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_inflight_bytes: must be positive, got ", options.max_inflight_bytes));
  }
  if (executor == nullptr || run_batch == nullptr) {
    return absl::InvalidArgumentError("executor and run_batch: required");
  }
  return std::unique_ptr<Scheduler>(new Scheduler(options, executor, std::move(run_batch)));
}

Scheduler::Scheduler(const SchedulerOptions& options, ComputeExecutor* executor,
                     RunBatch run_batch)
    : options_(options), executor_(executor), run_batch_(std::move(run_batch)) {}

absl::Status Scheduler::Submit(std::unique_ptr<ScheduledWork> work) {
  // More than the whole budget can never be admitted, however idle the server
  // is: the request's fault, not load.
  if (work->memory_bytes > options_.max_inflight_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request: needs about ", work->memory_bytes >> 20,
        " MiB, more than this server's whole in-flight memory budget of ",
        options_.max_inflight_bytes >> 20,
        " MiB (--max_inflight_bytes); send fewer or shorter sequences, ask for fewer maps "
        "(attention_maps.heads), a subset of rows (attention_maps.query_rows) or head_statistics "
        "instead of maps"));
  }
  std::vector<std::pair<std::unique_ptr<ScheduledWork>, absl::Status>> skipped;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (static_cast<int64_t>(queue_.size()) >= options_.queue_capacity) SweepLocked(now, skipped);
    if (static_cast<int64_t>(queue_.size()) >= options_.queue_capacity) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "compute queue is full (", options_.queue_capacity, " requests waiting); retry later"));
    } else if (reserved_bytes_ + work->memory_bytes > options_.max_inflight_bytes) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "the server's in-flight memory budget is taken (", reserved_bytes_ >> 20, " of ",
          options_.max_inflight_bytes >> 20, " MiB reserved; this request needs about ",
          work->memory_bytes >> 20, " MiB); retry later, or send a smaller request"));
    } else {
      if (!draining_) {
        status = executor_->Submit([this] { Drain(); });
        if (status.ok()) draining_ = true;
      }
      if (status.ok()) {
        work->enqueued = now;
        reserved_bytes_ += work->memory_bytes;
        queue_.push_back(std::move(work));
      }
    }
  }
  SkipAll(skipped);
  return status;
}

int64_t Scheduler::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void Scheduler::StopWaiting() {
  absl::MutexLock lock(&mu_);
  stop_waiting_ = true;
}

int64_t Scheduler::reserved_bytes() const {
  absl::MutexLock lock(&mu_);
  return reserved_bytes_;
}

void Scheduler::SweepLocked(
    absl::Time now, std::vector<std::pair<std::unique_ptr<ScheduledWork>, absl::Status>>& skipped) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    ScheduledWork& work = **it;
    if (now >= work.deadline) {
      skipped.emplace_back(std::move(*it),
                           absl::DeadlineExceededError(
                               "the deadline passed while the request was queued; not computed"));
    } else if (work.IsCancelled()) {
      skipped.emplace_back(std::move(*it),
                           absl::CancelledError("the client cancelled the call; not computed"));
    } else {
      ++it;
      continue;
    }
    it = queue_.erase(it);
  }
}

int64_t Scheduler::JoinableTokensLocked() const {
  const ScheduledWork& head = *queue_.front();
  int64_t tokens = 0;
  for (const auto& work : queue_) {
    if (work->batch_key == head.batch_key) tokens += work->tokens;
  }
  return tokens;
}

void Scheduler::Requeue(std::unique_ptr<ScheduledWork> work) {
  absl::MutexLock lock(&mu_);
  requeued_bytes_ += work->memory_bytes - work->memory_kept_after_run;
  queue_.push_back(std::move(work));
}

void Scheduler::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_bytes_ -= bytes;
}

void Scheduler::SkipAll(
    std::vector<std::pair<std::unique_ptr<ScheduledWork>, absl::Status>>& skipped) {
  for (auto& [work, status] : skipped) {
    const int64_t bytes = work->memory_bytes;
    work->Skip(std::move(status));
    work.reset();
    Release(bytes);
  }
  skipped.clear();
}

void Scheduler::Drain() {
  const bool batching = options_.max_batch_tokens > 1;
  std::vector<std::pair<std::unique_ptr<ScheduledWork>, absl::Status>> skipped;
  while (true) {
    std::vector<std::unique_ptr<ScheduledWork>> batch;
    BatchInfo info;
    {
      absl::MutexLock lock(&mu_);
      SweepLocked(absl::Now(), skipped);
      if (queue_.empty()) {
        if (skipped.empty()) {
          draining_ = false;
          return;
        }
      } else {
        const ScheduledWork& head = *queue_.front();
        const bool batchable = batching && head.batch_key != 0 &&
                               head.tokens < options_.max_batch_tokens;
        if (batchable && !stop_waiting_ && options_.max_queue_delay > absl::ZeroDuration() &&
            JoinableTokensLocked() < options_.max_batch_tokens) {
          // Wait for more of its kind, up to the delay; then start over (the
          // queue may have changed meanwhile).
          // (Not past the head's deadline: it is skipped then, not later.)
          const absl::Time until =
              std::min(head.enqueued + options_.max_queue_delay, head.deadline);
          if (absl::Now() < until) {
            // Also ends when the head left (swept by a Submit): the batch
            // then starts with what is queued.
            const ScheduledWork* const waiting = &head;
            auto full = [this, waiting]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
              return stop_waiting_ || queue_.empty() || queue_.front().get() != waiting ||
                     JoinableTokensLocked() >= options_.max_batch_tokens;
            };
            mu_.AwaitWithDeadline(absl::Condition(&full), until);
            SweepLocked(absl::Now(), skipped);
          }
        }
        if (!queue_.empty()) {
          const uint64_t key = queue_.front()->batch_key;
          const bool can_join = batching && key != 0;
          for (auto it = queue_.begin(); it != queue_.end();) {
            ScheduledWork& work = **it;
            const bool first = batch.empty();
            if (first || (can_join && work.batch_key == key &&
                          info.tokens + work.tokens <= options_.max_batch_tokens)) {
              info.tokens += work.tokens;
              ++info.requests;
              batch.push_back(std::move(*it));
              it = queue_.erase(it);
              if (!can_join) break;
            } else {
              ++it;
            }
          }
        }
      }
    }
    SkipAll(skipped);
    if (batch.empty()) continue;
    int64_t bytes = 0;  // what the batch releases once run (not what it keeps)
    for (const auto& work : batch) bytes += work->memory_bytes - work->memory_kept_after_run;
    run_batch_(std::move(batch), info);
    // What Requeue put back stays reserved (a sweep that skips it meanwhile
    // releases all of it, as for any queued request).
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= bytes - requeued_bytes_;
    requeued_bytes_ = 0;
  }
}

}  // namespace attnserve::server
