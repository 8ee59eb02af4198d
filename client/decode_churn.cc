#include "client/decode_churn.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "attnserve/v1/attention.pb.h"
#include "client/request_builder.h"

namespace attnserve::client {
namespace {

using Clock = std::chrono::steady_clock;

// A session as the client counts it.
struct Tracked {
  std::string id;
  int64_t length = 0;  // tokens the client has appended (and kept)
  int64_t max_tokens = 0;
  bool short_ttl = false;
  Clock::time_point parked_until{};  // a parked session is left alone until then
  bool parked = false;
};

class Churn {
 public:
  Churn(const AttentionClient& client, const DecodeChurnOptions& options, int64_t d_model)
      : client_(client), options_(options), d_model_(d_model), rng_(options.seed) {
    result_.options = options;
  }

  DecodeChurnResult Run(
      const std::function<void(const DecodeChurnResult& so_far, int64_t live)>& progress) {
    const auto start = Clock::now();
    const auto end = start + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(options_.duration_seconds));
    auto next_progress = start + std::chrono::seconds(1);
    while (Clock::now() < end) {
      Operate();
      const auto now = Clock::now();
      result_.seconds = std::chrono::duration<double>(now - start).count();
      if (now >= next_progress) {
        if (progress) progress(result_, static_cast<int64_t>(live_.size()));
        next_progress = now + std::chrono::seconds(1);
      }
    }
    for (const Tracked& session : live_) {
      const absl::Status closed = client_.CloseSession(session.id);
      if (!closed.ok()) Refused("close", closed, session);
    }
    result_.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return result_;
  }

 private:
  int64_t Uniform(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }

  void Fail(std::string what) {
    ++result_.failures;
    if (result_.first_failures.size() < 10) result_.first_failures.push_back(std::move(what));
  }

  // A refusal of an operation on `session`: counted when documented for a
  // churning client, else a failure. Returns true when the server ended the
  // session (the caller drops it).
  bool Refused(absl::string_view op, const absl::Status& status, const Tracked& session) {
    const std::string code = absl::StatusCodeToString(status.code());
    const absl::string_view message = status.message();
    if (status.code() == absl::StatusCode::kNotFound &&
        (absl::StrContains(message, "expired") || absl::StrContains(message, "evicted"))) {
      // The server ended it on its own. (A session this client still counts
      // as open said to be "closed" or "unknown" was lost: a failure below.)
      ++result_.refusals[code];
      ++result_.ended[absl::StrContains(message, "expired")          ? "expired"
                      : absl::StrContains(message, "--max_sessions") ? "evicted for sessions"
                                                                     : "evicted for memory"];
      return true;
    }
    if (status.code() == absl::StatusCode::kResourceExhausted) {
      ++result_.refusals[code];
      return false;
    }
    Fail(absl::StrCat(op, " of session ", session.id, " at ", session.length, " tokens: ", code,
                      ": ", status.message()));
    return status.code() == absl::StatusCode::kNotFound;
  }

  void Drop(size_t index) {
    live_[index] = std::move(live_.back());
    live_.pop_back();
  }

  // The index of a random live session not parked; -1 if none.
  int64_t PickActive() {
    std::vector<int64_t> active;
    for (size_t i = 0; i < live_.size(); ++i) {
      if (!live_[i].parked) active.push_back(static_cast<int64_t>(i));
    }
    if (active.empty()) return -1;
    return active[static_cast<size_t>(Uniform(0, static_cast<int64_t>(active.size()) - 1))];
  }

  void Operate() {
    CheckParked();
    const int64_t live = static_cast<int64_t>(live_.size());
    const int64_t roll = Uniform(0, 99);
    if (live < 2 || (roll < 12 && live < options_.sessions)) return Open();
    if (roll < 62) return Extend();
    if (roll < 70) return Fork();
    if (roll < 78) return Truncate();
    if (roll < 86) return Get();
    if (roll < 94) return Close();
    return Park();
  }

