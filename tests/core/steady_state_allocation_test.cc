// Steady state of AttentionLayer::Forward: after warm-up a repeated request
// creates no primitives and allocates a fixed number of small objects per
// call, the same at every sequence length: the core's own (copies of the
// lengths, primitive-cache keys) and oneDNN's per-execute bookkeeping inside
// libdnnl (counted apart through the caller's address, see
// allocation_counter.h) for the projections and, on the materialized path, a
// handful of attention matmuls. The blocked path's block products run on the
// core's own kernels (head_dim 16 here); only when they run on oneDNN
// (ATTNSERVE_BLOCK_KERNELS=onednn, or a CPU without AVX-512) do oneDNN's
// allocations grow with the number of blocks.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/kernels/block_kernels.h"
#include "core/head_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/benchmarks/allocation_counter.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::AllocationCount;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kBf16Tolerance;
using ::attnserve::testing::kFp32Tolerance;
using ::attnserve::testing::OneDnnAllocationCount;
using ::attnserve::testing::RandomStates;
using ::attnserve::testing::RandomWeights;
using ::attnserve::testing::ReferenceLayer;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::SetAllocationAttribution;

struct Counts {
  int64_t total = 0;
  int64_t onednn = 0;
  int64_t ours() const { return total - onednn; }
};

// Allocations of one forward of B=2 sequences of `seq_len` on `path` in
// `precision`, in a workspace kept across calls (as a server's compute worker
// keeps its own), after two warm-up forwards of the same request; the output
// is checked against the reference so that the counted call is a real one.
Counts CountForward(AttentionPath path, int64_t seq_len, bool causal,
                    Precision precision = Precision::kFp32, int64_t block_queries = 16,
                    BlockKernels block_kernels = BlockKernels::kAuto) {
  HeadConfig requested;
  requested.d_model = 64;
  requested.num_heads = 4;
  const absl::StatusOr<HeadConfig> config = ResolveHeadConfig(requested);
  EXPECT_THAT(config, IsOk());
  std::mt19937_64 rng(static_cast<uint64_t>(seq_len));
  const AttentionWeights weights = RandomWeights(*config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer = AttentionLayer::Create(*config, weights);
  EXPECT_THAT(layer, IsOk());
  if (!layer.ok()) return {};
  LayerInputs inputs;
  inputs.layout = *SequenceLayout::Padded(2, seq_len);
  const std::vector<float> hidden = RandomStates(inputs.layout, config->d_model, rng);
  inputs.hidden_states = hidden;
  inputs.causal = causal;
  ForwardOptions options;
  options.attention_path = path;
  options.precision = precision;
  options.block_queries = block_queries;  // several blocks at every length
  options.block_keys = 16;
  options.block_kernels = block_kernels;
  absl::StatusOr<std::unique_ptr<Workspace>> workspace = Workspace::Create();
  EXPECT_THAT(workspace, IsOk());
  if (!workspace.ok()) return {};
  std::vector<float> output(hidden.size());
  ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  for (int i = 0; i < 2; ++i) {
    EXPECT_THAT((*layer)->Forward(inputs, options, outputs, workspace->get()), IsOk());
  }
  Counts counts;
  SetAllocationAttribution(true);
  const int64_t total_before = AllocationCount();
  const int64_t onednn_before = OneDnnAllocationCount();
  const absl::StatusOr<ForwardInfo> info =
      (*layer)->Forward(inputs, options, outputs, workspace->get());
  counts.total = AllocationCount() - total_before;
  counts.onednn = OneDnnAllocationCount() - onednn_before;
  SetAllocationAttribution(false);
  EXPECT_THAT(info, IsOk());
  EXPECT_LE(RelativeFrobeniusError(output, ReferenceLayer(*config, weights, inputs).output),
            precision == Precision::kBf16 ? kBf16Tolerance : kFp32Tolerance);
  return counts;
}

bool OwnBlockKernels(Precision precision) {
  return internal::OwnBlockKernelsAvailable(precision == Precision::kBf16, 16);
}

void Print(const std::string& what, const Counts& short_run, const Counts& long_run) {
  std::cout << what << ": allocations per forward S=32 " << short_run.total << " (core "
            << short_run.ours() << "), S=256 " << long_run.total << " (core " << long_run.ours()
            << ")\n";
}

TEST(SteadyState, AllocationsPerForwardDoNotGrowWithSequenceLength) {
  for (const AttentionPath path : {AttentionPath::kBlocked, AttentionPath::kMaterialized}) {
    for (const bool causal : {false, true}) {
      const std::string what = absl::StrCat(
          path == AttentionPath::kBlocked ? "blocked" : "materialized", causal ? " causal" : "");
      SCOPED_TRACE(what);
      const Counts short_run = CountForward(path, 32, causal);
      const Counts long_run = CountForward(path, 256, causal);
      // The core's own objects: the same count at 8x the length, and few.
      EXPECT_EQ(short_run.ours(), long_run.ours());
      EXPECT_LE(long_run.ours(), 128);
      // oneDNN's: a handful of primitive executions, whatever the length.
      if (path == AttentionPath::kMaterialized || OwnBlockKernels(Precision::kFp32)) {
        EXPECT_EQ(short_run.total, long_run.total);
      }
      Print(what, short_run, long_run);
    }
  }
}

// BF16 on the blocked path with query blocks of 128: both lengths read Q/K/V
// in place from the BF16 projections, in key blocks of 16.
TEST(SteadyState, Bf16AllocationsPerForwardDoNotGrowWithSequenceLength) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    const Counts short_run = CountForward(AttentionPath::kBlocked, 32, causal, Precision::kBf16,
                                          /*block_queries=*/128);
    const Counts long_run = CountForward(AttentionPath::kBlocked, 256, causal, Precision::kBf16,
                                         /*block_queries=*/128);
    EXPECT_EQ(short_run.ours(), long_run.ours());
    EXPECT_LE(long_run.ours(), 128);
    if (OwnBlockKernels(Precision::kBf16)) {
      EXPECT_EQ(short_run.total, long_run.total);
    }
    Print(absl::StrCat("blocked BF16", causal ? " causal" : ""), short_run, long_run);
  }
}

// The blocked path on oneDNN's block matmuls: the core's own allocations stay
// fixed; oneDNN's grow with the blocks (each execute builds its argument map
// and execution context on the heap), which the own kernels avoid.
TEST(SteadyState, BlocksOnOneDnnGrowOnlyOneDnnsAllocations) {
  const Counts short_run = CountForward(AttentionPath::kBlocked, 32, false, Precision::kFp32, 16,
                                        BlockKernels::kOneDnn);
  const Counts long_run = CountForward(AttentionPath::kBlocked, 256, false, Precision::kFp32, 16,
                                       BlockKernels::kOneDnn);
  EXPECT_EQ(short_run.ours(), long_run.ours());
  EXPECT_GT(long_run.onednn, short_run.onednn);
  Print("blocked on oneDNN's block matmuls", short_run, long_run);
}

}  // namespace
}  // namespace attnserve::core
