// Every route that can serve a request gives the same answer. Random
// configurations -- batches of 1 to 3 ragged sequences, GQA, head_dim 8, 16,
// 24 or 64, causal or not, self- or cross-attention, explicit masks (allowed,
// or additive with huge finite values and -inf; rows with every key
// forbidden), head masks -- run through AttentionLayer and AttentionCore, on
// the materialized path and the blocked one, the blocked path's blocks on the
// own kernels and on oneDNN's, in FP32 and (where the CPU runs it) BF16. Each
// route must match the double-precision reference within the suite's
// tolerance (RelativeFrobeniusError, as attention_layer_test), so the routes
// of a case match each other within twice that.
//
// The semantics held: a forbidden key (allowed-mask 0, additive -inf, causal,
// padding) gets no weight and a row with every key forbidden gets weight 0;
// finite additive values of any size are added to the scores and the row is
// the softmax of the sums, so a row whose keys all carry the same huge value
// gets equal weights (on the BF16 blocked path such rows once gave 0).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "core/attention_core.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/kernels/block_kernels.h"
#include "core/head_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::CpuInfoHasAvx512;
using ::attnserve::testing::CpuInfoHasAvx512Bf16;
using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kBf16Tolerance;
using ::attnserve::testing::kFp32Tolerance;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::RandomStates;
using ::attnserve::testing::RandomWeights;
using ::attnserve::testing::ReferenceCore;
using ::attnserve::testing::ReferenceLayer;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::SeedTrace;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// Random configurations per test: enough to meet every kind of row in every
// route many times over, few enough for a few seconds.
constexpr int kCases = 48;

// The seed every test of this process draws its cases from (printed by each).
uint64_t Seed() {
  static const uint64_t seed = FreshSeed();
  return seed;
}

// ---------------------------------------------------------------------------
// Routes.

enum class Api { kLayer, kCore };

struct Route {
  Api api = Api::kLayer;
  AttentionPath path = AttentionPath::kMaterialized;
  // Blocked path only: oneDNN's block matmuls (kOneDnn), or the core's choice
  // (its own kernels, which the test asks for only where they run).
  BlockKernels block_kernels = BlockKernels::kAuto;
  Precision precision = Precision::kFp32;

  std::string Name() const {
    return absl::StrCat(api == Api::kLayer ? "layer" : "core", "/", PrecisionName(precision), "/",
                        path == AttentionPath::kMaterialized     ? "materialized"
                        : block_kernels == BlockKernels::kOneDnn ? "blocked on oneDNN blocks"
                                                                 : "blocked on own block kernels");
  }
};

// Whether the own block kernels serve this precision and head_dim here; adds
// a failure where they do not although /proc/cpuinfo shows what they need
// (the rule of ATTNSERVE_SKIP_UNLESS_AVAILABLE, for one case of many), and
// says why they do not in `why`.
bool OwnBlockKernelsRun(Precision precision, int64_t head_dim, std::string& why) {
  const bool bf16 = precision == Precision::kBf16;
  if (internal::OwnBlockKernelsAvailable(bf16, head_dim)) return true;
  if (head_dim % 16 != 0) {
    why = absl::StrCat("head_dim ", head_dim, " is not a multiple of 16");
    return false;
  }
  const bool machine_has = bf16 ? CpuInfoHasAvx512Bf16() : CpuInfoHasAvx512();
  EXPECT_FALSE(machine_has) << "the own block kernels are unavailable for head_dim " << head_dim
                            << " although this machine has what they need (/proc/cpuinfo)";
  why = bf16 ? "this CPU lacks AVX512-BF16" : "this CPU lacks AVX-512 F/BW/DQ/VL";
  return false;
}

// The routes of `precision` a case with this head_dim can take here; the
// others go to `skipped` with the reason.
std::vector<Route> RoutesFor(Precision precision, int64_t head_dim,
                             std::vector<std::string>& skipped) {
  std::string why;
  const bool own = OwnBlockKernelsRun(precision, head_dim, why);
  std::vector<Route> routes;
  for (const Api api : {Api::kLayer, Api::kCore}) {
    routes.push_back({api, AttentionPath::kMaterialized, BlockKernels::kAuto, precision});
    routes.push_back({api, AttentionPath::kBlocked, BlockKernels::kOneDnn, precision});
    const Route own_route{api, AttentionPath::kBlocked, BlockKernels::kAuto, precision};
    if (own) {
      routes.push_back(own_route);
    } else {
      skipped.push_back(absl::StrCat(own_route.Name(), " (", why, ")"));
    }
  }
  return routes;
}

