#include "client/decode_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "client/attend_report.h"
#include "client/bench.h"
#include "client/extend_stream.h"
#include "client/request_builder.h"

namespace attnserve::client {
namespace {

using Clock = std::chrono::steady_clock;

// One Extend message of `tokens` new tokens for every session at `length`.
// Its random states are made here, apart from the call: a timed step
// measures the call alone, not the client drawing its inputs (drawing 32 x
// 768 normal floats takes about as long as the call's own work around the
// compute).
v1::ExtendRequest MakeExtendRequest(const std::vector<std::string>& sessions, int64_t length,
                                    int64_t tokens, int64_t d_model, std::mt19937_64& rng) {
  v1::ExtendRequest request;
  request.mutable_steps()->Reserve(static_cast<int>(sessions.size()));
  for (const std::string& id : sessions) {
    v1::ExtendStep* step = request.add_steps();
    step->set_session_id(id);
    step->set_expected_length(length);
    *step->mutable_hidden_states() = RandomStateRows(tokens, d_model, rng);
  }
  return request;
}

// Sends `request` as an Extend call or on `stream`; the first failed step's
// status as the server said it.
absl::StatusOr<v1::ExtendResponse> SendExtend(const AttentionClient& client, ExtendStream* stream,
                                              const v1::ExtendRequest& request) {
  absl::StatusOr<v1::ExtendResponse> response =
      stream != nullptr ? stream->Extend(request) : client.Extend(request);
  if (!response.ok()) return response.status();
  for (const v1::ExtendResult& result : response->results()) {
    if (result.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(result.code()), result.message());
    }
  }
  return response;
}

absl::StatusOr<v1::ExtendResponse> ExtendAll(const AttentionClient& client, ExtendStream* stream,
                                             const std::vector<std::string>& sessions,
                                             int64_t length, int64_t tokens, int64_t d_model,
                                             std::mt19937_64& rng) {
  return SendExtend(client, stream, MakeExtendRequest(sessions, length, tokens, d_model, rng));
}

}  // namespace

