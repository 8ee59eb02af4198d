#include "server/api/map_stream.h"

#include <grpcpp/support/proto_buffer_writer.h>

#include <algorithm>
#include <string>
#include <utility>

namespace attnserve::server {
namespace {

void DeleteString(void* string) { delete static_cast<std::string*>(string); }

// A slice that owns `bytes` (moved from).
grpc::Slice TakeStringAsSlice(std::string& bytes) {
  auto* owned = new std::string(std::move(bytes));
  return grpc::Slice(owned->data(), owned->size(), &DeleteString, owned);
}

}  // namespace

std::vector<MapChunkPlan> PlanMapChunks(absl::Span<const int64_t> map_shape,
                                        int64_t max_chunk_values) {
  std::vector<MapChunkPlan> chunks;
  if (map_shape.size() != 3 && map_shape.size() != 4) return chunks;
  const bool per_head = map_shape.size() == 4;
  const int64_t batch = map_shape[0];
  const int64_t heads = per_head ? map_shape[1] : 1;
  const int64_t rows = map_shape[map_shape.size() - 2];
  const int64_t keys = map_shape.back();
  if (batch <= 0 || heads <= 0 || rows <= 0 || keys <= 0) return chunks;
  const int64_t rows_per_chunk = std::max<int64_t>(1, max_chunk_values / keys);
  const int64_t head_values = rows * keys;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads;) {
      const int64_t head_start = (b * heads + h) * head_values;
      if (rows_per_chunk >= rows) {  // whole heads
        const int64_t n = std::min(heads - h, rows_per_chunk / rows);
        chunks.push_back({.sequence = b, .first_head = h, .first_row = 0, .heads = n,
                          .rows = rows, .first_value = head_start, .values = n * head_values});
        h += n;
        continue;
      }
      for (int64_t r = 0; r < rows; r += rows_per_chunk) {  // rows of one head
        const int64_t n = std::min(rows - r, rows_per_chunk);
        chunks.push_back({.sequence = b, .first_head = h, .first_row = r, .heads = 1, .rows = n,
                          .first_value = head_start + r * keys, .values = n * keys});
      }
      ++h;
    }
  }
  return chunks;
}

MapStream::MapStream(WireResponse response, int64_t max_chunk_bytes)
    : response_(std::move(response)) {
  if (!response_.message.has_attention_maps()) return;
  v1::Tensor* maps = response_.message.mutable_attention_maps();
  value_bytes_ = std::max<int64_t>(1, DataTypeSize(maps->dtype()));
  if (!response_.maps_raw.empty()) {
    raw_maps_ = TakeAsSlice(response_.maps_raw);
  } else if (!maps->raw_data().empty()) {
    raw_maps_ = TakeStringAsSlice(*maps->mutable_raw_data());
    maps->clear_raw_data();
  } else {
    float_maps_.Swap(maps->mutable_float_data());
  }
  map_header_ = *maps;  // dtype and shape: the values are out
  chunks_ = PlanMapChunks(map_header_.shape(), max_chunk_bytes / value_bytes_);
}

absl::Status MapStream::Serialize(int64_t index, grpc::ByteBuffer* out) {
  if (index > 0) return SerializeChunk(chunks_[static_cast<size_t>(index - 1)], out);
  absl::StatusOr<std::vector<grpc::Slice>> response = response_.TakeWireSlices();
  if (!response.ok()) return response.status();
  size_t size = 0;
  for (const grpc::Slice& slice : *response) size += slice.size();
  std::vector<grpc::Slice> slices;
  slices.reserve(response->size() + 1);
  slices.emplace_back(
      LengthDelimitedFieldStart(v1::AttendStreamResponse::kResponseFieldNumber, size));
  for (grpc::Slice& slice : *response) slices.push_back(std::move(slice));
  grpc::ByteBuffer bytes(slices.data(), slices.size());
  out->Swap(&bytes);
  return absl::OkStatus();
}

absl::Status MapStream::SerializeChunk(const MapChunkPlan& chunk, grpc::ByteBuffer* out) const {
  v1::AttendStreamResponse message;
  v1::AttentionMapChunk* fields = message.mutable_map_chunk();
  fields->set_sequence(chunk.sequence);
  fields->set_first_head(static_cast<int32_t>(chunk.first_head));
  fields->set_first_row(static_cast<int32_t>(chunk.first_row));
  v1::Tensor* tensor = fields->mutable_maps();
  tensor->set_dtype(map_header_.dtype());
  tensor->add_shape(1);
  if (map_header_.shape_size() == 4) tensor->add_shape(chunk.heads);
  tensor->add_shape(chunk.rows);
  tensor->add_shape(map_header_.shape(map_header_.shape_size() - 1));
  if (raw_maps_.size() == 0) {  // float_data: copied, as small requests use it
    tensor->mutable_float_data()->Add(float_maps_.begin() + chunk.first_value,
                                      float_maps_.begin() + chunk.first_value + chunk.values);
    std::string bytes;
    if (!message.SerializeToString(&bytes)) {
      return absl::InternalError("response: cannot serialize a map chunk");
    }
    grpc::Slice slice = TakeStringAsSlice(bytes);
    grpc::ByteBuffer buffer(&slice, 1);
    out->Swap(&buffer);
    return absl::OkStatus();
  }
  // Raw: the chunk's fields, then the tensor whole with its bytes a slice of
  // the maps' buffer.
  const v1::Tensor header = *tensor;
  fields->clear_maps();
  const size_t raw_size = static_cast<size_t>(chunk.values * value_bytes_);
  std::string body = fields->SerializeAsString();
  body += RawTensorFieldStart(v1::AttentionMapChunk::kMapsFieldNumber, header, raw_size);
  std::string start = LengthDelimitedFieldStart(v1::AttendStreamResponse::kMapChunkFieldNumber,
                                                body.size() + raw_size) +
                      body;
  const size_t begin = static_cast<size_t>(chunk.first_value * value_bytes_);
  grpc::Slice slices[2] = {grpc::Slice(start), raw_maps_.sub(begin, begin + raw_size)};
  grpc::ByteBuffer buffer(slices, 2);
  out->Swap(&buffer);
  return absl::OkStatus();
}

}  // namespace attnserve::server