// ---------------------------------------------------------------------------
// Cases.

// Huge finite mask values. A row whose visible keys all carry the same one
// gets equal weights: in FP32, where the routes mask the scores, s + M is M
// for |s| below half an ulp of M (512 at 1e10). In double, where the
// reference does, s + M keeps s unless |M| is beyond about 1e18; so where the
// routes get -1e10 on a whole row the reference gets -1e30 (which absorbs the
// scores in double too): the same weights.
constexpr float kEqualRowValues[] = {-1e10f, -1e20f, -3e38f, -1e30f, 1e30f};
constexpr float kReferenceEqualRowValue = -1e30f;
// Huge negative values among ordinary ones: exp(-huge) is 0 in either precision.
constexpr float kHugeNegativeValues[] = {-1e4f, -1e10f, -1e30f, -3e38f};
// One key of a row may carry a huge positive value: it then takes all the
// weight (two such keys would differ by scores that FP32 rounds at 1e4).
constexpr float kHugePositiveValues[] = {1e4f, 1e30f};

struct Case {
  std::string description;
  HeadConfig config;
  AttentionWeights weights;
  // The layer's inputs: queries (and, cross-attention, the context) as
  // token-major states with NaN in padding rows.
  std::vector<float> hidden, context;
  SequenceLayout layout;
  std::optional<SequenceLayout> context_layout;
  std::vector<int64_t> position_offsets;
  // The core's inputs: heads [batch, heads, len, head_dim], NaN past the
  // lengths; the same S, T and lengths as the layer's.
  std::vector<float> q, k, v;
  int64_t batch = 0, s = 0, t = 0;
  std::vector<int64_t> q_lengths, kv_lengths;
  bool causal = false;
  ExplicitMask::Kind mask_kind = ExplicitMask::Kind::kNone;
  int64_t mask_batch_dim = 1, mask_q_dim = 1, mask_kv_dim = 1;
  std::vector<float> mask_values;            // what the routes get
  std::vector<float> reference_mask_values;  // what the reference gets (see kEqualRowValues)
  std::vector<float> head_mask;
  int64_t block_queries = 0, block_keys = 0;

  ExplicitMask Mask(bool for_reference) const {
    ExplicitMask mask;
    mask.kind = mask_kind;
    if (mask_kind == ExplicitMask::Kind::kNone) return mask;
    mask.values = for_reference ? reference_mask_values : mask_values;
    mask.batch_dim = mask_batch_dim;
    mask.q_dim = mask_q_dim;
    mask.kv_dim = mask_kv_dim;
    return mask;
  }

  LayerInputs Layer(bool for_reference = false) const {
    LayerInputs in;
    in.hidden_states = hidden;
    in.layout = layout;
    in.context = context;
    in.context_layout = context_layout;
    in.causal = causal;
    in.mask = Mask(for_reference);
    in.head_mask = head_mask;
    in.position_offsets = position_offsets;
    return in;
  }

  CoreInputs Core(bool for_reference = false) const {
    CoreInputs in;
    in.q = q;
    in.k = k;
    in.v = v;
    in.batch = batch;
    in.q_len = s;
    in.kv_len = t;
    in.q_lengths = q_lengths;
    in.kv_lengths = kv_lengths;
    in.causal = causal;
    in.mask = Mask(for_reference);
    in.head_mask = head_mask;
    return in;
  }
};

template <typename T, size_t N>
T Pick(const T (&values)[N], std::mt19937_64& rng) {
  return values[std::uniform_int_distribution<size_t>(0, N - 1)(rng)];
}

std::vector<int64_t> RandomLengths(int64_t batch, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> length(1, 13);
  std::vector<int64_t> lengths(static_cast<size_t>(batch));
  for (int64_t& n : lengths) n = length(rng);
  return lengths;
}

