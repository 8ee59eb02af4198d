// Which oneDNN implementation every primitive of a forward runs on, read from
// oneDNN's own verbose log: never a reference (`ref:`) implementation, which
// would be 10-500x slower (e.g. a mask post-op of the wrong shape falls back to
// ref:any). Matmuls run brg (dense operands) or gemm:jit (BF16 blocks read in
// place from the projections' rows), softmax jit. The cases have head_dim 8,
// so their blocked path runs its blocks on oneDNN; with head_dim 16 it runs
// them on the core's own kernels, and only the projections run in oneDNN.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/attention_layer.h"
#include "core/kernels/block_kernels.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::RandomStates;
using ::attnserve::testing::RandomWeights;

struct Case {
  std::string name;
  Precision precision = Precision::kFp32;
  AttentionPath path = AttentionPath::kAuto;
  int64_t num_heads = 8;  // d_model 64: head_dim 8
  int64_t num_kv_heads = 0;
  std::vector<int64_t> lengths = {40, 40};
  bool causal = false;
  bool mask = false;
  bool maps = false;
  bool cross = false;
};

// "primitive,implementation" -> executions, from oneDNN's verbose lines
// while `run` runs.
std::map<std::string, int> ExecutedImplementations(const std::function<void()>& run) {
  ::testing::internal::CaptureStdout();
  dnnl::set_verbose(1);
  run();
  dnnl::set_verbose(0);
  const std::string log = ::testing::internal::GetCapturedStdout();
  std::map<std::string, int> implementations;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    // onednn_verbose,exec,cpu,<primitive>,<implementation>,...
    const std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    if (fields.size() > 4 && fields[0] == "onednn_verbose" && fields[1] == "exec") {
      ++implementations[absl::StrCat(fields[3], ",", fields[4])];
    }
  }
  return implementations;
}

// The implementations of one forward of `c` (after a warm-up forward).
std::map<std::string, int> Implementations(const Case& c) {
  HeadConfig requested;
  requested.d_model = 64;
  requested.num_heads = c.num_heads;
  requested.num_kv_heads = c.num_kv_heads;
  const HeadConfig config = *ResolveHeadConfig(requested);
  std::mt19937_64 rng(7);
  auto layer = AttentionLayer::Create(config, RandomWeights(config, rng));
  EXPECT_THAT(layer, IsOk());
  if (!layer.ok()) return {};
  LayerInputs inputs;
  inputs.layout = *SequenceLayout::Packed(c.lengths);
  const std::vector<float> hidden = RandomStates(inputs.layout, config.d_model, rng);
  inputs.hidden_states = hidden;
  std::vector<float> context;
  if (c.cross) {
    inputs.context_layout = *SequenceLayout::Packed({23, 57});
    context = RandomStates(*inputs.context_layout, config.d_model, rng);
    inputs.context = context;
  }
  const SequenceLayout& keys = c.cross ? *inputs.context_layout : inputs.layout;
  inputs.causal = c.causal;
  std::vector<float> mask_values;
  if (c.mask) {
    inputs.mask.kind = ExplicitMask::Kind::kAdditive;
    inputs.mask.batch_dim = inputs.layout.batch();
    inputs.mask.q_dim = inputs.layout.max_length();
    inputs.mask.kv_dim = keys.max_length();
    mask_values.assign(
        static_cast<size_t>(inputs.mask.batch_dim * inputs.mask.q_dim * inputs.mask.kv_dim), 0.5f);
    inputs.mask.values = mask_values;
  }
  ForwardOptions options;
  options.precision = c.precision;
  options.attention_path = c.path;
  std::vector<float> output(hidden.size()), maps;
  ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  if (c.maps) {
    options.maps.mode = AttentionMapMode::kPerHead;
    maps.resize(static_cast<size_t>(inputs.layout.batch() * config.num_heads *
                                    inputs.layout.max_length() * keys.max_length()));
    outputs.attention_maps = absl::MakeSpan(maps);
  }
  EXPECT_THAT((*layer)->Forward(inputs, options, outputs), IsOk());
  return ExecutedImplementations(
      [&] { EXPECT_THAT((*layer)->Forward(inputs, options, outputs), IsOk()); });
}

