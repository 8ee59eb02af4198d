#include "client/wire_request.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace attnserve::client {
namespace {

using google::protobuf::util::MessageDifferencer;

std::string RandomFloatBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return std::string(reinterpret_cast<const char*>(values.data()), n * sizeof(float));
}

void SetRaw(v1::Tensor* tensor, std::vector<int64_t> shape, uint32_t seed) {
  tensor->set_dtype(v1::DATA_TYPE_FP32);
  size_t n = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    n *= static_cast<size_t>(d);
  }
  tensor->set_raw_data(RandomFloatBytes(n, seed));
}

std::vector<grpc::Slice> SlicesOf(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  return slices;
}

std::string Joined(const grpc::ByteBuffer& bytes) {
  std::string joined;
  for (const grpc::Slice& slice : SlicesOf(bytes)) {
    joined.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return joined;
}

// Every field an Attend request of attnctl can carry, with odd sizes.
v1::AttendRequest FullRequest() {
  v1::AttendRequest request;
  request.set_model("default");
  SetRaw(request.mutable_hidden_states(), {3, 5, 7}, 1);
  SetRaw(request.mutable_context(), {3, 11, 7}, 2);
  request.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
  request.mutable_attention_maps()->add_heads(1);
  request.set_causal(true);
  SetRaw(request.mutable_mask()->mutable_values(), {3, 5, 11}, 3);
  request.set_precision(v1::PRECISION_BF16);
  request.set_output_dtype(v1::DATA_TYPE_BF16);
  request.add_sequence_lengths(5);
  return request;
}

TEST(WireRequest, BytesParseBackToTheRequest) {
  const v1::AttendRequest request = FullRequest();
  const WireRequest wire{v1::AttendRequest(request)};
  EXPECT_EQ(wire.size(), static_cast<int64_t>(request.ByteSizeLong()));
  const std::string bytes = Joined(wire.Bytes());
  EXPECT_EQ(bytes.size(), request.ByteSizeLong());
  v1::AttendRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, request)) << parsed.DebugString();
}

// gRPC may keep a slice after its call ended (a write cut short by a
// deadline): the bytes go with the last slice, not with the WireRequest
// (under AddressSanitizer a read of freed bytes fails this test).
TEST(WireRequest, ItsBytesLiveAsLongAsTheSlicesDo) {
  const v1::AttendRequest request = FullRequest();
  grpc::ByteBuffer bytes;
  {
    const WireRequest wire{v1::AttendRequest(request)};
    bytes = wire.Bytes();
  }
  v1::AttendRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Joined(bytes)));
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, request)) << parsed.DebugString();
}

TEST(WireRequest, SendsTheTensorsFromItsOwnBytesWithoutCopying) {
  const WireRequest wire{FullRequest()};
  const std::vector<grpc::Slice> first = SlicesOf(wire.Bytes());
  const std::vector<grpc::Slice> second = SlicesOf(wire.Bytes());
  ASSERT_EQ(first.size(), second.size());
  // The message, then field start and bytes of the hidden states and of the
  // context: the same memory every time.
  ASSERT_EQ(first.size(), 5u);
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i].begin(), second[i].begin()) << "slice " << i;
  }
  EXPECT_EQ(first[2].size(), 3u * 5 * 7 * sizeof(float));
  EXPECT_EQ(first[4].size(), 3u * 11 * 7 * sizeof(float));
}

TEST(WireRequest, FloatDataAndEmptyRequestsTravelAsTheyAre) {
  v1::AttendRequest floats;
  floats.set_model("m");
  floats.mutable_hidden_states()->add_shape(1);
  floats.mutable_hidden_states()->add_shape(2);
  floats.mutable_hidden_states()->add_shape(2);
  for (float v : {1.0f, -2.0f, 3.5f, 0.25f}) floats.mutable_hidden_states()->add_float_data(v);
  for (const v1::AttendRequest& request : {floats, v1::AttendRequest()}) {
    const WireRequest wire{v1::AttendRequest(request)};
    v1::AttendRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Joined(wire.Bytes())));
    EXPECT_TRUE(MessageDifferencer::Equals(parsed, request)) << parsed.DebugString();
    EXPECT_EQ(wire.size(), static_cast<int64_t>(request.ByteSizeLong()));
  }
}

}  // namespace
}  // namespace attnserve::client
