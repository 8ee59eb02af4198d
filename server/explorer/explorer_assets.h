#ifndef ATTNSERVE_SERVER_EXPLORER_EXPLORER_ASSETS_H_
#define ATTNSERVE_SERVER_EXPLORER_EXPLORER_ASSETS_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// A file of the explorer's page, as served.
struct ExplorerAsset {
  std::string content_type;
  std::string body;
};

// The explorer page's files: those embedded at build time
// (EmbeddedExplorerAssets), or, for development, the files of a folder read
// at each request (--explorer_web_dir), so the page can be edited without
// rebuilding. A name is one path segment of letters, digits, '.', '-' and
// '_' not starting with '.', so nothing outside the folder can be named.
// The content type comes from the extension: .html text/html;
// charset=utf-8, .js text/javascript, .css text/css, .svg image/svg+xml,
// .png image/png, .json application/json, others application/octet-stream.
// Thread-safe (constant after Create).
class ExplorerAssets {
 public:
  // `web_dir` empty: the embedded files. Otherwise INVALID_ARGUMENT when it
  // is not a readable folder.
  static absl::StatusOr<std::unique_ptr<ExplorerAssets>> Create(const std::string& web_dir);

  // The file `name`, or nullopt when there is none of that name (or the name
  // is not allowed).
  std::optional<ExplorerAsset> Find(absl::string_view name) const;

  // The content type for a file name, by its extension.
  static std::string ContentTypeFor(absl::string_view name);

 private:
  explicit ExplorerAssets(std::string web_dir) : web_dir_(std::move(web_dir)) {}

  const std::string web_dir_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_EXPLORER_ASSETS_H_
