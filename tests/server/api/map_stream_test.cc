// AttendStream's messages: the chunk plan covers the maps once, in order, in
// whole rows under the size asked for; each message parses with the generated
// parser; raw chunks are slices of the kernels' buffer, not copies; and the
// client's MapAssembler puts the maps back bit for bit, refusing streams that
// break the format.
#include "server/api/map_stream.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "client/map_assembler.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

struct PlanCase {
  std::vector<int64_t> shape;
  int64_t max_values;
};

class PlanMapChunksTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(PlanMapChunksTest, CoversTheMapsOnceInOrderInWholeRowsUnderTheSize) {
  const PlanCase& c = GetParam();
  const bool per_head = c.shape.size() == 4;
  const int64_t heads = per_head ? c.shape[1] : 1;
  const int64_t rows = c.shape[c.shape.size() - 2];
  const int64_t keys = c.shape.back();
  const std::vector<MapChunkPlan> chunks = PlanMapChunks(c.shape, c.max_values);
  int64_t next = 0;
  for (const MapChunkPlan& chunk : chunks) {
    EXPECT_EQ(chunk.first_value, next);
    EXPECT_EQ(chunk.first_value,
              ((chunk.sequence * heads + chunk.first_head) * rows + chunk.first_row) * keys);
    EXPECT_EQ(chunk.values, chunk.heads * chunk.rows * keys);
    EXPECT_TRUE(chunk.values <= c.max_values || chunk.rows == 1) << chunk.values;
    EXPECT_TRUE(chunk.heads == 1 || (chunk.first_row == 0 && chunk.rows == rows));
    EXPECT_LE(chunk.first_head + chunk.heads, heads);
    EXPECT_LE(chunk.first_row + chunk.rows, rows);
    next += chunk.values;
  }
  int64_t total = 1;
  for (int64_t d : c.shape) total *= d;
  EXPECT_EQ(next, total);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PlanMapChunksTest,
    ::testing::Values(PlanCase{{4, 12, 512, 512}, 1 << 18},  // whole heads, one per chunk
                      PlanCase{{2, 12, 64, 64}, 1 << 18},    // many heads per chunk
                      PlanCase{{2, 12, 64, 64}, 5 * 4096},   // 5 heads, then the rest
                      PlanCase{{1, 3, 1000, 700}, 1 << 18},  // rows of one head
                      PlanCase{{1, 2, 7, 300}, 100},         // a row over the size: one row each
                      PlanCase{{3, 50, 40}, 1000},           // mean maps
                      PlanCase{{1, 1, 1, 1}, 1}));

TEST(PlanMapChunks, HasNoChunksForMapsWithoutValues) {
  EXPECT_TRUE(PlanMapChunks(std::vector<int64_t>{}, 100).empty());
  EXPECT_TRUE(PlanMapChunks(std::vector<int64_t>{2, 0, 5}, 100).empty());
}