// A padded layout (sometimes longer than the longest sequence) or a packed one.
SequenceLayout RandomLayout(const std::vector<int64_t>& lengths, std::mt19937_64& rng) {
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  absl::StatusOr<SequenceLayout> layout =
      std::bernoulli_distribution(0.5)(rng)
          ? SequenceLayout::Packed(lengths)
          : SequenceLayout::Padded(static_cast<int64_t>(lengths.size()),
                                   longest + std::uniform_int_distribution<int64_t>(0, 2)(rng),
                                   lengths);
  EXPECT_THAT(layout, IsOk());
  return layout.value_or(SequenceLayout());
}

// Dense heads [batch, heads, len, hd]: N(0, 1) within `lengths`, NaN past them.
std::vector<float> RandomHeads(int64_t batch, int64_t heads, int64_t len, int64_t hd,
                               const std::vector<int64_t>& lengths, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> values(static_cast<size_t>(batch * heads * len * hd), kNaN);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < lengths[b] * hd; ++i) {
        values[(b * heads + h) * len * hd + i] = static_cast<float>(normal(rng));
      }
    }
  }
  return values;
}

// One mask row (kv_dim values) of `kind` and its reference counterpart, of a
// kind drawn at random: ordinary (key 0 ordinary, so that every query sees
// one; the others ordinary, forbidden, huge negative, or at most one huge
// positive), every key forbidden, or (additive) every key the same huge value.
// Returns the kind of row drawn, for the case's description.
std::string AddMaskRow(ExplicitMask::Kind kind, int64_t kv_dim, std::mt19937_64& rng,
                       std::vector<float>& values, std::vector<float>& reference_values) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double u = uniform(rng);
  const bool allowed = kind == ExplicitMask::Kind::kAllowed;
  if (u < 0.15) {  // every key forbidden
    values.insert(values.end(), static_cast<size_t>(kv_dim), allowed ? 0.0f : -kInf);
    reference_values.insert(reference_values.end(), static_cast<size_t>(kv_dim),
                            allowed ? 0.0f : -kInf);
    return "forbidden";
  }
  if (!allowed && u < 0.5) {  // every key the same huge value
    const float huge = Pick(kEqualRowValues, rng);
    const float reference = std::fabs(huge) < 1e18f ? kReferenceEqualRowValue : huge;
    values.insert(values.end(), static_cast<size_t>(kv_dim), huge);
    reference_values.insert(reference_values.end(), static_cast<size_t>(kv_dim), reference);
    return absl::StrCat("all ", huge);
  }
  const int64_t positive_key = !allowed && kv_dim > 1 && uniform(rng) < 0.3
                                   ? std::uniform_int_distribution<int64_t>(0, kv_dim - 1)(rng)
                                   : -1;
  for (int64_t j = 0; j < kv_dim; ++j) {
    float value;
    const double w = uniform(rng);
    if (allowed) {
      // Any nonzero value allows.
      value = j == 0 || w < 0.7 ? static_cast<float>(1.0 + std::fabs(normal(rng))) : 0.0f;
    } else if (j == positive_key) {
      value = Pick(kHugePositiveValues, rng);
    } else if (j == 0 || w < 0.55) {
      value = static_cast<float>(normal(rng));
    } else if (w < 0.7) {
      value = -kInf;
    } else {
      value = Pick(kHugeNegativeValues, rng);
    }
    values.push_back(value);
    reference_values.push_back(value);
  }
  return "ordinary";
}

