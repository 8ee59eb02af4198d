#ifndef ATTNSERVE_TESTS_CORE_SPARSE_CHECKPOINT_H_
#define ATTNSERVE_TESTS_CORE_SPARSE_CHECKPOINT_H_

// Well-formed safetensors files of any declared size: the header declares the
// tensors and the file is extended to the length the header needs without
// writing the data (a sparse file: the file system stores no blocks for it),
// so a checkpoint declaring hundreds of GiB costs nothing on disk and passes
// every check that compares the header with the file's size.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/core/checkpoint_writer.h"
#include "tests/core/safetensors_writer.h"

namespace attnserve::testing {

struct DeclaredTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16" or "F16"
  std::vector<int64_t> shape;
};

// Writes `tensors`' header at `path` and extends the file to the end of their
// data section. Returns the data section's size in bytes.
inline int64_t WriteSparseCheckpoint(const std::string& path,
                                     const std::vector<DeclaredTensor>& tensors) {
  std::vector<std::string> entries;
  int64_t offset = 0;
  for (const DeclaredTensor& t : tensors) {
    int64_t bytes = t.dtype == "F32" ? 4 : 2;
    for (int64_t d : t.shape) bytes *= d;
    entries.push_back(absl::StrCat("\"", t.name, "\":{\"dtype\":\"", t.dtype, "\",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset,
                                   ",", offset + bytes, "]}"));
    offset += bytes;
  }
  const std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  SafetensorsWriter::WriteFile(path, SafetensorsWriter::Assemble(header, ""));
  std::filesystem::resize_file(path, 8 + header.size() + static_cast<uint64_t>(offset));
  return offset;
}

// A Llama attention layer of a plausible configuration (d_model 65536, 96
// query heads and 8 key/value heads of head_dim 4096) whose q_proj.weight
// alone declares 96 GiB as FP32.
inline LayoutCase HugeLlamaLayer() {
  LayoutCase c{"llama", {}, "model.layers.0.self_attn.", "F32"};
  c.head.d_model = 65536;
  c.head.num_heads = 96;
  c.head.num_kv_heads = 8;
  c.head.head_dim = 4096;
  return c;
}

// HugeLlamaLayer()'s config.json (ConfigJson has no head_dim).
inline std::string HugeLlamaConfigJson() {
  return "{\"layout\":\"llama\",\"prefix\":\"model.layers.0.self_attn.\",\"d_model\":65536,"
         "\"num_heads\":96,\"num_kv_heads\":8,\"head_dim\":4096}";
}

// HugeLlamaLayer()'s four weights (no biases: Llama has none), in `dtype`.
inline std::vector<DeclaredTensor> HugeLlamaTensors(const std::string& dtype) {
  const LayoutCase c = HugeLlamaLayer();
  const int64_t d = c.head.d_model;
  const int64_t q = c.head.num_heads * c.head.head_dim;
  const int64_t kv = c.head.num_kv_heads * c.head.head_dim;
  return {{c.prefix + "q_proj.weight", dtype, {q, d}},
          {c.prefix + "k_proj.weight", dtype, {kv, d}},
          {c.prefix + "v_proj.weight", dtype, {kv, d}},
          {c.prefix + "o_proj.weight", dtype, {d, q}}};
}

// The bytes HugeLlamaLayer()'s weights take as FP32, counted by hand from the
// shapes: q_proj and o_proj [393216, 65536] (96 GiB each), k_proj and v_proj
// [32768, 65536] (8 GiB each), and the zero biases the layer gets (393216 +
// 2 x 32768 + 65536 floats).
inline constexpr int64_t kHugeLlamaWeightBytes =
    (int64_t{96} << 30) * 2 + (int64_t{8} << 30) * 2 + (393216 + 2 * 32768 + 65536) * 4;

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_SPARSE_CHECKPOINT_H_