// A response as the runner leaves it: output and maps raw in their buffers
// (or in float_data), statistics and timing in the message.
WireResponse Response(const std::vector<int64_t>& map_shape, v1::DataType dtype, bool float_data,
                      std::mt19937_64& rng, std::string* maps_bytes) {
  WireResponse response;
  response.message.set_model("default");
  response.message.set_kernel_path("fp32/materialized");
  response.message.mutable_timing()->set_batch_size(1);
  v1::Tensor* output = response.message.mutable_output();
  output->set_dtype(v1::DATA_TYPE_FP32);
  output->add_shape(3);
  int64_t values = 1;
  for (int64_t d : map_shape) values *= d;
  v1::Tensor* maps = response.message.mutable_attention_maps();
  maps->set_dtype(dtype);
  for (int64_t d : map_shape) maps->add_shape(d);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  if (float_data) {
    for (int i = 0; i < 3; ++i) output->add_float_data(uniform(rng));
    for (int64_t i = 0; i < values; ++i) maps->add_float_data(uniform(rng));
    maps_bytes->assign(reinterpret_cast<const char*>(maps->float_data().data()),
                       static_cast<size_t>(values) * sizeof(float));
    return response;
  }
  response.output_raw = RawBytes::Uninitialized(12);
  std::memset(response.output_raw.data(), 1, 12);
  const size_t bytes = static_cast<size_t>(values) * (dtype == v1::DATA_TYPE_BF16 ? 2 : 4);
  response.maps_raw = RawBytes::Uninitialized(bytes);
  for (size_t i = 0; i < bytes; ++i) response.maps_raw.data()[i] = static_cast<char>(rng());
  maps_bytes->assign(response.maps_raw.data(), bytes);
  return response;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

struct StreamCase {
  std::vector<int64_t> shape;
  v1::DataType dtype;
  bool float_data;
  int64_t max_chunk_bytes;
};

class MapStreamTest : public ::testing::TestWithParam<StreamCase> {};

TEST_P(MapStreamTest, MessagesParseAndTheAssemblerPutsTheMapsBackBitForBit) {
  const StreamCase& c = GetParam();
  std::mt19937_64 rng(std::random_device{}());
  std::string maps_bytes;
  MapStream stream(Response(c.shape, c.dtype, c.float_data, rng, &maps_bytes), c.max_chunk_bytes);
  ASSERT_GE(stream.size(), 2);
  client::MapAssembler assembler;
  for (int64_t i = 0; i < stream.size(); ++i) {
    grpc::ByteBuffer buffer;
    ASSERT_TRUE(stream.Serialize(i, &buffer).ok());
    const std::string bytes = Flatten(buffer);
    v1::AttendStreamResponse message;
    ASSERT_TRUE(message.ParseFromString(bytes)) << "message " << i;
    if (i == 0) {
      ASSERT_TRUE(message.has_response());
      EXPECT_EQ(message.response().model(), "default");
      EXPECT_EQ(message.response().output().shape(0), 3);
      EXPECT_TRUE(message.response().attention_maps().raw_data().empty());
      EXPECT_EQ(message.response().attention_maps().float_data_size(), 0);
      EXPECT_EQ(message.response().attention_maps().shape_size(),
                static_cast<int>(c.shape.size()));
    } else {
      ASSERT_TRUE(message.has_map_chunk()) << "message " << i;
      const v1::Tensor& chunk = message.map_chunk().maps();
      const int64_t chunk_bytes = c.float_data ? chunk.float_data_size() * 4
                                               : static_cast<int64_t>(chunk.raw_data().size());
      // Whole rows, at most the size asked for unless one row is more.
      EXPECT_TRUE(chunk_bytes <= c.max_chunk_bytes ||
                  chunk.shape(chunk.shape_size() - 2) == 1);
    }
    ASSERT_TRUE(assembler.Add(message).ok()) << "message " << i;
  }
  absl::StatusOr<v1::AttendResponse> assembled = assembler.Finish();
  ASSERT_TRUE(assembled.ok()) << assembled.status();
  const v1::Tensor& maps = assembled->attention_maps();
  const std::string got = c.float_data
                              ? std::string(reinterpret_cast<const char*>(maps.float_data().data()),
                                            maps.float_data_size() * sizeof(float))
                              : maps.raw_data();
  EXPECT_TRUE(got == maps_bytes);
  EXPECT_EQ(assembler.chunks(), stream.chunks());
  EXPECT_EQ(maps.dtype(), c.dtype);
}

INSTANTIATE_TEST_SUITE_P(
    Encodings, MapStreamTest,
    ::testing::Values(StreamCase{{2, 12, 128, 128}, v1::DATA_TYPE_FP32, false, 1 << 18},
                      StreamCase{{2, 3, 100, 300}, v1::DATA_TYPE_BF16, false, 10000},
                      StreamCase{{3, 17, 29}, v1::DATA_TYPE_FP32, false, 500},
                      StreamCase{{2, 5, 33, 20}, v1::DATA_TYPE_FP32, true, 1000},
                      StreamCase{{1, 2, 3, 400}, v1::DATA_TYPE_FP32, false, 16}));

TEST(MapStream, RawChunksAreSlicesOfTheKernelsBuffer) {
  std::mt19937_64 rng(1);
  std::string maps_bytes;
  WireResponse response = Response({1, 4, 64, 64}, v1::DATA_TYPE_FP32, false, rng, &maps_bytes);
  const char* buffer = response.maps_raw.data();
  MapStream stream(std::move(response), 64 * 64 * 4);
  ASSERT_EQ(stream.chunks(), 4);
  grpc::ByteBuffer first;
  ASSERT_TRUE(stream.Serialize(0, &first).ok());
  for (int64_t i = 1; i <= 4; ++i) {
    grpc::ByteBuffer message;
    ASSERT_TRUE(stream.Serialize(i, &message).ok());
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(message.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), buffer + (i - 1) * 64 * 64 * 4);
  }
}

