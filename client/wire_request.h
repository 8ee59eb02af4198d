#ifndef ATTNSERVE_CLIENT_WIRE_REQUEST_H_
#define ATTNSERVE_CLIENT_WIRE_REQUEST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "attnserve/v1/attention.pb.h"

namespace attnserve::client {

// An AttendRequest ready to be sent, once or many times, without its input
// tensors being copied per call. gRPC's generated stub serializes a message
// into a fresh buffer of its whole size for every call (3 MB of hidden states
// at B=8 S=128: about 1 ms on the client, before the first byte leaves); a
// WireRequest serializes the rest of the message once and hands gRPC the
// hidden states' and the context's raw_data as slices over the bytes it
// took from the request.
//
// The bytes on the wire are the request's (each raw tensor whole, header and
// bytes, after the message's other fields: what any protobuf parser reads,
// field order being free).
//
// Immutable after construction, so thread-safe: many calls may send it at
// once. The slices of Bytes() hold the bytes themselves (gRPC may keep a
// slice after its call ended), so the object may go before the calls do.
class WireRequest {
 public:
  // Takes `request`'s raw tensors without copying them (pass an rvalue, or
  // a copy to keep the original).
  explicit WireRequest(v1::AttendRequest request);
  WireRequest(const WireRequest&) = delete;
  WireRequest& operator=(const WireRequest&) = delete;

  // The wire form, as slices over this object's bytes (no copy).
  grpc::ByteBuffer Bytes() const;
  // Bytes on the wire (the request's ByteSizeLong()).
  int64_t size() const { return size_; }

 private:
  // In order: the message without its raw tensors, then for each raw tensor
  // the start of its field (tag, length, its header, raw_data's start) and
  // its bytes.
  std::shared_ptr<const std::vector<std::string>> pieces_;
  int64_t size_ = 0;
};

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_WIRE_REQUEST_H_