Case MakeCase(std::mt19937_64& rng) {
  Case c;
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const int64_t head_dims[] = {8, 16, 24, 64};
  const int64_t head_dim = Pick(head_dims, rng);
  const int64_t kv_heads = std::uniform_int_distribution<int64_t>(1, 2)(rng);
  const int64_t group = std::uniform_int_distribution<int64_t>(1, 3)(rng);
  const bool cross = uniform(rng) < 0.4;
  HeadConfig config;
  config.num_heads = kv_heads * group;
  config.num_kv_heads = kv_heads;
  config.head_dim = head_dim;
  config.d_model = uniform(rng) < 0.5 ? config.num_heads * head_dim : 24;
  config.context_dim = cross ? std::uniform_int_distribution<int64_t>(4, 40)(rng) : 0;
  if (uniform(rng) < 0.3) config.rotary.rotary_dim = head_dim / 2 / 2 * 2;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  EXPECT_THAT(resolved, IsOk());
  c.config = resolved.value_or(HeadConfig{});
  c.weights = RandomWeights(c.config, rng);

  c.batch = std::uniform_int_distribution<int64_t>(1, 3)(rng);
  c.q_lengths = RandomLengths(c.batch, rng);
  c.layout = RandomLayout(c.q_lengths, rng);
  c.hidden = RandomStates(c.layout, c.config.d_model, rng);
  c.s = c.layout.max_length();
  if (cross) {
    c.kv_lengths = RandomLengths(c.batch, rng);
    c.context_layout = RandomLayout(c.kv_lengths, rng);
    c.context = RandomStates(*c.context_layout, c.config.context_dim, rng);
    c.t = c.context_layout->max_length();
  } else {
    c.kv_lengths = c.q_lengths;
    c.t = c.s;
  }
  if (c.config.rotary.rotary_dim > 0) {
    for (int64_t b = 0; b < c.batch; ++b) {
      c.position_offsets.push_back(std::uniform_int_distribution<int64_t>(0, 500)(rng));
    }
  }
  c.q = RandomHeads(c.batch, c.config.num_heads, c.s, head_dim, c.q_lengths, rng);
  c.k = RandomHeads(c.batch, kv_heads, c.t, head_dim, c.kv_lengths, rng);
  c.v = RandomHeads(c.batch, kv_heads, c.t, head_dim, c.kv_lengths, rng);
  c.causal = uniform(rng) < 0.4;

  const double mask_draw = uniform(rng);
  c.mask_kind = mask_draw < 0.15   ? ExplicitMask::Kind::kNone
                : mask_draw < 0.35 ? ExplicitMask::Kind::kAllowed
                                   : ExplicitMask::Kind::kAdditive;
  std::map<std::string, int> rows;  // kind of mask row -> how many
  if (c.mask_kind != ExplicitMask::Kind::kNone) {
    c.mask_batch_dim = uniform(rng) < 0.5 ? c.batch : 1;
    c.mask_q_dim = uniform(rng) < 0.7 ? c.s : 1;
    c.mask_kv_dim = uniform(rng) < 0.7 ? c.t : 1;
    for (int64_t r = 0; r < c.mask_batch_dim * c.mask_q_dim; ++r) {
      ++rows[AddMaskRow(c.mask_kind, c.mask_kv_dim, rng, c.mask_values, c.reference_mask_values)];
    }
  }
  if (uniform(rng) < 0.3) {
    for (int64_t h = 0; h < c.config.num_heads; ++h) {
      c.head_mask.push_back(h == 1 ? 0.0f : static_cast<float>(2.0 * uniform(rng)));
    }
  }
  // Small blocks put block edges inside the sequences; 0 is the core's choice.
  c.block_queries = std::uniform_int_distribution<int64_t>(0, 5)(rng);
  c.block_keys = std::uniform_int_distribution<int64_t>(0, 5)(rng);

  std::vector<std::string> lengths;
  for (int64_t b = 0; b < c.batch; ++b) {
    lengths.push_back(
        absl::StrCat(c.q_lengths[b], cross ? "x" : "", cross ? absl::StrCat(c.kv_lengths[b]) : ""));
  }
  c.description = absl::StrCat(
      "heads ", c.config.num_heads, "/", kv_heads, ", head_dim ", head_dim, ", d_model ",
      c.config.d_model, cross ? ", cross" : ", self", c.causal ? ", causal" : "",
      c.config.rotary.rotary_dim > 0 ? ", RoPE" : "", ", lengths [", absl::StrJoin(lengths, " "),
      "] in ", c.s, "x", c.t, ", mask ",
      c.mask_kind == ExplicitMask::Kind::kNone      ? "none"
      : c.mask_kind == ExplicitMask::Kind::kAllowed ? "allowed"
                                                    : "additive",
      rows.empty()
          ? ""
          : absl::StrCat(" [", c.mask_batch_dim, ",", c.mask_q_dim, ",", c.mask_kv_dim, "], rows: ",
                         absl::StrJoin(rows, ", ",
                                       [](std::string* out, const auto& row) {
                                         absl::StrAppend(out, row.second, " ", row.first);
                                       })),
      c.head_mask.empty() ? "" : ", head mask", ", blocks ", c.block_queries, "x", c.block_keys);
  return c;
}

