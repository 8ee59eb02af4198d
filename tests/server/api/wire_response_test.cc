// WireResponse: the bytes it hands gRPC parse, with the generated parser, into
// the response whose raw_data fields hold the kernels' buffers, each tensor
// written once, and those buffers reach gRPC without a copy.
#include "server/api/wire_response.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/protobuf/wire_format_lite.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

// `n` random bytes, as the raw form of some tensor.
std::string RandomBytes(size_t n, std::mt19937_64& rng) {
  std::string bytes(n, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  return bytes;
}

RawBytes RawCopyOf(const std::string& bytes) {
  RawBytes raw = RawBytes::Uninitialized(bytes.size());
  std::memcpy(raw.data(), bytes.data(), bytes.size());
  return raw;
}

void SetTensorHeader(v1::DataType dtype, std::vector<int64_t> shape, v1::Tensor* tensor) {
  tensor->set_dtype(dtype);
  for (int64_t d : shape) tensor->add_shape(d);
}

// A response as the runner fills it: everything in the message but the two
// raw_data fields, which are in `wire`'s buffers; `expected` is the same
// response with them in place.
void FillBoth(size_t output_bytes, size_t map_bytes, std::mt19937_64& rng, WireResponse* wire,
              v1::AttendResponse* expected) {
  v1::AttendResponse& message = wire->message;
  message.set_model("default");
  message.set_kernel_path("fp32/materialized");
  message.set_precision(v1::PRECISION_FP32);
  message.mutable_timing()->set_batch_size(3);
  SetTensorHeader(v1::DATA_TYPE_FP32, {1, static_cast<int64_t>(output_bytes / 4)},
                  message.mutable_output());
  v1::Tensor* entropy = message.mutable_head_statistics()->mutable_entropy();
  SetTensorHeader(v1::DATA_TYPE_FP32, {1, 2}, entropy);
  entropy->set_raw_data(RandomBytes(8, rng));
  if (map_bytes > 0) {
    SetTensorHeader(v1::DATA_TYPE_BF16, {1, 1, static_cast<int64_t>(map_bytes / 2)},
                    message.mutable_attention_maps());
  }
  *expected = message;
  const std::string output = RandomBytes(output_bytes, rng);
  expected->mutable_output()->set_raw_data(output);
  wire->output_raw = RawCopyOf(output);
  if (map_bytes > 0) {
    const std::string maps = RandomBytes(map_bytes, rng);
    expected->mutable_attention_maps()->set_raw_data(maps);
    wire->maps_raw = RawCopyOf(maps);
  }
}

std::string Flatten(grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  std::string all;
  for (const grpc::Slice& slice : slices) {
    all.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return all;
}

v1::AttendResponse Parse(grpc::ByteBuffer& bytes) {
  v1::AttendResponse parsed;
  EXPECT_TRUE(parsed.ParseFromString(Flatten(bytes)));
  return parsed;
}

// How many times each top-level field number occurs in `wire`.
std::map<int, int> FieldOccurrences(const std::string& wire) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()),
                                            static_cast<int>(wire.size()));
  std::map<int, int> occurrences;
  while (const uint32_t tag = in.ReadTag()) {
    ++occurrences[google::protobuf::internal::WireFormatLite::GetTagFieldNumber(tag)];
    EXPECT_TRUE(google::protobuf::internal::WireFormatLite::SkipField(&in, tag));
  }
  return occurrences;
}

TEST(WireResponse, ParsesAsTheResponseWithItsRawDataInPlace) {
  std::mt19937_64 rng(std::random_device{}());
  // Sizes whose length prefixes take 1, 2, 3 and 4 varint bytes.
  for (const auto& [output_bytes, map_bytes] :
       std::vector<std::pair<size_t, size_t>>{{4, 0}, {200, 2}, {3072, 40000}, {1 << 22, 6 << 20}}) {
    SCOPED_TRACE(testing::Message() << "output " << output_bytes << " B, maps " << map_bytes << " B");
    WireResponse wire;
    v1::AttendResponse expected;
    FillBoth(output_bytes, map_bytes, rng, &wire, &expected);
    grpc::ByteBuffer bytes;
    ASSERT_TRUE(wire.SerializeTo(&bytes).ok());
    EXPECT_EQ(bytes.Length(), expected.ByteSizeLong());
    // Each tensor whole, once: decoders that replace a repeated message field
    // rather than merge it read the same.
    const std::map<int, int> occurrences = FieldOccurrences(Flatten(bytes));
    EXPECT_EQ(occurrences.at(v1::AttendResponse::kOutputFieldNumber), 1);
    EXPECT_EQ(occurrences.count(v1::AttendResponse::kAttentionMapsFieldNumber), map_bytes > 0 ? 1u : 0u);
    const v1::AttendResponse parsed = Parse(bytes);
    std::string difference;
    google::protobuf::util::MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&difference);
    EXPECT_TRUE(differencer.Compare(parsed, expected)) << difference;
    EXPECT_TRUE(wire.output_raw.empty());
    EXPECT_TRUE(wire.maps_raw.empty());
  }
}

TEST(WireResponse, HandsTheRawBuffersToGrpcWithoutCopyingThem) {
  std::mt19937_64 rng(std::random_device{}());
  WireResponse wire;
  v1::AttendResponse expected;
  FillBoth(1 << 20, 3 << 20, rng, &wire, &expected);
  const char* output = wire.output_raw.data();
  const char* maps = wire.maps_raw.data();
  grpc::ByteBuffer bytes;
  ASSERT_TRUE(wire.SerializeTo(&bytes).ok());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(bytes.Dump(&slices).ok());
  int found = 0;
  for (const grpc::Slice& slice : slices) {
    const auto* begin = reinterpret_cast<const char*>(slice.begin());
    if (begin == output) {
      EXPECT_EQ(slice.size(), size_t{1} << 20);
      ++found;
    }
    if (begin == maps) {
      EXPECT_EQ(slice.size(), size_t{3} << 20);
      ++found;
    }
  }
  EXPECT_EQ(found, 2);
}

TEST(WireResponse, WithoutRawBuffersIsTheMessageAloneAndAMapOfFloatDataCounts) {
  WireResponse wire;
  wire.message.set_model("m");
  wire.message.mutable_output()->add_float_data(1.5f);
  wire.message.mutable_attention_maps()->add_float_data(0.25f);
  wire.message.mutable_attention_maps()->add_float_data(0.75f);
  EXPECT_EQ(wire.attention_map_bytes(), 8);
  const v1::AttendResponse expected = wire.message;
  grpc::ByteBuffer bytes;
  ASSERT_TRUE(wire.SerializeTo(&bytes).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(Parse(bytes), expected));

  WireResponse raw;
  RawBytes moved_from = RawBytes::Uninitialized(12);
  raw.maps_raw = std::move(moved_from);
  EXPECT_TRUE(moved_from.empty());  // NOLINT(bugprone-use-after-move): the contract
  EXPECT_EQ(raw.maps_raw.size(), 12u);
  EXPECT_EQ(raw.attention_map_bytes(), 12);
  raw.Clear();
  EXPECT_EQ(raw.attention_map_bytes(), 0);
}

}  // namespace
}  // namespace attnserve::server