// The check can see a reference implementation: a batched matmul with an
// additive 3-D mask broadcast over the batch as a binary post-op runs ref:any
// in oneDNN 2.6 (the pitfall the kernels' mask layouts avoid).
TEST(KernelImplementationControl, AReferenceImplementationShowsInTheLog) {
  using dnnl::memory;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc src({2, 4, 8}, memory::data_type::f32, memory::format_tag::abc);
  const memory::desc weights({2, 8, 4}, memory::data_type::f32, memory::format_tag::abc);
  const memory::desc dst({2, 4, 4}, memory::data_type::f32, memory::format_tag::abc);
  const memory::desc mask({1, 4, 4}, memory::data_type::f32, memory::format_tag::abc);
  dnnl::post_ops post_ops;
  post_ops.append_binary(dnnl::algorithm::binary_add, mask);
  dnnl::primitive_attr attr;
  attr.set_post_ops(post_ops);
  const dnnl::matmul matmul(
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), attr, engine));
  memory a(src, engine), b(weights, engine), c(dst, engine), m(mask, engine);
  const std::map<std::string, int> implementations = ExecutedImplementations([&] {
    matmul.execute(stream, {{DNNL_ARG_SRC, a},
                            {DNNL_ARG_WEIGHTS, b},
                            {DNNL_ARG_DST, c},
                            {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, m}});
    stream.wait();
  });
  EXPECT_EQ(implementations, (std::map<std::string, int>{{"matmul,ref:any", 1}}));
}

class KernelImplementation : public ::testing::TestWithParam<Case> {};

TEST_P(KernelImplementation, EveryPrimitiveRunsAJitImplementation) {
  const Case& c = GetParam();
  if (c.precision == Precision::kBf16) ATTNSERVE_SKIP_WITHOUT_BF16();
  const std::map<std::string, int> implementations = Implementations(c);
  ASSERT_FALSE(implementations.empty()) << "oneDNN logged no execution";
  std::ostringstream seen;
  for (const auto& [name, count] : implementations) seen << name << " x" << count << "; ";
  SCOPED_TRACE(seen.str());
  for (const auto& [name, count] : implementations) {
    EXPECT_THAT(name, ::testing::Not(::testing::HasSubstr("ref"))) << name;
    if (absl::StartsWith(name, "matmul,")) {
      EXPECT_THAT(name,
                  ::testing::AnyOf(::testing::HasSubstr("brg:"), ::testing::HasSubstr("gemm:jit")))
          << name;
    }
  }
}

// head_dim 16: the blocked path's blocks run on the core's own kernels, so a
// forward executes exactly the projections in oneDNN -- the fused Q/K/V (or,
// in cross-attention, the query and the key/value matmul) and the output --
// and nothing per block.
TEST(KernelImplementation, OwnBlockKernelsLeaveOnlyTheProjectionsToOneDnn) {
  ATTNSERVE_SKIP_UNLESS_AVAILABLE(internal::OwnBlockKernelsAvailable(false, 16),
                                  ::attnserve::testing::CpuInfoHasAvx512(),
                                  "the own block kernels (AVX-512)");
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    // BF16 where the CPU runs it natively and the own BF16 kernels run.
    if (precision == Precision::kBf16 &&
        (!::attnserve::testing::Bf16CasesRun() || !internal::OwnBlockKernelsAvailable(true, 16))) {
      continue;
    }
    for (const bool cross : {false, true}) {
      Case c;
      c.precision = precision;
      c.num_heads = 4;
      c.num_kv_heads = 2;
      c.lengths = {40, 17};
      c.causal = true;
      c.mask = true;
      c.cross = cross;
      SCOPED_TRACE(absl::StrCat(PrecisionName(precision), cross ? " cross" : " self"));
      int matmuls = 0;
      for (const auto& [name, count] : Implementations(c)) {
        // (Cross-attention's query and key/value weights are column blocks
        // of wider matrices: gemm:jit.)
        EXPECT_TRUE(absl::StartsWith(name, "matmul,brg:") ||
                    absl::StartsWith(name, "matmul,gemm:jit"))
            << name << " x" << count;
        matmuls += count;
      }
      EXPECT_EQ(matmuls, cross ? 3 : 2);
    }
  }
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    const std::string p = precision == Precision::kBf16 ? "Bf16" : "Fp32";
    auto add = [&](std::string name, auto&& edit) {
      Case c;
      c.name = p + name;
      c.precision = precision;
      edit(c);
      cases.push_back(c);
    };
    add("BlockedUniform", [](Case&) {});
    add("BlockedRaggedCausal", [](Case& c) { c.lengths = {40, 17}, c.causal = true; });
    add("BlockedGqaMask", [](Case& c) { c.num_kv_heads = 2, c.mask = true; });
    add("BlockedCross", [](Case& c) { c.cross = true; });
    add("MaterializedRaggedCausalMask", [](Case& c) {
      c.path = AttentionPath::kMaterialized, c.lengths = {40, 17}, c.causal = true, c.mask = true;
    });
    add("MaterializedGqaCausal", [](Case& c) {
      c.path = AttentionPath::kMaterialized, c.num_kv_heads = 2, c.causal = true;
    });
    add("MapsCross", [](Case& c) { c.maps = true, c.cross = true; });
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Paths, KernelImplementation, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attnserve::core