  void Open() {
    ++result_.operations["open"];
    v1::OpenSessionRequest request;
    request.add_models(options_.model);
    request.set_kv_dtype(Uniform(0, 1) ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_FP32);
    request.set_max_tokens(Uniform(std::min<int64_t>(64, options_.context), options_.context));
    const bool short_ttl = Uniform(0, 3) == 0;
    if (short_ttl) {
      const double ttl = options_.short_ttl_seconds;
      request.mutable_idle_ttl()->set_seconds(static_cast<int64_t>(ttl));
      request.mutable_idle_ttl()->set_nanos(
          static_cast<int32_t>((ttl - std::floor(ttl)) * 1e9));
    }
    absl::StatusOr<v1::Session> session = client_.OpenSession(request);
    if (!session.ok()) {
      Refused("open", session.status(), Tracked{});
      return;
    }
    Tracked tracked{session->session_id(), 0, request.max_tokens(), short_ttl};
    if (session->layer_lengths_size() != 1 || session->layer_lengths(0) != 0) {
      Fail(absl::StrCat("open: session ", tracked.id, " holds ",
                        session->layer_lengths_size() ? session->layer_lengths(0) : -1,
                        " tokens, not 0"));
    }
    live_.push_back(std::move(tracked));
  }

  void Extend() {
    ++result_.operations["extend"];
    std::vector<int64_t> picked;
    const int64_t want = Uniform(1, 8);
    for (int64_t i = 0; i < want; ++i) {
      const int64_t at = PickActive();
      if (at < 0) break;
      if (std::find(picked.begin(), picked.end(), at) == picked.end()) picked.push_back(at);
    }
    v1::ExtendRequest request;
    std::vector<int64_t> tokens;
    std::vector<int64_t> in_request;
    for (int64_t at : picked) {
      Tracked& session = live_[static_cast<size_t>(at)];
      const int64_t room = session.max_tokens - session.length;
      if (room <= 0) continue;  // full: a truncate or close will come
      const int64_t n = Uniform(0, 4) == 0 ? std::min(room, Uniform(2, 64)) : 1;
      v1::ExtendStep* step = request.add_steps();
      step->set_session_id(session.id);
      step->set_expected_length(session.length);
      *step->mutable_hidden_states() = RandomStateRows(n, d_model_, rng_);
      tokens.push_back(n);
      in_request.push_back(at);
    }
    if (request.steps_size() == 0) return;
    absl::StatusOr<v1::ExtendResponse> response = client_.Extend(request);
    if (!response.ok()) {
      // The call as a whole: only the queue full is expected here.
      Refused("extend (the call)", response.status(), live_[static_cast<size_t>(in_request[0])]);
      return;
    }
    if (response->results_size() != request.steps_size()) {
      Fail(absl::StrCat("extend: ", response->results_size(), " results for ",
                        request.steps_size(), " steps"));
      return;
    }
    std::vector<int64_t> drop;
    for (int i = 0; i < response->results_size(); ++i) {
      const v1::ExtendResult& r = response->results(i);
      const size_t at = static_cast<size_t>(in_request[static_cast<size_t>(i)]);
      Tracked& session = live_[at];
      if (r.code() != 0) {
        if (Refused("extend", absl::Status(static_cast<absl::StatusCode>(r.code()), r.message()),
                    session)) {
          drop.push_back(static_cast<int64_t>(at));
        }
        continue;
      }
      const int64_t n = tokens[static_cast<size_t>(i)];
      if (r.length() != session.length + n || r.replayed() || r.output().shape_size() != 2 ||
          r.output().shape(0) != n || r.output().shape(1) != d_model_) {
        Fail(absl::StrCat("extend: session ", session.id, " at ", session.length, " + ", n,
                          " tokens answered length ", r.length(), r.replayed() ? " (replayed)" : "",
                          ", output shape [", absl::StrJoin(r.output().shape(), ", "), "]"));
      }
      session.length += n;
      result_.tokens_appended += n;
      ++result_.steps;
    }
    std::sort(drop.rbegin(), drop.rend());
    for (int64_t at : drop) Drop(static_cast<size_t>(at));
  }

