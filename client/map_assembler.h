#ifndef ATTNSERVE_CLIENT_MAP_ASSEMBLER_H_
#define ATTNSERVE_CLIENT_MAP_ASSEMBLER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::client {

// Puts AttendStream's messages back together into one AttendResponse: the
// response first (its attention_maps give the maps' dtype and shape), then
// each chunk's values copied into place, so the client holds the maps once
// and one chunk at a time.
//
// Every message is checked against what came before (chunks in order, inside
// the maps, in the maps' dtype and the first chunk's encoding): INTERNAL naming what is
// wrong when the server's stream is not what AttendStream promises.
//
// Not thread-safe.
class MapAssembler {
 public:
  // Takes one message of the stream, in the order received.
  absl::Status Add(v1::AttendStreamResponse& message);
  // The response with its maps, once the stream has ended OK; INTERNAL if
  // the response or some map values never came. Once.
  absl::StatusOr<v1::AttendResponse> Finish();

  int64_t chunks() const { return chunks_; }

 private:
  absl::Status Start(v1::AttendResponse& response);
  absl::Status Place(const v1::AttentionMapChunk& chunk);

  bool started_ = false;
  v1::AttendResponse response_;
  bool raw_ = true;          // the first chunk came as raw_data (else float_data)
  int64_t value_bytes_ = 4;  // raw: bytes per value
  int64_t heads_ = 1, rows_ = 0, keys_ = 0, batch_ = 0;
  int64_t values_ = 0;       // in the whole maps
  int64_t received_ = 0;     // values placed so far
  int64_t chunks_ = 0;
};

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_MAP_ASSEMBLER_H_
