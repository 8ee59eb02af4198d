#include "client/session_command.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "cli/npy.h"
#include "client/attend_report.h"
#include "client/request_builder.h"

namespace attnserve::client {

using ::attnserve::cli::NpyArray;
using ::attnserve::cli::ReadNpyFile;
using ::attnserve::cli::WriteNpyFile;

namespace {

absl::Status FlagError(absl::string_view flag, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": ", message));
}

bool Takes(const SessionCommand& c, std::initializer_list<const char*> verbs) {
  return std::any_of(verbs.begin(), verbs.end(), [&](const char* v) { return c.verb == v; });
}

std::string DtypeName(v1::DataType dtype) {
  return dtype == v1::DATA_TYPE_BF16 ? "bf16" : "fp32";
}

// A session as a few lines.
std::string SessionText(const v1::Session& s) {
  std::string text = absl::StrCat(s.session_id(), "\n");
  absl::StrAppend(&text, "  models: ", absl::StrJoin(s.models(), ", "), "\n");
  absl::StrAppend(&text, "  layer lengths: ", absl::StrJoin(s.layer_lengths(), ", "),
                  " (max ", s.max_tokens(), " tokens a layer)\n");
  absl::StrAppendFormat(&text, "  kv: %s, %d blocks, %d bytes\n", DtypeName(s.kv_dtype()),
                        s.kv_blocks(), s.kv_bytes());
  absl::StrAppend(&text, "  idle ttl: ",
                  DurationText(s.idle_ttl()),
                  ", first position ", s.first_position(), "\n");
  return text;
}

absl::StatusOr<std::string> Print(const google::protobuf::Message& message, bool json,
                                  std::string text) {
  if (!json) return text;
  absl::StatusOr<std::string> line = JsonLine(message);
  if (!line.ok()) return line.status();
  return absl::StrCat(*line, "\n");
}

// The step's head statistics, [heads, n] each, as one line per head: the
// entropy (nats) and max weight of each new row (the first kShownRows).
absl::StatusOr<std::string> StepStatisticsText(const v1::ExtendResult& result) {
  constexpr int64_t kShownRows = 8;
  const v1::HeadStatistics& stats = result.head_statistics();
  if (stats.entropy().shape_size() != 2 ||
      stats.max_weight().shape().size() != stats.entropy().shape().size() ||
      stats.max_weight().shape(0) != stats.entropy().shape(0) ||
      stats.max_weight().shape(1) != stats.entropy().shape(1)) {
    return absl::InternalError(
        "the server's head_statistics are not two [heads, n] tensors (not in the answer?)");
  }
  absl::StatusOr<std::vector<float>> entropy = TensorValues(stats.entropy());
  if (!entropy.ok()) return entropy.status();
  absl::StatusOr<std::vector<float>> max_weight = TensorValues(stats.max_weight());
  if (!max_weight.ok()) return max_weight.status();
  const int64_t heads = stats.entropy().shape(0), n = stats.entropy().shape(1);
  if (static_cast<int64_t>(entropy->size()) != heads * n ||
      static_cast<int64_t>(max_weight->size()) != heads * n) {
    return absl::InternalError("the server's head_statistics do not fill their shapes");
  }
  const int64_t shown = std::min(n, kShownRows);
  std::string text = absl::StrCat("head statistics of the new rows (entropy nats / max weight",
                                  n > shown ? absl::StrCat(", first ", shown, " of ", n) : "",
                                  "):\n");
  for (int64_t h = 0; h < heads; ++h) {
    absl::StrAppendFormat(&text, "  head %2d:", h);
    for (int64_t i = 0; i < shown; ++i) {
      absl::StrAppendFormat(&text, " %.4f/%.4f", (*entropy)[h * n + i], (*max_weight)[h * n + i]);
    }
    absl::StrAppend(&text, "\n");
  }
  return text;
}

