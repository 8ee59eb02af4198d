#ifndef ATTNSERVE_SERVER_EXPLORER_EXPLORER_ROUTES_H_
#define ATTNSERVE_SERVER_EXPLORER_EXPLORER_ROUTES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/statusor.h"
#include "server/explorer/explorer_api.h"
#include "server/http/http_front.h"

namespace attnserve::server {

struct ExplorerOptions {
  // Serve the page's files from this folder, read at each request, instead
  // of the embedded ones (--explorer_web_dir; for editing the page without
  // rebuilding). Empty: the embedded files.
  std::string web_dir;
  // The HTTP front's body limit, reported to the page.
  int64_t max_body_bytes = int64_t{64} << 20;
  // The server's limits on ad-hoc layers, reported to the page and kept to.
  ExplorerLayerLimits layer_limits;
};

// The attention explorer's routes on the HTTP port (docs/explorer.md), all
// browser-facing (HttpRoute::browser_facing: Host and Origin checked,
// security headers):
//   GET  /explorer              308 to /explorer/
//   GET  /explorer/             index.html
//   GET  /explorer/{name}       a file of the page (ExplorerAssets), 404 if none
//   GET  /explorer/api/models   ExplorerApi::Models  (token when configured)
//   POST /explorer/api/inputs   ExplorerApi::Inputs  (token when configured)
//   POST /explorer/api/attend   ExplorerApi::Attend  (token when configured)
// INVALID_ARGUMENT when options.web_dir is not a folder. The routes are
// thread-safe.
absl::StatusOr<std::vector<HttpRoute>> ExplorerRoutes(std::shared_ptr<grpc::Channel> channel,
                                                      const ExplorerOptions& options);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_EXPLORER_ROUTES_H_