  // Checks that the server's description of a session matches the count.
  void Expect(absl::string_view op, const v1::Session& session, int64_t length) {
    if (session.layer_lengths_size() != 1 || session.layer_lengths(0) != length) {
      Fail(absl::StrCat(op, ": session ", session.session_id(), " holds ",
                        session.layer_lengths_size() ? session.layer_lengths(0) : -1,
                        " tokens; the client counted ", length));
    }
  }

  void Fork() {
    ++result_.operations["fork"];
    const int64_t at = PickActive();
    if (at < 0 || static_cast<int64_t>(live_.size()) >= options_.sessions) return;
    const Tracked parent = live_[static_cast<size_t>(at)];
    absl::StatusOr<v1::Session> fork = client_.ForkSession(parent.id);
    if (!fork.ok()) {
      if (Refused("fork", fork.status(), parent)) Drop(static_cast<size_t>(at));
      return;
    }
    Expect("fork", *fork, parent.length);
    Tracked child = parent;
    child.id = fork->session_id();
    child.max_tokens = fork->max_tokens();
    live_.push_back(std::move(child));
  }

  void Truncate() {
    ++result_.operations["truncate"];
    const int64_t at = PickActive();
    if (at < 0) return;
    Tracked& session = live_[static_cast<size_t>(at)];
    v1::TruncateSessionRequest request;
    request.set_session_id(session.id);
    request.set_all_layers(true);
    request.set_length(Uniform(0, session.length));
    absl::StatusOr<v1::Session> truncated = client_.TruncateSession(request);
    if (!truncated.ok()) {
      if (Refused("truncate", truncated.status(), session)) Drop(static_cast<size_t>(at));
      return;
    }
    Expect("truncate", *truncated, request.length());
    session.length = request.length();
  }

  void Get() {
    ++result_.operations["get"];
    const int64_t at = PickActive();
    if (at < 0) return;
    const Tracked& session = live_[static_cast<size_t>(at)];
    absl::StatusOr<v1::Session> got = client_.GetSession(session.id);
    if (!got.ok()) {
      if (Refused("get", got.status(), session)) Drop(static_cast<size_t>(at));
      return;
    }
    Expect("get", *got, session.length);
  }

  void Close() {
    ++result_.operations["close"];
    const int64_t at = PickActive();
    if (at < 0) return;
    const absl::Status closed = client_.CloseSession(live_[static_cast<size_t>(at)].id);
    if (!closed.ok()) Refused("close", closed, live_[static_cast<size_t>(at)]);
    Drop(static_cast<size_t>(at));
  }

  // Leaves a short-TTL session alone until twice its TTL has passed.
  void Park() {
    for (Tracked& session : live_) {
      if (session.short_ttl && !session.parked) {
        ++result_.operations["park"];
        session.parked = true;
        session.parked_until =
            Clock::now() + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(2 * options_.short_ttl_seconds));
        return;
      }
    }
  }

  // A parked session past twice its TTL must be gone (expired, or evicted
  // before that): still there is a failure.
  void CheckParked() {
    const auto now = Clock::now();
    for (size_t i = 0; i < live_.size();) {
      Tracked& session = live_[i];
      if (!session.parked || now < session.parked_until) {
        ++i;
        continue;
      }
      ++result_.operations["check_parked"];
      absl::StatusOr<v1::Session> got = client_.GetSession(session.id);
      if (got.ok()) {
        Fail(absl::StrCat("session ", session.id, " idle for twice its TTL of ",
                          options_.short_ttl_seconds, " s is still there"));
      } else if (!Refused("get (parked)", got.status(), session)) {
        ++i;
        continue;
      }
      Drop(i);
    }
  }