// The extend step's hidden states [n, d_model] as an FP32 tensor: --input's
// rows, or `tokens` random ones.
absl::StatusOr<v1::Tensor> StepStates(const AttentionClient& client, const SessionCommand& c,
                                      const std::string& model) {
  if (c.input.empty()) {
    absl::StatusOr<v1::ModelInfo> info = client.GetModel(model);
    if (!info.ok()) return info.status();
    std::mt19937_64 rng(c.seed);
    return RandomStateRows(c.tokens, info->head_config().d_model(), rng);
  }
  absl::StatusOr<NpyArray> array = ReadNpyFile(c.input);
  if (!array.ok()) return array.status();
  if (array->shape.size() != 2) {
    return FlagError("--input", absl::StrCat(c.input, ": must be [tokens, d_model], has ",
                                             array->shape.size(), " dimensions"));
  }
  const std::vector<float> values = array->ToFloats();
  v1::Tensor tensor;
  tensor.set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : array->shape) tensor.add_shape(d);
  tensor.set_raw_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

absl::StatusOr<std::string> RunExtend(const AttentionClient& client, const SessionCommand& c) {
  absl::StatusOr<v1::Session> session = client.GetSession(c.session_id);
  if (!session.ok()) return session.status();
  const int layer = c.layer < 0 ? 0 : c.layer;
  if (layer >= session->models_size()) {
    return FlagError("--layer", absl::StrCat(layer, " is not a layer of the session (it has ",
                                             session->models_size(), ")"));
  }
  absl::StatusOr<v1::Tensor> states = StepStates(client, c, session->models(layer));
  if (!states.ok()) return states.status();
  v1::ExtendRequest request;
  request.set_precision(c.precision == "bf16" ? v1::PRECISION_BF16 : v1::PRECISION_FP32);
  v1::ExtendStep* step = request.add_steps();
  step->set_session_id(c.session_id);
  step->set_layer(layer);
  step->set_expected_length(c.expected_length >= 0 ? c.expected_length
                                                   : session->layer_lengths(layer));
  *step->mutable_hidden_states() = *std::move(states);
  for (float gate : c.head_mask) step->add_head_mask(gate);
  step->set_head_statistics(c.stats);
  absl::StatusOr<v1::ExtendResponse> response = client.Extend(request);
  if (!response.ok()) return response.status();
  if (response->results_size() != 1) {
    return absl::InternalError(absl::StrCat("the server answered one step with ",
                                            response->results_size(), " results"));
  }
  const v1::ExtendResult& result = response->results(0);
  if (result.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(result.code()), result.message());
  }
  absl::StatusOr<std::vector<float>> output = TensorValues(result.output());
  if (!output.ok()) return output.status();
  std::vector<int64_t> shape(result.output().shape().begin(), result.output().shape().end());
  std::string files;
  if (!c.save_output.empty()) {
    if (absl::Status saved = WriteNpyFile(c.save_output, shape, *output); !saved.ok()) {
      return saved;
    }
    files = absl::StrCat("output saved to ", c.save_output, "\n");
  }
  std::string text = absl::StrCat(
      c.session_id, " layer ", layer, ": ", shape.empty() ? 0 : shape[0], " tokens ",
      result.replayed() ? "replayed (answered before; nothing appended)" : "appended",
      ", length now ", result.length(), "\n");
  absl::StrAppend(&text, "output [", absl::StrJoin(shape, ", "), "]: ");
  const size_t shown = std::min<size_t>(output->size(), 6);
  for (size_t i = 0; i < shown; ++i) absl::StrAppendFormat(&text, "%s%.6g", i ? " " : "", (*output)[i]);
  absl::StrAppend(&text, output->size() > shown ? " ...\n" : "\n");
  if (c.stats && result.replayed()) {
    // A replay returns the first answer's output alone.
    absl::StrAppend(&text, "no statistics on a replay (they came with the step's first answer)\n");
  } else if (c.stats) {
    absl::StatusOr<std::string> stats = StepStatisticsText(result);
    if (!stats.ok()) return stats.status();
    absl::StrAppend(&text, *stats);
  }
  absl::StrAppend(&text, "server: ", response->kernel_path(), ", compute ",
                  DurationText(response->timing().compute()),
                  "\n", files);
  return Print(*response, c.json, std::move(text));
}

