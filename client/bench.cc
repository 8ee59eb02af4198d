#include "client/bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/attend_report.h"
#include "client/wire_request.h"

namespace attnserve::client {
namespace {

using Clock = std::chrono::steady_clock;

// Everything the calls' callbacks record, and the loop state they drive.
class Recorder {
 public:
  Recorder(const AttentionClient& client, const v1::AttendRequest& request,
           const BenchOptions& options)
      : client_(client), request_(v1::AttendRequest(request)), options_(options), start_(Clock::now()) {
    if (options.requests == 0) {
      end_ = start_ + std::chrono::microseconds(static_cast<int64_t>(options.duration_seconds * 1e6));
    }
  }

  Clock::time_point start() const { return start_; }

  // Whether another call may start (by count or by time). Reserves it.
  bool Reserve(Clock::time_point now) {
    absl::MutexLock lock(&mu_);
    if (options_.requests > 0 ? sent_ >= options_.requests : now >= end_) {
      stopped_ = true;
      return false;
    }
    ++sent_;
    ++outstanding_;
    return true;
  }

  // Starts one call, measured from `scheduled`. In closed loop its
  // completion starts the next one.
  void Start(Clock::time_point scheduled, bool closed_loop) {
    struct Call {
      grpc::ClientContext context;
      v1::AttendResponse response;
      Clock::time_point scheduled;
    };
    auto call = std::make_shared<Call>();
    call->scheduled = scheduled;
    client_.AttendAsync(&call->context, &request_, &call->response,
                        [this, call, closed_loop](grpc::Status status) {
                          const Clock::time_point now = Clock::now();
                          Record(status, call->response, now - call->scheduled);
                          if (closed_loop && Reserve(now)) Start(Clock::now(), true);
                          Done();
                        });
  }

  // Counts a reserved start the open loop could not send.
  void Backlogged() {
    absl::MutexLock lock(&mu_);
    --outstanding_;
    ++finished_;
    ++errors_["CLIENT_BACKLOG"];
  }

  int64_t outstanding() const {
    absl::MutexLock lock(&mu_);
    return outstanding_;
  }
  int64_t finished() const {
    absl::MutexLock lock(&mu_);
    return finished_;
  }
  bool stopped() const {
    absl::MutexLock lock(&mu_);
    return stopped_;
  }

  // Waits until no call is outstanding.
  void WaitIdle() {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return outstanding_ == 0; };
    mu_.Await(absl::Condition(&idle));
  }

  BenchResult Result(double elapsed_seconds) {
    absl::MutexLock lock(&mu_);
    BenchResult r;
    r.elapsed_seconds = elapsed_seconds;
    r.sent = sent_;
    r.ok = static_cast<int64_t>(latencies_ms_.size());
    r.errors = errors_;
    r.throughput_rps = elapsed_seconds > 0 ? r.ok / elapsed_seconds : 0;
    std::sort(latencies_ms_.begin(), latencies_ms_.end());
    if (!latencies_ms_.empty()) {
      r.p50_ms = Percentile(latencies_ms_, 50);
      r.p90_ms = Percentile(latencies_ms_, 90);
      r.p99_ms = Percentile(latencies_ms_, 99);
      r.max_ms = latencies_ms_.back();
      double sum = 0;
      for (double l : latencies_ms_) sum += l;
      r.mean_ms = sum / r.ok;
      r.server_queue_ms = queue_ms_ / r.ok;
      r.server_compute_ms = compute_ms_ / r.ok;
      r.batch_size = batch_size_ / r.ok;
      r.batch_tokens = batch_tokens_ / r.ok;
    }
    return r;
  }

