#ifndef ATTNSERVE_SERVER_EXPLORER_EXPLORER_API_H_
#define ATTNSERVE_SERVER_EXPLORER_EXPLORER_API_H_

#include <cstdint>
#include <memory>

#include <grpcpp/channel.h>

#include "server/http/http_front.h"

namespace attnserve::server {

// The server's limits on ad-hoc layers (AttendRequest.layer) that the
// explorer reports (Models' limits.layer) and keeps to: the gRPC API's
// request limits (--max_seq_len, --max_attention_map_bytes,
// --max_adhoc_weight_bytes).
struct ExplorerLayerLimits {
  int64_t max_seq_len = 2048;
  int64_t max_attention_map_bytes = int64_t{64} << 20;
  int64_t max_weight_bytes = int64_t{64} << 20;
};

// The attention explorer's JSON API (docs/explorer.md has the full spec),
// each answer built from calls of attnserve.v1.AttentionService through
// `channel` (the gRPC server's in-process channel), so validation, tokens,
// limits and metrics are the gRPC API's:
//   Models  (GET  /explorer/api/models): ListModels' READY models and the
//           explorer's limits (with those of ad-hoc layers).
//   Inputs  (POST /explorer/api/inputs): {"seed", "seq_len", "d_model"} ->
//           {"npy": base64 of the seeded hidden states (SeededHiddenStates)}.
//   Attend  (POST /explorer/api/attend): one request's statistics, output
//           norm (and, with heads removed, the relative change of the
//           output), max-pooled per-head maps, a region and a query row at
//           full resolution. The maps come through Attend in chunks of query
//           rows (AttentionMapRequest.query_rows), each within the model's
//           max_attention_map_bytes and kMaxChunkMapBytes, and are pooled as
//           they come (MaxPoolGrid): the full maps are never held. The
//           request names a loaded "model" or carries an ad-hoc "layer" (a
//           head configuration with seeded weights, AttendRequest.layer).
//   Session (POST /explorer/api/session): what a decode session layer's
//           latest token attends to, per head, over the layer's whole cache
//           (GetLatestAttention: a read that does not extend the session,
//           for the token that opened it), max-pooled over keys to at most
//           "cols" columns, and a range of keys at full resolution.
// Errors: 400 {"error": "<field>: ..."} for a bad request (fields as in the
// JSON: "inputs.npy: ...", "region.q1: ...", "head_mask: ...",
// "layer.num_heads: ..."); a gRPC error as HttpStatusFor(its code) with its
// message (which names the AttendRequest field; for an ad-hoc layer,
// "layer.head_config.x" reads "layer.x", as the JSON names it). The caller's Authorization header goes on as the
// calls' "authorization" metadata.
//
// Thread-safe (constant after construction; each request its own stub).
class ExplorerApi {
 public:
  // The largest pooled map edge ("grid").
  static constexpr int64_t kMaxGrid = 512;
  static constexpr int64_t kDefaultGrid = 256;
  // The most map cells one region answer may carry, over all its heads
  // (16 MiB of float32).
  static constexpr int64_t kMaxRegionCells = int64_t{1} << 22;
  // The most map bytes one chunk's Attend call asks for (at most the
  // model's max_attention_map_bytes too): bounds the memory a request holds.
  static constexpr int64_t kMaxChunkMapBytes = int64_t{16} << 20;
  // The most values /explorer/api/inputs makes (64 MiB of float32).
  static constexpr int64_t kMaxInputValues = int64_t{16} << 20;
  // The most pooled key columns a session answer has, and the default.
  static constexpr int64_t kMaxSessionCols = 4096;
  static constexpr int64_t kDefaultSessionCols = 1024;

  // `max_body_bytes`: the HTTP front's limit, reported in Models' limits;
  // `layer_limits`: the server's limits on ad-hoc layers.
  ExplorerApi(std::shared_ptr<grpc::Channel> channel, int64_t max_body_bytes,
              const ExplorerLayerLimits& layer_limits);
  ExplorerApi(const ExplorerApi&) = delete;
  ExplorerApi& operator=(const ExplorerApi&) = delete;

  HttpResponse Models(const HttpRequest& request) const;
  HttpResponse Inputs(const HttpRequest& request) const;
  HttpResponse Attend(const HttpRequest& request) const;
  HttpResponse Session(const HttpRequest& request) const;

 private:
  const std::shared_ptr<grpc::Channel> channel_;
  const int64_t max_body_bytes_;
  const ExplorerLayerLimits layer_limits_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_EXPLORER_EXPLORER_API_H_
