#include "server/explorer/explorer_assets.h"

#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/explorer/embedded_assets.h"

namespace attnserve::server {
namespace {

// A served file's name: [A-Za-z0-9_-][A-Za-z0-9._-]*, at most 128 bytes.
bool AllowedName(absl::string_view name) {
  if (name.empty() || name.size() > 128 || name[0] == '.') return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' &&
        c != '_') {
      return false;
    }
  }
  return true;
}

// The largest file served from --explorer_web_dir.
constexpr int64_t kMaxDevFileBytes = int64_t{16} << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<ExplorerAssets>> ExplorerAssets::Create(
    const std::string& web_dir) {
  if (!web_dir.empty()) {
    struct stat info;
    if (stat(web_dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--explorer_web_dir: '", web_dir, "' is not a folder"));
    }
  }
  return std::unique_ptr<ExplorerAssets>(new ExplorerAssets(web_dir));
}

std::optional<ExplorerAsset> ExplorerAssets::Find(absl::string_view name) const {
  if (!AllowedName(name)) return std::nullopt;
  if (web_dir_.empty()) {
    for (const EmbeddedAsset& asset : EmbeddedExplorerAssets()) {
      if (name == asset.name) {
        return ExplorerAsset{
            .content_type = ContentTypeFor(name),
            .body = std::string(reinterpret_cast<const char*>(asset.data), asset.size)};
      }
    }
    return std::nullopt;
  }
  const std::string path = absl::StrCat(web_dir_, "/", name);
  struct stat info;
  if (stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode) || info.st_size > kMaxDevFileBytes) {
    return std::nullopt;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string body((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ExplorerAsset{.content_type = ContentTypeFor(name), .body = std::move(body)};
}

std::string ExplorerAssets::ContentTypeFor(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (absl::EndsWith(lower, ".html")) return "text/html; charset=utf-8";
  if (absl::EndsWith(lower, ".js")) return "text/javascript";
  if (absl::EndsWith(lower, ".css")) return "text/css";
  if (absl::EndsWith(lower, ".svg")) return "image/svg+xml";
  if (absl::EndsWith(lower, ".png")) return "image/png";
  if (absl::EndsWith(lower, ".json")) return "application/json";
  return "application/octet-stream";
}

}  // namespace attnserve::server