 private:
  void Record(const grpc::Status& status, const v1::AttendResponse& response,
              Clock::duration latency) {
    absl::MutexLock lock(&mu_);
    ++finished_;
    if (!status.ok()) {
      ++errors_[absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()))];
      return;
    }
    latencies_ms_.push_back(std::chrono::duration<double, std::milli>(latency).count());
    queue_ms_ += DurationMillis(response.timing().queue());
    compute_ms_ += DurationMillis(response.timing().compute());
    batch_size_ += response.timing().batch_size();
    batch_tokens_ += static_cast<double>(response.timing().batch_tokens());
  }
  void Done() {
    absl::MutexLock lock(&mu_);
    --outstanding_;
  }

  const AttentionClient& client_;
  // Prepared once (one copy of the request): every call sends its bytes
  // without copying them again, as a client sending the same tensors would.
  const WireRequest request_;
  const BenchOptions options_;
  const Clock::time_point start_;
  Clock::time_point end_;

  mutable absl::Mutex mu_;
  int64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<double> latencies_ms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> errors_ ABSL_GUARDED_BY(mu_);
  double queue_ms_ ABSL_GUARDED_BY(mu_) = 0;
  double compute_ms_ ABSL_GUARDED_BY(mu_) = 0;
  double batch_size_ ABSL_GUARDED_BY(mu_) = 0;
  double batch_tokens_ ABSL_GUARDED_BY(mu_) = 0;
};

int64_t QueryTokens(const v1::AttendRequest& request) {
  if (!request.sequence_lengths().empty()) {
    int64_t tokens = 0;
    for (int64_t length : request.sequence_lengths()) tokens += length;
    return tokens;
  }
  const auto& shape = request.hidden_states().shape();
  if (shape.size() == 3) return shape[0] * shape[1];
  if (shape.size() == 2) return shape[0];
  const auto& q = request.projected().q().shape();  // [batch, heads, seq, head_dim]
  return q.size() == 4 ? q[0] * q[2] : 0;
}

}  // namespace

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

std::string ProgressBar(double fraction) {
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * std::clamp(fraction, 0.0, 1.0));
  std::string bar;
  bar.reserve(kWidth + 2);
  bar.push_back('[');
  bar.append(filled, '=');
  bar.append(kWidth - filled, ' ');
  bar.push_back(']');
  return bar;
}

