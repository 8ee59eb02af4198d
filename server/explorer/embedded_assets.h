#ifndef ATTNSERVE_SERVER_EXPLORER_EMBEDDED_ASSETS_H_
#define ATTNSERVE_SERVER_EXPLORER_EMBEDDED_ASSETS_H_

#include <cstddef>

#include "absl/types/span.h"

namespace attnserve::server {

// One file of server/explorer/web/, embedded in the binary.
struct EmbeddedAsset {
  const char* name;  // the file's name, e.g. "index.html"
  const unsigned char* data;
  size_t size;
};

// Every file of server/explorer/web/ at build time, sorted by name. Defined
// in a source file that cmake/EmbedFiles.cmake generates. Thread-safe
// (constant data).
absl::Span<const EmbeddedAsset> EmbeddedExplorerAssets();

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_EMBEDDED_ASSETS_H_
