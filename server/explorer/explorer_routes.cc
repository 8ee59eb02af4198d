#include "server/explorer/explorer_routes.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "server/explorer/explorer_api.h"
#include "server/explorer/explorer_assets.h"

namespace attnserve::server {
namespace {

HttpResponse Asset(const ExplorerAssets& assets, absl::string_view name) {
  std::optional<ExplorerAsset> asset = assets.Find(name);
  if (!asset) {
    return HttpResponse{.status = 404,
                        .body = JsonErrorBody("no such file of the explorer page")};
  }
  return HttpResponse{.content_type = std::move(asset->content_type),
                      .body = std::move(asset->body)};
}

}  // namespace

absl::StatusOr<std::vector<HttpRoute>> ExplorerRoutes(std::shared_ptr<grpc::Channel> channel,
                                                      const ExplorerOptions& options) {
  absl::StatusOr<std::unique_ptr<ExplorerAssets>> created = ExplorerAssets::Create(options.web_dir);
  if (!created.ok()) return created.status();
  std::shared_ptr<const ExplorerAssets> assets = *std::move(created);
  auto api = std::make_shared<const ExplorerApi>(std::move(channel), options.max_body_bytes,
                                                options.layer_limits);
  std::vector<HttpRoute> routes;
  routes.push_back({.method = "GET",
                    .pattern = "/explorer",
                    .browser_facing = true,
                    .handler = [assets](const HttpRequest& request) {
                      if (!absl::EndsWith(request.path, "/")) {
                        return HttpResponse{.status = 308,
                                            .content_type = "text/plain; charset=utf-8",
                                            .body = "/explorer/\n",
                                            .headers = {{"Location", "/explorer/"}}};
                      }
                      return Asset(*assets, "index.html");
                    }});
  routes.push_back({.method = "GET",
                    .pattern = "/explorer/{}",
                    .browser_facing = true,
                    .handler = [assets](const HttpRequest& request) {
                      return Asset(*assets, request.path_params[0]);
                    }});
  routes.push_back({.method = "GET",
                    .pattern = "/explorer/api/models",
                    .needs_token = true,
                    .browser_facing = true,
                    .handler = [api](const HttpRequest& request) { return api->Models(request); }});
  routes.push_back({.method = "POST",
                    .pattern = "/explorer/api/inputs",
                    .needs_token = true,
                    .takes_body = true,
                    .browser_facing = true,
                    .handler = [api](const HttpRequest& request) { return api->Inputs(request); }});
  routes.push_back({.method = "POST",
                    .pattern = "/explorer/api/attend",
                    .needs_token = true,
                    .takes_body = true,
                    .browser_facing = true,
                    .handler = [api](const HttpRequest& request) { return api->Attend(request); }});
  routes.push_back({.method = "POST",
                    .pattern = "/explorer/api/session",
                    .needs_token = true,
                    .takes_body = true,
                    .browser_facing = true,
                    .handler = [api](const HttpRequest& request) { return api->Session(request); }});
  return routes;
}

}  // namespace attnserve::server