TEST(MapStream, AResponseWithoutMapsIsOneMessage) {
  WireResponse response;
  response.message.set_model("default");
  MapStream stream(std::move(response), 1 << 20);
  EXPECT_EQ(stream.size(), 1);
  grpc::ByteBuffer buffer;
  ASSERT_TRUE(stream.Serialize(0, &buffer).ok());
  v1::AttendStreamResponse message;
  ASSERT_TRUE(message.ParseFromString(Flatten(buffer)));
  EXPECT_EQ(message.response().model(), "default");
  client::MapAssembler assembler;
  ASSERT_TRUE(assembler.Add(message).ok());
  EXPECT_TRUE(assembler.Finish().ok());
}

// A stream of the response with maps [1, 2, 2, 3] and the chunks given.
absl::Status Assemble(std::vector<v1::AttendStreamResponse> messages) {
  client::MapAssembler assembler;
  for (v1::AttendStreamResponse& message : messages) {
    if (absl::Status added = assembler.Add(message); !added.ok()) return added;
  }
  return assembler.Finish().status();
}

v1::AttendStreamResponse Header() {
  v1::AttendStreamResponse message;
  v1::Tensor* maps = message.mutable_response()->mutable_attention_maps();
  maps->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {1, 2, 2, 3}) maps->add_shape(d);
  return message;
}

v1::AttendStreamResponse Chunk(int head, int row, int rows) {
  v1::AttendStreamResponse message;
  v1::AttentionMapChunk* chunk = message.mutable_map_chunk();
  chunk->set_first_head(head);
  chunk->set_first_row(row);
  v1::Tensor* maps = chunk->mutable_maps();
  maps->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {1, 1, rows, 3}) maps->add_shape(d);
  maps->set_raw_data(std::string(static_cast<size_t>(rows) * 3 * 4, 'x'));
  return message;
}

TEST(MapAssembler, TakesAWellFormedStream) {
  EXPECT_TRUE(Assemble({Header(), Chunk(0, 0, 2), Chunk(1, 0, 1), Chunk(1, 1, 1)}).ok());
}

TEST(MapAssembler, RefusesStreamsThatBreakTheFormat) {
  const auto internal = [](const absl::Status& s) { return s.code() == absl::StatusCode::kInternal; };
  EXPECT_PRED1(internal, Assemble({Chunk(0, 0, 2)}));                          // no response first
  EXPECT_PRED1(internal, Assemble({Header(), Header()}));                      // two responses
  EXPECT_PRED1(internal, Assemble({Header(), Chunk(1, 0, 2), Chunk(0, 0, 2)}));  // out of order
  EXPECT_PRED1(internal, Assemble({Header(), Chunk(0, 0, 2), Chunk(2, 0, 1)}));  // outside
  EXPECT_PRED1(internal, Assemble({Header(), Chunk(0, 0, 2)}));                // values missing
  v1::AttendStreamResponse bf16 = Chunk(0, 0, 2);
  bf16.mutable_map_chunk()->mutable_maps()->set_dtype(v1::DATA_TYPE_BF16);
  EXPECT_PRED1(internal, Assemble({Header(), bf16}));  // another dtype
  v1::AttendStreamResponse short_chunk = Chunk(0, 0, 2);
  short_chunk.mutable_map_chunk()->mutable_maps()->mutable_raw_data()->resize(5);
  EXPECT_PRED1(internal, Assemble({Header(), short_chunk}));  // bytes do not match the shape
  v1::AttendStreamResponse huge = Header();
  huge.mutable_response()->mutable_attention_maps()->set_shape(2, int64_t{1} << 40);
  EXPECT_PRED1(internal, Assemble({huge}));  // a shape no buffer can hold
}

}  // namespace
}  // namespace attnserve::server
