// A checkpoint's weight budget: the bytes are counted from the header as
// FP32 (what loading allocates, whatever the stored dtype), the budget is
// exact, and it is checked before any tensor is read, so a well-formed header
// declaring a 96 GiB tensor is refused at once without growing the process.
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"
#include "core/checkpoint_layouts.h"
#include "core/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/checkpoint_writer.h"
#include "tests/core/sparse_checkpoint.h"
#include "tests/core/status_matchers.h"
#include "tests/temp_path.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::ConfigJson;
using ::attnserve::testing::HugeLlamaConfigJson;
using ::attnserve::testing::HugeLlamaTensors;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kHugeLlamaWeightBytes;
using ::attnserve::testing::LayoutCase;
using ::attnserve::testing::StatusIs;
using ::attnserve::testing::WriteLayout;
using ::attnserve::testing::WriteSparseCheckpoint;
using ::testing::HasSubstr;

using ::attnserve::testing::TempPath;

// Bytes this process has read from files so far (rchar of /proc/self/io:
// every read and pread), or -1 where the kernel does not account them.
int64_t BytesReadSoFar() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

// The process' peak resident memory so far.
int64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return int64_t{usage.ru_maxrss} * 1024;
}

HeadConfig Head(int64_t d_model, int64_t num_heads, int64_t num_kv_heads) {
  HeadConfig h;
  h.d_model = d_model;
  h.num_heads = num_heads;
  h.num_kv_heads = num_kv_heads;
  return h;
}

int64_t Fp32Bytes(const AttentionWeights& w) {
  int64_t floats = 0;
  for (const auto* v : {&w.w_q, &w.b_q, &w.w_k, &w.b_k, &w.w_v, &w.b_v, &w.w_o, &w.b_o}) {
    floats += static_cast<int64_t>(v->size());
  }
  return floats * 4;
}

TEST(CheckpointBudget, WeightBytesAreTheFp32SizeOfWhatEachLayoutLoads) {
  // Half-precision files take half the bytes on disk, the same as FP32; a
  // Llama layer without biases gets zeros, which count.
  const std::vector<LayoutCase> cases = {
      {"torch_mha", Head(16, 4, 4), "attn.", "F32"},
      {"torch_mha", Head(24, 2, 2), "", "BF16"},
      {"bert", Head(24, 3, 3), "encoder.layer.1.attention.", "F16"},
      {"gpt2", Head(16, 2, 2), "h.0.attn.", "BF16"},
      {"llama", Head(32, 8, 2), "model.layers.0.self_attn.", "BF16"},
  };
  for (const LayoutCase& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.layout, " ", c.dtype));
    absl::StatusOr<CheckpointConfig> config = ParseCheckpointConfig(ConfigJson(c), "config.json");
    ASSERT_THAT(config, IsOk());
    const std::string path = TempPath("layouts.safetensors");
    WriteLayout(c, config->head_config, SeededWeights(config->head_config, 3)).Write(path);
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_THAT(file, IsOk());
    absl::StatusOr<int64_t> bytes = CheckpointWeightBytes(*file, *config);
    ASSERT_THAT(bytes, IsOk());
    absl::StatusOr<AttentionWeights> loaded = LoadCheckpointWeights(*file, *config);
    ASSERT_THAT(loaded, IsOk());
    EXPECT_EQ(*bytes, Fp32Bytes(*loaded));
    ::unlink(path.c_str());
  }
}