absl::Status ValidateBenchOptions(const BenchOptions& options) {
  if ((options.concurrency > 0) == (options.rate > 0)) {
    return absl::InvalidArgumentError("--concurrency or --rate: give exactly one, positive");
  }
  if (options.concurrency > 100000) {
    return absl::InvalidArgumentError("--concurrency: at most 100000");
  }
  if (options.requests < 0) return absl::InvalidArgumentError("--requests: must be >= 0");
  if (options.requests == 0 && !(options.duration_seconds > 0 && options.duration_seconds < 1e6)) {
    return absl::InvalidArgumentError("--duration: must be positive (or give --requests)");
  }
  if (options.max_outstanding <= 0) {
    return absl::InvalidArgumentError("max_outstanding: must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<BenchResult> RunBench(const AttentionClient& client, const v1::AttendRequest& request,
                                     const BenchOptions& options, BenchProgress progress) {
  if (absl::Status status = ValidateBenchOptions(options); !status.ok()) return status;
  Recorder recorder(client, request, options);
  std::atomic<bool> running{true};
  std::thread reporter;
  if (progress) {
    reporter = std::thread([&] {
      while (running.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        progress(recorder.finished(),
                 std::chrono::duration<double>(Clock::now() - recorder.start()).count());
      }
    });
  }
  if (options.concurrency > 0) {
    for (int64_t i = 0; i < options.concurrency; ++i) {
      if (!recorder.Reserve(Clock::now())) break;
      recorder.Start(Clock::now(), /*closed_loop=*/true);
    }
    // Each completion starts the next call (see Start); a first call that
    // could not start its successor ends the chain.
  } else {
    const auto interval = std::chrono::duration<double>(1.0 / options.rate);
    for (int64_t i = 0;; ++i) {
      const Clock::time_point scheduled =
          recorder.start() + std::chrono::duration_cast<Clock::duration>(interval * i);
      std::this_thread::sleep_until(scheduled);
      if (!recorder.Reserve(scheduled)) break;
      if (recorder.outstanding() > options.max_outstanding) {
        recorder.Backlogged();
        continue;
      }
      recorder.Start(scheduled, false);
    }
  }
  recorder.WaitIdle();
  const double elapsed = std::chrono::duration<double>(Clock::now() - recorder.start()).count();
  running = false;
  if (reporter.joinable()) reporter.join();
  if (progress) progress(recorder.finished(), elapsed);
  BenchResult result = recorder.Result(elapsed);
  result.mode = options.concurrency > 0 ? "closed" : "open";
  result.concurrency = options.concurrency;
  result.rate = options.rate;
  result.tokens_per_request = QueryTokens(request);
  result.tokens_per_second = result.throughput_rps * static_cast<double>(result.tokens_per_request);
  return result;
}

std::string FormatBenchText(const BenchResult& r) {
  std::string text = absl::StrFormat(
      "bench: %s loop, %s, %.1f s, %lld query tokens per request\n", r.mode,
      r.mode == "closed" ? absl::StrCat("concurrency ", r.concurrency)
                         : absl::StrFormat("rate %.1f/s", r.rate),
      r.elapsed_seconds, static_cast<long long>(r.tokens_per_request));
  int64_t errors = 0;
  for (const auto& [code, count] : r.errors) errors += count;
  absl::StrAppendFormat(&text, "requests: %lld sent, %lld OK, %lld errors\n",
                        static_cast<long long>(r.sent), static_cast<long long>(r.ok),
                        static_cast<long long>(errors));
  absl::StrAppendFormat(&text, "throughput: %.1f requests/s, %.0f tokens/s\n", r.throughput_rps,
                        r.tokens_per_second);
  absl::StrAppendFormat(&text,
                        "latency (OK calls): p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, max %.3f ms, "
                        "mean %.3f ms\n",
                        r.p50_ms, r.p90_ms, r.p99_ms, r.max_ms, r.mean_ms);
  absl::StrAppendFormat(&text,
                        "server (means): queue %.3f ms, compute %.3f ms, batch of %.2f requests / "
                        "%.0f tokens\n",
                        r.server_queue_ms, r.server_compute_ms, r.batch_size, r.batch_tokens);
  for (const auto& [code, count] : r.errors) {
    absl::StrAppendFormat(&text, "errors: %s %lld\n", code, static_cast<long long>(count));
  }
  return text;
}

std::string FormatBenchJson(const BenchResult& r) {
  std::string errors;
  for (const auto& [code, count] : r.errors) {
    absl::StrAppendFormat(&errors, "%s\"%s\":%lld", errors.empty() ? "" : ",", code,
                          static_cast<long long>(count));
  }
  return absl::StrFormat(
      "{\"mode\":\"%s\",\"concurrency\":%lld,\"rate\":%.3f,\"elapsed_seconds\":%.3f,"
      "\"sent\":%lld,\"ok\":%lld,\"errors\":{%s},\"tokens_per_request\":%lld,"
      "\"throughput_rps\":%.3f,\"tokens_per_second\":%.1f,"
      "\"latency_ms\":{\"p50\":%.4f,\"p90\":%.4f,\"p99\":%.4f,\"max\":%.4f,\"mean\":%.4f},"
      "\"server\":{\"queue_ms\":%.4f,\"compute_ms\":%.4f,\"batch_size\":%.3f,"
      "\"batch_tokens\":%.1f}}",
      r.mode, static_cast<long long>(r.concurrency), r.rate, r.elapsed_seconds,
      static_cast<long long>(r.sent), static_cast<long long>(r.ok), errors,
      static_cast<long long>(r.tokens_per_request), r.throughput_rps, r.tokens_per_second, r.p50_ms,
      r.p90_ms, r.p99_ms, r.max_ms, r.mean_ms, r.server_queue_ms, r.server_compute_ms,
      r.batch_size, r.batch_tokens);
}

}  // namespace attnserve::client
