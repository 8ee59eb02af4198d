#ifndef ATTNSERVE_SERVER_SCHEDULING_SCHEDULER_H_
#define ATTNSERVE_SERVER_SCHEDULING_SCHEDULER_H_

// The admission and batching stage in front of the compute executor. It knows
// nothing of gRPC or protobuf: it works on ScheduledWork objects (the service
// subclasses them) and std::function callbacks, so it can be tested, and run
// under ThreadSanitizer, on its own.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/scheduling/compute_executor.h"

namespace attnserve::server {

struct SchedulerOptions {
  // Requests admitted and not yet started; a Submit beyond this is refused
  // (RESOURCE_EXHAUSTED) once cancelled and expired ones are swept out.
  int64_t queue_capacity = 64;
  // Most query tokens one batch may hold; a request over it runs alone.
  // 0 or 1: no batching (every request runs alone).
  int64_t max_batch_tokens = 4096;
  // How long the oldest request of a batchable kind may wait for others to
  // join it before its batch starts anyway. 0: a batch is whatever is already
  // queued when the executor is free (no waiting).
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // Bytes that admitted requests (queued or running) may reserve together
  // (ScheduledWork::memory_bytes); a Submit that does not fit beside them is
  // refused (RESOURCE_EXHAUSTED), one larger than all of it too
  // (INVALID_ARGUMENT: it never fits).
  int64_t max_inflight_bytes = int64_t{6} << 30;
};

// One request as the scheduler sees it. Subclasses carry the payload; the
// scheduler owns a work item from Submit until it hands it to the batch
// runner or to Skip.
class ScheduledWork {
 public:
  virtual ~ScheduledWork() = default;

  // Set before Submit, constant afterwards.
  // Requests with the same nonzero key can run as one batch; 0: always alone.
  uint64_t batch_key = 0;
  // Query tokens it computes (the batch token budget counts these).
  int64_t tokens = 0;
  // Its estimated memory, reserved from the in-flight budget at admission
  // and released when it has run or been skipped.
  int64_t memory_bytes = 0;
  // The part of memory_bytes it still holds once it has run (e.g. a response
  // still being sent): not released then, but by its owner, with
  // Scheduler::ReleaseKept, when it lets go of it. All of it is released when
  // it is skipped. In [0, memory_bytes].
  int64_t memory_kept_after_run = 0;
  // Not started after this: skipped with DEADLINE_EXCEEDED.
  absl::Time deadline = absl::InfiniteFuture();

  // Set by Submit.
  absl::Time enqueued;

  // True when the caller has gone. Polled (under the scheduler's lock, so it
  // must be cheap and must not call back into the scheduler) while queued.
  virtual bool IsCancelled() const { return false; }
  // Called exactly once, instead of running it, with DEADLINE_EXCEEDED (the
  // deadline passed while queued) or CANCELLED (the caller went away). Runs
  // on the compute executor, or on the thread of a Submit that swept the
  // queue; never under the scheduler's lock.
  virtual void Skip(absl::Status status) = 0;
};

// What one batch is.
struct BatchInfo {
  int64_t requests = 0;
  int64_t tokens = 0;  // sum of the requests' tokens
};

// A bounded queue of requests in front of the compute executor that forms
// batches: the oldest request starts a batch, and queued requests with its
// batch key join it (oldest first) while the batch's tokens stay within
// max_batch_tokens. A batch of a batchable kind that is not full waits up to
// max_queue_delay (from its oldest request's arrival) for more. Requests whose
// deadline passed or whose caller cancelled are skipped, never run: when they
// reach the head of the queue, and when a Submit finds the queue full (so a
// cancelled call frees its slot for the next one).
//
// Batches run on the compute executor, one at a time, through `run_batch`,
// which must finish every request it is given (the scheduler forgets them),
// or put it back for another round with Requeue.
//
// Thread-safe. The executor must outlive the scheduler, and the scheduler
// must outlive the executor's Shutdown (which runs what is queued).
class Scheduler {
 public:
  using RunBatch =
      std::function<void(std::vector<std::unique_ptr<ScheduledWork>> batch, const BatchInfo& info)>;

  // INVALID_ARGUMENT for a non-positive capacity or budget, a negative token
  // budget or delay, or a null executor / run_batch.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(const SchedulerOptions& options,
                                                           ComputeExecutor* executor,
                                                           RunBatch run_batch);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Admits `work` (setting its `enqueued` time). On refusal the work is
  // returned to nobody: it is destroyed without Skip, and the caller answers
  // with the status:
  //   INVALID_ARGUMENT    its memory_bytes is over the whole in-flight budget
  //                       (max_inflight_bytes): it could never be admitted
  //   RESOURCE_EXHAUSTED  the queue is full (after sweeping out cancelled and
  //                       expired requests), or its memory_bytes does not fit
  //                       beside what admitted requests reserve (the message
  //                       says which); either may pass later
  //   UNAVAILABLE         the executor is shutting down
  absl::Status Submit(std::unique_ptr<ScheduledWork> work);

  // Ends waiting for batch-mates, now and from here on: a batch waiting for
  // more requests starts (or, when its requests were cancelled meanwhile, is
  // skipped) at once. The server calls it when it stops its calls in flight
  // at the end of a drain.
  void StopWaiting();

  // Releases bytes a request kept after it ran (memory_kept_after_run).
  void ReleaseKept(int64_t bytes) { Release(bytes); }

  // Puts a request of the batch being run back at the end of the queue, for
  // another round (a prefill computed chunk by chunk: requests queued behind
  // it run in between, or join its next round's batch). Call it only from
  // `run_batch`, with one of the requests it was given, instead of finishing
  // that request; the request may change its `tokens` (what its next round
  // computes) before. It keeps its admission (no queue_capacity check: the
  // queue may hold that many more for a while), its memory reservation and
  // its `enqueued` time (it waits no max_queue_delay again), and is swept
  // (Skip) like any queued request when its deadline passes or its caller
  // cancels. Thread-safe.
  void Requeue(std::unique_ptr<ScheduledWork> work);

  // Requests admitted and not yet started.
  int64_t queue_depth() const;
  // Bytes reserved by requests queued or running.
  int64_t reserved_bytes() const;

 private:
  Scheduler(const SchedulerOptions& options, ComputeExecutor* executor, RunBatch run_batch);

  // Runs on the executor: forms and runs batches until the queue is empty.
  void Drain();
  // Removes cancelled and expired requests from the queue into `skipped`.
  void SweepLocked(absl::Time now,
                   std::vector<std::pair<std::unique_ptr<ScheduledWork>, absl::Status>>& skipped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tokens of queued requests that could join a batch started by the head.
  int64_t JoinableTokensLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(int64_t bytes);
  // Skips every request in `skipped` (outside the lock) and releases them.
  void SkipAll(std::vector<std::pair<std::unique_ptr<ScheduledWork>, absl::Status>>& skipped);

  // Constant after construction.
  const SchedulerOptions options_;
  ComputeExecutor* const executor_;
  const RunBatch run_batch_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<ScheduledWork>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // A Drain task is queued on or running on the executor.
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // StopWaiting() was called.
  bool stop_waiting_ ABSL_GUARDED_BY(mu_) = false;
  // Bytes of the requests Requeue put back during the batch being run: the
  // batch's release after it ran leaves them reserved.
  int64_t requeued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SCHEDULING_SCHEDULER_H_