TEST(CheckpointBudget, TheBudgetIsExactAndCheckedBeforeAnyTensorIsRead) {
  // A BF16 BERT layer: 4 x [256, 256] weights and 4 x [256] biases, 0.5 MiB
  // on disk and 1 MiB as FP32.
  LayoutCase c{"bert", Head(256, 4, 4), "encoder.layer.0.attention.", "BF16"};
  absl::StatusOr<CheckpointConfig> config = ParseCheckpointConfig(ConfigJson(c), "m/config.json");
  ASSERT_THAT(config, IsOk());
  const std::string path = TempPath("exact.safetensors");
  WriteLayout(c, config->head_config, SeededWeights(config->head_config, 5)).Write(path);
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  const int64_t needed = (4 * 256 * 256 + 4 * 256) * 4;
  absl::StatusOr<int64_t> counted = CheckpointWeightBytes(*file, *config);
  ASSERT_THAT(counted, IsOk());
  EXPECT_EQ(*counted, needed);

  // The rule alone (what a folder of layers checks for every layer first).
  absl::StatusOr<int64_t> fits = CheckCheckpointBudget(*file, *config, {.max_weight_bytes = needed});
  ASSERT_THAT(fits, IsOk());
  EXPECT_EQ(*fits, needed);
  EXPECT_THAT(CheckCheckpointBudget(*file, *config,
                                    {.max_weight_bytes = needed - 1, .budget_name = "--b"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       absl::StrCat("take ", needed, " bytes as FP32")));

  const int64_t read_before = BytesReadSoFar();
  absl::StatusOr<AttentionWeights> refused = LoadCheckpointWeights(
      *file, *config, {.max_weight_bytes = needed - 1, .budget_name = "--max_model_bytes"});
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument, "over --max_model_bytes"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("take ", needed, " bytes as FP32")));
  EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("(", needed - 1, " bytes")));
  const int64_t read_refused = BytesReadSoFar();
  if (read_before >= 0) {
    EXPECT_LT(read_refused - read_before, 4096) << "tensors were read before the budget refused them";
  }

  // At exactly the budget it loads, and reads the tensors (the check above
  // can fail: a load does show up in the count).
  absl::StatusOr<AttentionWeights> loaded = LoadCheckpointWeights(
      *file, *config, {.max_weight_bytes = needed, .budget_name = "--max_model_bytes"});
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(Fp32Bytes(*loaded), needed);
  if (read_before >= 0) {
    EXPECT_GE(BytesReadSoFar() - read_refused, needed / 2);
  }
  ::unlink(path.c_str());
}

TEST(CheckpointBudget, AHeaderDeclaringA96GiBTensorIsRefusedAtOnce) {
  absl::StatusOr<CheckpointConfig> config =
      ParseCheckpointConfig(HugeLlamaConfigJson(), "huge/config.json");
  ASSERT_THAT(config, IsOk());
  for (const std::string dtype : {"F32", "BF16"}) {
    SCOPED_TRACE(dtype);
    const std::string path = TempPath("huge.safetensors");
    // 208 GiB of F32 (104 GiB of BF16) declared, none of it on disk.
    WriteSparseCheckpoint(path, HugeLlamaTensors(dtype));
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
    ASSERT_THAT(file, IsOk());
    absl::StatusOr<int64_t> counted = CheckpointWeightBytes(*file, *config);
    ASSERT_THAT(counted, IsOk());
    EXPECT_EQ(*counted, kHugeLlamaWeightBytes);

    const int64_t rss_before = PeakRssBytes();
    const int64_t read_before = BytesReadSoFar();
    const int64_t budget = int64_t{4} << 30;
    absl::StatusOr<AttentionWeights> refused = LoadCheckpointWeights(
        *file, *config, {.max_weight_bytes = budget, .budget_name = "--max_model_bytes"});
    EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument, "huge.safetensors"));
    EXPECT_THAT(refused.status().message(),
                HasSubstr(absl::StrCat("take ", kHugeLlamaWeightBytes, " bytes as FP32 (208.002 GiB")));
    EXPECT_THAT(refused.status().message(),
                HasSubstr(absl::StrCat("over --max_model_bytes (", budget, " bytes, 4 GiB)")));
    // Nothing was allocated or read for it.
    EXPECT_LT(PeakRssBytes() - rss_before, int64_t{64} << 20);
    if (read_before >= 0) {
      EXPECT_LT(BytesReadSoFar() - read_before, 4096);
    }
    ::unlink(path.c_str());
  }
}

}  // namespace
}  // namespace attnserve::core
