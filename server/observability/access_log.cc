#include "server/observability/access_log.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attnserve::server {
namespace {

// Client strings longer than this are cut in the log.
constexpr size_t kMaxLoggedString = 128;
constexpr int kMaxLoggedDims = 8;

// `text` as a JSON string literal. Bytes >= 0x80 pass through: the strings
// logged are proto3 strings (UTF-8, checked by the parser) or ours.
void AppendJsonString(std::string& out, absl::string_view text) {
  out.push_back('"');
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

// At most kMaxLoggedString bytes of `text`, cut at a UTF-8 character
// boundary, with "..." when cut.
std::string Cut(absl::string_view text) {
  if (text.size() <= kMaxLoggedString) return std::string(text);
  size_t end = kMaxLoggedString;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return absl::StrCat(text.substr(0, end), "...");
}

void AppendField(std::string& out, absl::string_view name, absl::string_view value) {
  absl::StrAppend(&out, ",\"", name, "\":");
  AppendJsonString(out, value);
}

void AppendSeconds(std::string& out, absl::string_view name, absl::Duration d) {
  absl::StrAppendFormat(&out, ",\"%s\":%.6f", name, absl::ToDoubleSeconds(d));
}

bool IsRequestIdChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
         c == '-';
}

}  // namespace

std::string FormatAccessLogLine(const AccessLogEntry& entry) {
  std::string line = "{\"time\":";
  AppendJsonString(line, absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", entry.time, absl::UTCTimeZone()));
  AppendField(line, "log", "access");
  AppendField(line, "request_id", entry.request_id);
  AppendField(line, "method", RpcMethodName(entry.method));
  AppendField(line, "model", Cut(entry.model));
  AppendField(line, "peer", entry.peer);
  if (!entry.shapes.empty()) absl::StrAppend(&line, ",\"shapes\":", entry.shapes);
  AppendField(line, "code", absl::StatusCodeToString(entry.code));
  if (entry.code != absl::StatusCode::kOk) AppendField(line, "message", Cut(entry.message));
  AppendSeconds(line, "duration_seconds", entry.duration);
  if (entry.queue) AppendSeconds(line, "queue_seconds", *entry.queue);
  if (entry.compute) AppendSeconds(line, "compute_seconds", *entry.compute);
  line.push_back('}');
  return line;
}

void WriteAccessLog(const AccessLogEntry& entry) {
  const std::string line = absl::StrCat(FormatAccessLogLine(entry), "\n");
  // One write(2) keeps lines from concurrent threads whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

std::string RequestIdOrNew(std::optional<absl::string_view> from_client) {
  if (from_client && !from_client->empty() && from_client->size() <= 128 &&
      std::all_of(from_client->begin(), from_client->end(), IsRequestIdChar)) {
    return std::string(*from_client);
  }
  thread_local std::mt19937_64 random_bits{std::random_device{}()};
  return absl::StrFormat("%016x%016x", random_bits(), random_bits());
}

std::string AttendShapes(const v1::AttendRequest& request) {
  std::vector<std::string> shapes;
  auto add = [&shapes](absl::string_view name, const v1::Tensor& tensor) {
    const int dims = std::min(tensor.shape_size(), kMaxLoggedDims);
    shapes.push_back(absl::StrCat(
        "\"", name, "\":[",
        absl::StrJoin(tensor.shape().begin(), tensor.shape().begin() + dims, ","), "]"));
  };
  if (request.has_hidden_states()) add("hidden_states", request.hidden_states());
  if (request.has_context()) add("context", request.context());
  if (request.has_projected()) {
    add("q", request.projected().q());
    add("k", request.projected().k());
    add("v", request.projected().v());
  }
  if (request.has_mask()) add("mask", request.mask().values());
  return absl::StrCat("{", absl::StrJoin(shapes, ","), "}");
}

}  // namespace attnserve::server