  const AttentionClient& client_;
  const DecodeChurnOptions options_;
  const int64_t d_model_;
  std::mt19937_64 rng_;
  std::vector<Tracked> live_;
  DecodeChurnResult result_;
};

std::string JsonCounts(const std::map<std::string, int64_t>& counts) {
  std::vector<std::string> parts;
  for (const auto& [name, count] : counts) parts.push_back(absl::StrFormat("\"%s\": %d", name, count));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::string TextCounts(const std::map<std::string, int64_t>& counts) {
  std::vector<std::string> parts;
  for (const auto& [name, count] : counts) parts.push_back(absl::StrCat(name, " ", count));
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

std::string JsonString(absl::string_view text) {
  return absl::StrCat("\"",
                      absl::StrReplaceAll(text, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}}),
                      "\"");
}

}  // namespace

absl::Status ValidateDecodeChurnOptions(const DecodeChurnOptions& options) {
  if (!(options.duration_seconds > 0)) {
    return absl::InvalidArgumentError("--duration: must be positive");
  }
  if (options.sessions < 2) return absl::InvalidArgumentError("--sessions: at least 2");
  if (options.context < 1) return absl::InvalidArgumentError("--context: must be positive");
  if (!(options.short_ttl_seconds > 0) || options.short_ttl_seconds > 3600) {
    return absl::InvalidArgumentError("--ttl_seconds: in (0, 3600] for --churn");
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeChurnResult> RunDecodeChurn(
    const AttentionClient& client, const DecodeChurnOptions& options,
    const std::function<void(const DecodeChurnResult& so_far, int64_t live)>& progress) {
  if (absl::Status valid = ValidateDecodeChurnOptions(options); !valid.ok()) return valid;
  absl::StatusOr<v1::ModelInfo> model = client.GetModel(options.model);
  if (!model.ok()) return model.status();
  Churn churn(client, options, model->head_config().d_model());
  return churn.Run(progress);
}

std::string FormatDecodeChurnText(const DecodeChurnResult& r) {
  std::string text = absl::StrFormat(
      "churn: %.1f s over model %s, at most %d sessions of at most %d tokens (short TTL %.2f s)\n"
      "operations: %s\n"
      "steps answered: %d (%d tokens appended)\n"
      "refusals: %s\n"
      "sessions the server ended: %s\n"
      "failures (a token lost or duplicated, an undocumented refusal): %d\n",
      r.seconds, r.options.model, r.options.sessions, r.options.context,
      r.options.short_ttl_seconds, TextCounts(r.operations), r.steps, r.tokens_appended,
      TextCounts(r.refusals), TextCounts(r.ended), r.failures);
  for (const std::string& failure : r.first_failures) absl::StrAppend(&text, "  ", failure, "\n");
  return text;
}

std::string FormatDecodeChurnJson(const DecodeChurnResult& r) {
  std::vector<std::string> failures;
  for (const std::string& failure : r.first_failures) failures.push_back(JsonString(failure));
  return absl::StrFormat(
      "{\"mode\": \"decode_churn\", \"model\": %s, \"seconds\": %.3f, \"sessions\": %d, "
      "\"context\": %d, \"short_ttl_seconds\": %.3f, \"operations\": %s, \"steps\": %d, "
      "\"tokens_appended\": %d, \"refusals\": %s, \"ended\": %s, \"failures\": %d, "
      "\"first_failures\": [%s]}",
      JsonString(r.options.model), r.seconds, r.options.sessions, r.options.context,
      r.options.short_ttl_seconds, JsonCounts(r.operations), r.steps, r.tokens_appended,
      JsonCounts(r.refusals), JsonCounts(r.ended), r.failures, absl::StrJoin(failures, ", "));
}

}  // namespace attnserve::client
