#ifndef ATTNSERVE_SERVER_API_MAP_STREAM_H_
#define ATTNSERVE_SERVER_API_MAP_STREAM_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/repeated_field.h"
#include "server/api/wire_response.h"

namespace attnserve::server {

// The values of each AttendStream map chunk stay at or under this many bytes
// (and under --max_send_message_bytes): with their framing, well under the
// 4 MiB that gRPC clients accept by default.
inline constexpr int64_t kMapChunkBytes = int64_t{1} << 20;

// One chunk of attention maps: whole rows of one sequence, either whole heads
// (first_row 0, rows = every row) or some rows of one head.
struct MapChunkPlan {
  int64_t sequence = 0;
  int64_t first_head = 0;  // 0 for mean maps
  int64_t first_row = 0;
  int64_t heads = 1;  // 1 for mean maps
  int64_t rows = 0;
  int64_t first_value = 0;  // the chunk's first value's index in the maps
  int64_t values = 0;
};

// Splits maps of `map_shape` ([batch, heads, rows, keys], or [batch, rows,
// keys] for mean maps) into chunks of whole rows of at most `max_chunk_values`
// values each, but at least one row each; in the maps' order, covering them
// once. No chunks when the maps have no values. Thread-safe.
std::vector<MapChunkPlan> PlanMapChunks(absl::Span<const int64_t> map_shape,
                                        int64_t max_chunk_values);

// The messages of one AttendStream call (AttendStreamResponse): first the
// response with everything but the maps' values (its attention_maps keep their
// dtype and shape), then the maps in chunks (PlanMapChunks) in the maps'
// encoding: raw chunks are slices of the one buffer the kernels wrote the maps
// into, never copies; float_data chunks are copied (small requests only).
//
// Not thread-safe; used by one call at a time.
class MapStream {
 public:
  // Takes `response` (complete, maps included). Each chunk carries at most
  // `max_chunk_bytes` of map values (but at least one row).
  MapStream(WireResponse response, int64_t max_chunk_bytes);
  MapStream(const MapStream&) = delete;
  MapStream& operator=(const MapStream&) = delete;

  // Messages in the stream: the response and the chunks.
  int64_t size() const { return 1 + static_cast<int64_t>(chunks_.size()); }
  int64_t chunks() const { return static_cast<int64_t>(chunks_.size()); }

  // The wire form of message `index` into `out`. Call it once per index, in
  // order (the first takes the response's buffers). INTERNAL if a message
  // cannot be serialized.
  absl::Status Serialize(int64_t index, grpc::ByteBuffer* out);

 private:
  absl::Status SerializeChunk(const MapChunkPlan& chunk, grpc::ByteBuffer* out) const;

  WireResponse response_;
  v1::Tensor map_header_;  // the maps' dtype and full shape
  int64_t value_bytes_ = 4;
  // The maps' values: raw (one slice) or float_data.
  grpc::Slice raw_maps_;
  google::protobuf::RepeatedField<float> float_maps_;
  std::vector<MapChunkPlan> chunks_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_MAP_STREAM_H_