absl::Status ValidateDecodeBenchOptions(const DecodeBenchOptions& options) {
  const auto positive = [](int64_t value, absl::string_view flag) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(absl::StrCat(flag, ": must be positive"));
  };
  for (const absl::Status& status :
       {positive(options.sessions, "--sessions"), positive(options.context, "--context"),
        positive(options.steps, "--steps"), positive(options.prefill_chunk, "--prefill_chunk")}) {
    if (!status.ok()) return status;
  }
  if (options.prefill_during < 0) {
    return absl::InvalidArgumentError("--prefill_during: must be >= 0 (0: no prefill)");
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeBenchResult> RunDecodeBench(
    const AttentionClient& client, const DecodeBenchOptions& options,
    const std::function<void(int64_t done, int64_t total)>& progress) {
  if (absl::Status valid = ValidateDecodeBenchOptions(options); !valid.ok()) return valid;
  absl::StatusOr<v1::ModelInfo> model = client.GetModel(options.model);
  if (!model.ok()) return model.status();
  DecodeBenchResult result;
  result.options = options;
  result.d_model = model->head_config().d_model();
  std::mt19937_64 rng(options.seed);
  std::vector<std::string> sessions;
  v1::OpenSessionRequest open;
  open.add_models(options.model);
  open.set_kv_dtype(options.kv_dtype);
  const int64_t rounds = options.prefill_during > 0 ? 2 * options.steps : options.steps;
  open.set_max_tokens(options.context + rounds);
  absl::Status status;
  for (int64_t i = 0; i < options.sessions && status.ok(); ++i) {
    absl::StatusOr<v1::Session> session = client.OpenSession(open);
    status = session.status();
    if (session.ok()) sessions.push_back(session->session_id());
  }
  const int64_t chunks = (options.context + options.prefill_chunk - 1) / options.prefill_chunk;
  const int64_t total = chunks + rounds;
  std::unique_ptr<ExtendStream> stream =
      options.stream ? client.OpenExtendStream(options.timeout_seconds * static_cast<double>(total))
                     : nullptr;
  int64_t done = 0, length = 0;
  const auto prefill_start = Clock::now();
  while (status.ok() && length < options.context) {
    const int64_t n = std::min(options.prefill_chunk, options.context - length);
    status = ExtendAll(client, stream.get(), sessions, length, n, result.d_model, rng).status();
    length += n;
    if (progress) progress(++done, total);
  }
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - prefill_start).count();
  std::vector<double> step_ms, overhead_ms, queue_ms;
  double compute_ms = 0;
  for (int64_t s = 0; s < options.steps && status.ok(); ++s) {
    const v1::ExtendRequest request = MakeExtendRequest(sessions, length, 1, result.d_model, rng);
    const auto start = Clock::now();
    absl::StatusOr<v1::ExtendResponse> response = SendExtend(client, stream.get(), request);
    status = response.status();
    if (!response.ok()) break;
    step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    compute_ms += DurationMillis(response->timing().compute());
    overhead_ms.push_back(step_ms.back() - DurationMillis(response->timing().compute()));
    queue_ms.push_back(DurationMillis(response->timing().queue()));
    result.kernel_path = response->kernel_path();
    ++length;
    if (progress) progress(++done, total);
  }
  for (double ms : step_ms) result.decode_seconds += ms / 1000;
  // Mixed traffic: the same rounds again, a long prefill arriving among them.
  std::vector<double> with_ms, during_ms;
  std::thread prefill;
  absl::Status prefill_status;
  Clock::time_point long_start, long_end;
  std::atomic<bool> prefill_done{false};
  for (int64_t s = 0; options.prefill_during > 0 && s < options.steps && status.ok(); ++s) {
    if (s == options.steps / 4) {
      prefill = std::thread([&] {
        v1::OpenSessionRequest one = open;
        one.set_max_tokens(options.prefill_during);
        absl::StatusOr<v1::Session> session = client.OpenSession(one);
        long_start = Clock::now();
        prefill_status = session.status();
        if (session.ok()) {
          std::mt19937_64 prefill_rng(options.seed + 1);
          prefill_status = ExtendAll(client, nullptr, {session->session_id()}, 0,
                                     options.prefill_during, result.d_model, prefill_rng)
                               .status();
          long_end = Clock::now();
          (void)client.CloseSession(session->session_id());
        }
        prefill_done = true;
      });
    }
    const v1::ExtendRequest request = MakeExtendRequest(sessions, length, 1, result.d_model, rng);
    const bool before_end = !prefill_done.load();
    const auto start = Clock::now();
    absl::StatusOr<v1::ExtendResponse> response = SendExtend(client, stream.get(), request);
    status = response.status();
    if (!response.ok()) break;
    const auto end = Clock::now();
    with_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    // Overlapped the prefill call: started before it ended, ended after it began.
    if (prefill.joinable() && before_end) during_ms.push_back(with_ms.back());
    ++length;
    if (progress) progress(++done, total);
  }
  if (prefill.joinable()) {
    prefill.join();
    if (status.ok()) status = prefill_status;
    result.prefill_call_ms =
        std::chrono::duration<double, std::milli>(long_end - long_start).count();
  }
  if (stream != nullptr) {
    const absl::Status closed = stream->Close();
    if (status.ok()) status = closed;
  }
  for (const std::string& id : sessions) (void)client.CloseSession(id);
  if (!status.ok()) return status;
  result.tokens_per_second =
      static_cast<double>(options.sessions * options.steps) / result.decode_seconds;
  std::sort(step_ms.begin(), step_ms.end());
  result.p50_ms = Percentile(step_ms, 50);
  result.p90_ms = Percentile(step_ms, 90);
  result.p99_ms = Percentile(step_ms, 99);
  result.max_ms = Percentile(step_ms, 100);
  result.server_compute_ms = compute_ms / static_cast<double>(options.steps);
  std::sort(overhead_ms.begin(), overhead_ms.end());
  result.overhead_p50_ms = Percentile(overhead_ms, 50);
  double overhead_sum = 0;
  for (double ms : overhead_ms) overhead_sum += ms;
  result.overhead_mean_ms = overhead_sum / static_cast<double>(overhead_ms.size());
  std::sort(queue_ms.begin(), queue_ms.end());
  result.server_queue_p50_ms = Percentile(queue_ms, 50);
  if (!with_ms.empty()) {
    std::sort(with_ms.begin(), with_ms.end());
    std::sort(during_ms.begin(), during_ms.end());
    result.with_p50_ms = Percentile(with_ms, 50);
    result.with_p99_ms = Percentile(with_ms, 99);
    result.with_max_ms = Percentile(with_ms, 100);
    result.during_rounds = static_cast<int64_t>(during_ms.size());
    if (!during_ms.empty()) {
      result.during_p50_ms = Percentile(during_ms, 50);
      result.during_p99_ms = Percentile(during_ms, 99);
    }
    result.p99_ratio = result.p99_ms > 0 ? result.with_p99_ms / result.p99_ms : 0;
  }
  return result;
}