// ---------------------------------------------------------------------------
// Running a route and checking it.

// The output and maps of one route's call (NaN-filled, so that an element left
// unwritten shows).
struct RouteResult {
  std::vector<float> output, maps;
};

absl::StatusOr<ForwardInfo> RunRoute(const Case& c, const Route& route, RouteResult& result) {
  ForwardOptions options;
  options.precision = route.precision;
  options.attention_path = route.path;
  if (route.path == AttentionPath::kMaterialized) {
    options.maps.mode = AttentionMapMode::kPerHead;  // every head, every row
    result.maps.assign(static_cast<size_t>(c.batch * c.config.num_heads * c.s * c.t), kNaN);
  } else {
    options.block_queries = c.block_queries;
    options.block_keys = c.block_keys;
    options.block_kernels = route.block_kernels;
  }
  ForwardOutputs outputs;
  outputs.attention_maps = absl::MakeSpan(result.maps);
  if (route.api == Api::kLayer) {
    result.output.assign(static_cast<size_t>(c.layout.rows() * c.config.d_model), kNaN);
    outputs.output = absl::MakeSpan(result.output);
    absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
        AttentionLayer::Create(c.config, c.weights);
    if (!layer.ok()) return layer.status();
    return (*layer)->Forward(c.Layer(), options, outputs);
  }
  result.output.assign(c.q.size(), kNaN);
  outputs.output = absl::MakeSpan(result.output);
  absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(c.config);
  if (!core.ok()) return core.status();
  return (*core)->Run(c.Core(), options, outputs);
}

// The rows of `output` past each sequence's length are exactly 0.
void ExpectZeroPadding(const Case& c, const Route& route, const std::vector<float>& output) {
  if (route.api == Api::kLayer) {
    if (!c.layout.is_padded()) return;
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t i = c.layout.length(b); i < c.layout.max_length(); ++i) {
        for (int64_t e = 0; e < c.config.d_model; ++e) {
          ASSERT_EQ(output[(c.layout.row_offset(b) + i) * c.config.d_model + e], 0.0f)
              << "padding row " << i << " of sequence " << b;
        }
      }
    }
    return;
  }
  const int64_t hd = c.config.head_dim;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.config.num_heads; ++h) {
      for (int64_t i = c.q_lengths[b]; i < c.s; ++i) {
        for (int64_t e = 0; e < hd; ++e) {
          ASSERT_EQ(output[((b * c.config.num_heads + h) * c.s + i) * hd + e], 0.0f)
              << "padding row " << i << " of sequence " << b << ", head " << h;
        }
      }
    }
  }
}

// Runs every route of `precision` on kCases random cases against the
// reference.
void CheckRandomCases(Precision precision) {
  const uint64_t seed = Seed();
  SCOPED_TRACE(SeedTrace(seed));
  std::cout << SeedTrace(seed) << "\n";
  const double tolerance = precision == Precision::kFp32 ? kFp32Tolerance : kBf16Tolerance;
  std::mt19937_64 rng(seed);
  for (int n = 0; n < kCases; ++n) {
    const Case c = MakeCase(rng);
    SCOPED_TRACE(absl::StrCat("case ", n, ": ", c.description));
    const ReferenceResult layer_reference =
        ReferenceLayer(c.config, c.weights, c.Layer(/*for_reference=*/true));
    const ReferenceResult core_reference = ReferenceCore(c.config, c.Core(/*for_reference=*/true));
    std::vector<std::string> skipped;
    const std::vector<Route> routes = RoutesFor(precision, c.config.head_dim, skipped);
    std::cout << "case " << n << ": " << c.description << "\n";
    for (const std::string& route : skipped) std::cout << "  skipped: " << route << "\n";
    for (const Route& route : routes) {
      SCOPED_TRACE(route.Name());
      RouteResult result;
      const absl::StatusOr<ForwardInfo> info = RunRoute(c, route, result);
      ASSERT_THAT(info, IsOk());
      EXPECT_EQ(info->precision, precision);
      EXPECT_EQ(
          info->kernel_path,
          absl::StrCat(PrecisionName(precision), "/",
                       route.path == AttentionPath::kMaterialized ? "materialized" : "blocked"));
      const ReferenceResult& reference =
          route.api == Api::kLayer ? layer_reference : core_reference;
      EXPECT_LE(RelativeFrobeniusError(result.output, reference.output), tolerance) << "output";
      ExpectZeroPadding(c, route, result.output);
      if (route.path == AttentionPath::kMaterialized) {
        EXPECT_LE(RelativeFrobeniusError(result.maps, reference.per_head_maps), tolerance)
            << "attention maps";
      }
    }
  }
}