// The latest token's attention: a line per head with its entropy, max weight
// and the kShownKeys keys it weighs most (position: weight).
absl::StatusOr<std::string> RunLatest(const AttentionClient& client, const SessionCommand& c) {
  constexpr int64_t kShownKeys = 3;
  const int layer = c.layer < 0 ? 0 : c.layer;
  absl::StatusOr<v1::LatestAttention> latest = client.GetLatestAttention(c.session_id, layer);
  if (!latest.ok()) return latest.status();
  const v1::Tensor& maps_tensor = latest->maps();
  absl::StatusOr<std::vector<float>> maps = TensorValues(maps_tensor);
  if (!maps.ok()) return maps.status();
  absl::StatusOr<std::vector<float>> entropy = TensorValues(latest->head_statistics().entropy());
  if (!entropy.ok()) return entropy.status();
  absl::StatusOr<std::vector<float>> max_weight =
      TensorValues(latest->head_statistics().max_weight());
  if (!max_weight.ok()) return max_weight.status();
  const int64_t length = latest->length();
  if (maps_tensor.shape_size() != 2 || maps_tensor.shape(0) < 1 ||
      maps_tensor.shape(1) != length || length < 1 ||
      static_cast<int64_t>(maps->size()) != maps_tensor.shape(0) * length ||
      static_cast<int64_t>(entropy->size()) != maps_tensor.shape(0) ||
      max_weight->size() != entropy->size()) {
    return absl::InternalError(
        "the server's latest attention is not [heads, length] maps with a statistic per head");
  }
  if (!std::all_of(maps->begin(), maps->end(), [](float p) { return std::isfinite(p); })) {
    return absl::InternalError("the server's latest attention holds a weight that is not finite");
  }
  const int64_t heads = maps_tensor.shape(0);
  std::string text = absl::StrCat(c.session_id, " layer ", layer, ": the latest token (position ",
                                  latest->position(), ") over ", length, " tokens, ", heads,
                                  " heads (entropy nats, max weight; the keys weighed most, as "
                                  "token index: weight)\n");
  std::vector<int64_t> order(static_cast<size_t>(length));
  for (int64_t h = 0; h < heads; ++h) {
    const float* row = maps->data() + h * length;
    for (int64_t j = 0; j < length; ++j) order[static_cast<size_t>(j)] = j;
    const int64_t shown = std::min(length, kShownKeys);
    std::partial_sort(order.begin(), order.begin() + shown, order.end(), [&](int64_t a, int64_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    absl::StrAppendFormat(&text, "  head %2d: %.4f %.4f;", h, (*entropy)[static_cast<size_t>(h)],
                          (*max_weight)[static_cast<size_t>(h)]);
    for (int64_t i = 0; i < shown; ++i) {
      absl::StrAppendFormat(&text, " %d: %.4f", order[static_cast<size_t>(i)],
                            row[order[static_cast<size_t>(i)]]);
    }
    absl::StrAppend(&text, "\n");
  }
  if (!c.save_maps.empty()) {
    if (absl::Status saved = WriteNpyFile(c.save_maps, {heads, length}, *maps); !saved.ok()) {
      return saved;
    }
    absl::StrAppend(&text, "maps saved to ", c.save_maps, " [", heads, ", ", length, "]\n");
  }
  return Print(*latest, c.json, std::move(text));
}

}  // namespace

absl::Status ValidateSessionCommand(const SessionCommand& c) {
  if (std::none_of(std::begin(kSessionVerbs), std::end(kSessionVerbs),
                   [&](const char* v) { return c.verb == v; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("session: unknown verb '", c.verb, "' (",
                     absl::StrJoin(kSessionVerbs, ", "), ")"));
  }
  if (c.verb == "open") {
    if (c.models.empty() ||
        std::any_of(c.models.begin(), c.models.end(), [](const std::string& m) { return m.empty(); })) {
      return FlagError("--model", "session open needs the layers' models (comma-separated)");
    }
    if (c.kv_dtype != "fp32" && c.kv_dtype != "bf16") return FlagError("--kv_dtype", "fp32 or bf16");
    if (c.max_tokens < 0) return FlagError("--max_tokens", "must be >= 0");
    if (!(c.ttl_seconds >= 0)) return FlagError("--ttl_seconds", "must be >= 0");
    if (c.first_position < 0) return FlagError("--first_position", "must be >= 0");
  } else if (c.session_id.empty()) {
    return FlagError("--session_id", absl::StrCat("session ", c.verb, " needs the session's id"));
  }
  const auto only = [&](bool set, absl::string_view flag,
                        std::initializer_list<const char*> verbs) -> absl::Status {
    if (set && !Takes(c, verbs)) {
      return FlagError(flag, absl::StrCat("session ", c.verb, " does not take it"));
    }
    return absl::OkStatus();
  };
  for (const absl::Status& status :
       {only(c.tokens != 0, "--tokens", {"extend"}), only(!c.input.empty(), "--input", {"extend"}),
        only(c.expected_length >= 0, "--expected_length", {"extend"}),
        only(!c.head_mask.empty(), "--head_mask", {"extend"}),
        only(c.stats, "--stats", {"extend"}),
        only(!c.save_output.empty(), "--save_output", {"extend"}),
        only(c.layer >= 0, "--layer", {"extend", "latest", "truncate"}),
        only(!c.save_maps.empty(), "--save_maps", {"latest"}),
        only(c.length >= 0, "--length", {"truncate"}),
        only(c.precision != "fp32", "--precision", {"extend"}),
        only(c.kv_dtype != "fp32", "--kv_dtype", {"open"}),
        only(c.max_tokens != 0, "--max_tokens", {"open"}),
        only(c.ttl_seconds != 0, "--ttl_seconds", {"open"}),
        only(c.first_position != 0, "--first_position", {"open"})}) {
    if (!status.ok()) return status;
  }
  if (c.layer < -1) return FlagError("--layer", "must be >= 0");
  if (c.verb == "extend") {
    if (c.tokens < 0) return FlagError("--tokens", "must be >= 1");
    if ((c.tokens > 0) == !c.input.empty()) {
      return FlagError("--tokens", "session extend takes --tokens=N (random) or --input=X.npy, "
                                   "one of them");
    }
    if (c.precision != "fp32" && c.precision != "bf16") {
      return FlagError("--precision", "fp32 or bf16");
    }
  }
  if (c.verb == "truncate" && c.length < 0) {
    return FlagError("--length", "session truncate needs the tokens to keep (>= 0)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RunSessionCommand(const AttentionClient& client,
                                              const SessionCommand& c) {
  if (absl::Status valid = ValidateSessionCommand(c); !valid.ok()) return valid;
  if (c.verb == "open") {
    v1::OpenSessionRequest request;
    for (const std::string& model : c.models) request.add_models(model);
    request.set_kv_dtype(c.kv_dtype == "bf16" ? v1::DATA_TYPE_BF16 : v1::DATA_TYPE_FP32);
    request.set_max_tokens(c.max_tokens);
    if (c.ttl_seconds > 0) {
      const absl::Duration ttl = absl::Seconds(c.ttl_seconds);
      request.mutable_idle_ttl()->set_seconds(absl::ToInt64Seconds(ttl));
      request.mutable_idle_ttl()->set_nanos(
          static_cast<int32_t>(absl::ToInt64Nanoseconds(ttl % absl::Seconds(1))));
    }
    request.set_first_position(c.first_position);
    absl::StatusOr<v1::Session> session = client.OpenSession(request);
    if (!session.ok()) return session.status();
    return Print(*session, c.json, SessionText(*session));
  }
  if (c.verb == "extend") return RunExtend(client, c);
  if (c.verb == "latest") return RunLatest(client, c);
  if (c.verb == "close") {
    if (absl::Status closed = client.CloseSession(c.session_id); !closed.ok()) return closed;
    return c.json ? absl::StrCat("{\"closed\": \"", c.session_id, "\"}\n")
                  : absl::StrCat("closed ", c.session_id, "\n");
  }
  absl::StatusOr<v1::Session> session;
  if (c.verb == "get") {
    session = client.GetSession(c.session_id);
  } else if (c.verb == "fork") {
    session = client.ForkSession(c.session_id);
  } else {  // truncate
    v1::TruncateSessionRequest request;
    request.set_session_id(c.session_id);
    request.set_all_layers(c.layer < 0);
    request.set_layer(std::max(c.layer, 0));
    request.set_length(c.length);
    session = client.TruncateSession(request);
  }
  if (!session.ok()) return session.status();
  return Print(*session, c.json, SessionText(*session));
}

}  // namespace attnserve::client