namespace {

// The decode rounds' lines and object (FormatDecodeBench* add the mixed
// traffic's).
std::string DecodeText(const DecodeBenchResult& r) {
  return absl::StrFormat(
      "decode: %d sessions of model %s, context %d, %d steps (one token per session per step, "
      "%s)\n"
      "prefill: %.2f s\n"
      "decode: %.1f tokens/s; step p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, max %.3f ms\n"
      "server: compute %.3f ms a step (%s); a step less its compute: p50 %.3f ms, mean %.3f ms "
      "(of it, from the call's arrival to its compute: p50 %.3f ms)\n",
      r.options.sessions, r.options.model, r.options.context, r.options.steps,
      r.options.stream ? "one message per step on one ExtendStream" : "one Extend call per step",
      r.prefill_seconds, r.tokens_per_second, r.p50_ms, r.p90_ms, r.p99_ms, r.max_ms,
      r.server_compute_ms, r.kernel_path, r.overhead_p50_ms, r.overhead_mean_ms,
      r.server_queue_p50_ms);
}

std::string DecodeJson(const DecodeBenchResult& r) {
  return absl::StrFormat(
      "{\"mode\": \"decode\", \"form\": \"%s\", \"model\": \"%s\", \"sessions\": %d, "
      "\"context\": %d, \"steps\": %d, "
      "\"prefill_seconds\": %.6f, \"tokens_per_second\": %.3f, \"step_ms\": {\"p50\": %.3f, "
      "\"p90\": %.3f, \"p99\": %.3f, \"max\": %.3f}, \"server_compute_ms\": %.3f, "
      "\"overhead_ms\": {\"p50\": %.3f, \"mean\": %.3f}, \"server_queue_ms\": {\"p50\": %.3f}, "
      "\"kernel_path\": \"%s\"}",
      r.options.stream ? "stream" : "unary",
      absl::StrReplaceAll(r.options.model, {{"\\", "\\\\"}, {"\"", "\\\""}}),
      r.options.sessions, r.options.context, r.options.steps, r.prefill_seconds,
      r.tokens_per_second, r.p50_ms, r.p90_ms, r.p99_ms, r.max_ms, r.server_compute_ms,
      r.overhead_p50_ms, r.overhead_mean_ms, r.server_queue_p50_ms, r.kernel_path);
}

}  // namespace

std::string FormatDecodeBenchText(const DecodeBenchResult& r) {
  std::string mixed;
  if (r.options.prefill_during > 0) {
    mixed = absl::StrFormat(
        "with a %d-token prefill arriving (one Extend call, %.1f ms): step p50 %.3f ms, "
        "p99 %.3f ms, max %.3f ms; the %d steps during it: p50 %.3f ms, p99 %.3f ms\n"
        "p99 with / without: %.2f\n",
        r.options.prefill_during, r.prefill_call_ms, r.with_p50_ms, r.with_p99_ms, r.with_max_ms,
        r.during_rounds, r.during_p50_ms, r.during_p99_ms, r.p99_ratio);
  }
  return mixed.empty() ? DecodeText(r) : absl::StrCat(DecodeText(r), mixed);
}

std::string FormatDecodeBenchJson(const DecodeBenchResult& r) {
  std::string json = DecodeJson(r);
  if (r.options.prefill_during > 0) {
    json.pop_back();  // the closing brace
    absl::StrAppendFormat(
        &json,
        ", \"prefill_during\": {\"tokens\": %d, \"call_ms\": %.3f, \"step_ms\": {\"p50\": %.3f, "
        "\"p99\": %.3f, \"max\": %.3f}, \"steps_during\": %d, \"during_ms\": {\"p50\": %.3f, "
        "\"p99\": %.3f}, \"p99_ratio\": %.3f}}",
        r.options.prefill_during, r.prefill_call_ms, r.with_p50_ms, r.with_p99_ms, r.with_max_ms,
        r.during_rounds, r.during_p50_ms, r.during_p99_ms, r.p99_ratio);
  }
  return json;
}

}  // namespace attnserve::client