TEST(RouteAgreement, Fp32RoutesMatchTheReferenceOnRandomConfigurations) {
  CheckRandomCases(Precision::kFp32);
}

TEST(RouteAgreement, Bf16RoutesMatchTheReferenceOnRandomConfigurations) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  CheckRandomCases(Precision::kBf16);
}

// ---------------------------------------------------------------------------
// The report's case: projected heads, one head of 16, one query, three keys,
// an additive mask of -1e10 on every key (an FP32 mask), no maps: equal
// weights, so the output is the mean of v -- on the route the core chooses
// and on every other that can serve it.
void CheckMeanOfValuesUnderAHugeMask(Precision precision) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  HeadConfig config;
  config.num_heads = 1;
  config.head_dim = 16;
  absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(config);
  ASSERT_THAT(core, IsOk());
  const std::vector<float> q = RandomNormal(16, rng);
  const std::vector<float> k = RandomNormal(3 * 16, rng);
  const std::vector<float> v = RandomNormal(3 * 16, rng);
  const std::vector<float> mask = {-1e10f};
  CoreInputs inputs;
  inputs.q = q;
  inputs.k = k;
  inputs.v = v;
  inputs.batch = 1;
  inputs.q_len = 1;
  inputs.kv_len = 3;
  inputs.mask.kind = ExplicitMask::Kind::kAdditive;
  inputs.mask.values = mask;
  std::vector<double> mean(16, 0.0);
  for (int64_t j = 0; j < 3; ++j) {
    for (int64_t e = 0; e < 16; ++e) mean[e] += v[j * 16 + e] / 3.0;
  }
  const double tolerance = precision == Precision::kFp32 ? kFp32Tolerance : kBf16Tolerance;

  std::vector<Route> routes = {{Api::kCore, AttentionPath::kAuto, BlockKernels::kAuto, precision}};
  std::vector<std::string> skipped;
  for (const Route& route : RoutesFor(precision, 16, skipped)) {
    if (route.api == Api::kCore) routes.push_back(route);
  }
  for (const std::string& route : skipped) {
    if (route.rfind("core/", 0) == 0) std::cout << "skipped: " << route << "\n";
  }
  for (const Route& route : routes) {
    const std::string name =
        route.path == AttentionPath::kAuto ? "the core's choice (no maps)" : route.Name();
    SCOPED_TRACE(name);
    ForwardOptions options;
    options.precision = precision;
    options.attention_path = route.path;
    options.block_kernels = route.block_kernels;
    std::vector<float> output(16, kNaN);
    ForwardOutputs outputs;
    outputs.output = absl::MakeSpan(output);
    const absl::StatusOr<ForwardInfo> info = (*core)->Run(inputs, options, outputs);
    ASSERT_THAT(info, IsOk());
    EXPECT_EQ(info->precision, precision);
    EXPECT_LE(RelativeFrobeniusError(output, mean), tolerance)
        << "output " << absl::StrJoin(output, " ");
    std::cout << name << " ran as " << info->kernel_path << "\n";
  }
}

TEST(RouteAgreement, AMinusTenBillionMaskOnEveryKeyGivesTheMeanOfValuesInFp32) {
  CheckMeanOfValuesUnderAHugeMask(Precision::kFp32);
}

TEST(RouteAgreement, AMinusTenBillionMaskOnEveryKeyGivesTheMeanOfValuesInBf16) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  CheckMeanOfValuesUnderAHugeMask(Precision::kBf16);
}

}  // namespace
}  // namespace attnserve::core
