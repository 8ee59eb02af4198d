// Throughput of the attention layer, beside oneDNN's own matmul ceiling (2048^3,
// same precision) measured in the same process. A program that prints numbers,
// not a test:
//   build/tests/benchmarks/attention_layer_benchmark --benchmark_repetitions=5
//     --benchmark_report_aggregates_only=true [--benchmark_filter=...]
//
// Counters per benchmark:
//   GFLOP        FLOP/s in units of 1e9: 2*B*S*D*(Hq+2Hkv)hd (Q/K/V projections) +
//                2*B*S*Hq*hd*D (output) + 4*B*Hq*S^2*hd (scores and values; halved
//                when causal). For Hkv = Hq this is the 2*B*S*D*3D + 2*B*S*D*D +
//                4*B*H*S^2*hd of the targets.
//   of_ceiling   GFLOP / oneDNN's matmul GFLOP/s on 2048^3 in the same precision,
//                measured in this process alternately with the forwards (median
//                of the per-window ratios; see RunLayer)
//   allocs       operator new calls per forward in the steady state
//   allocs_onednn  of those, the calls from inside oneDNN's library
//   peak_rss_mb  the process's peak resident set after the warm-up forwards,
//                before the ceiling's matrices exist (meaningful when one
//                benchmark runs per process, as compare_with_pytorch.py does)
// The label names the kernel path that ran.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/kernels/block_kernels.h"
#include "core/kernels/online_softmax.h"
#include "dnnl.hpp"
#include "tests/benchmarks/allocation_counter.h"


namespace attnserve::core {
namespace {

// One oneDNN matmul, [m, k] x [k, n] (+ bias [n]) in FP32 or BF16 operands
// with FP32 output, on fixed inputs, built once.
class Matmul {
 public:
  Matmul(int64_t m, int64_t k, int64_t n, bool bf16, bool bias)
      : flop_(2.0 * m * k * n),
        engine_(dnnl::engine::kind::cpu, 0),
        stream_(engine_),
        matmul_(dnnl::matmul::primitive_desc(
            bias ? dnnl::matmul::desc(Desc({m, k}, bf16), Desc({k, n}, bf16), Desc({1, n}, false),
                                      Desc({m, n}, false))
                 : dnnl::matmul::desc(Desc({m, k}, bf16), Desc({k, n}, bf16), Desc({m, n}, false)),
            engine_)),
        a_(Desc({m, k}, bf16), engine_),
        b_(Desc({k, n}, bf16), engine_),
        c_(Desc({m, n}, false), engine_) {
    args_ = {{DNNL_ARG_SRC, a_}, {DNNL_ARG_WEIGHTS, b_}, {DNNL_ARG_DST, c_}};
    if (bias) {
      bias_ = memory(Desc({1, n}, false), engine_);
      args_[DNNL_ARG_BIAS] = bias_;
    }
    for (const auto& [arg, m] : args_) {
      if (arg == DNNL_ARG_DST) continue;
      char* p = static_cast<char*>(m.get_data_handle());
      // Small finite values in either type.
      for (size_t i = 0; i < m.get_desc().get_size(); ++i) p[i] = static_cast<char>(i % 7 + 60);
    }
    Seconds();  // warm-up
  }

  // Seconds of one run.
  double Seconds() {
    const auto start = std::chrono::steady_clock::now();
    matmul_.execute(stream_, args_);
    stream_.wait();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double flop() const { return flop_; }

 private:
  using memory = dnnl::memory;
  static memory::desc Desc(const memory::dims& dims, bool bf16) {
    return memory::desc(dims, bf16 ? memory::data_type::bf16 : memory::data_type::f32,
                        memory::format_tag::ab);
  }
  double flop_;
  dnnl::engine engine_;
  dnnl::stream stream_;
  dnnl::matmul matmul_;
  memory a_, b_, c_, bias_;
  std::unordered_map<int, memory> args_;
};

// oneDNN's matmul on 2048^3 in FP32 or BF16 (FP32 output): the ceiling.
class Ceiling {
 public:
  explicit Ceiling(bool bf16) : matmul_(kN, kN, kN, bf16, /*bias=*/false) {}

  // GFLOP/s of one run.
  double Sample() { return matmul_.flop() / matmul_.Seconds() * 1e-9; }

 private:
  static constexpr int64_t kN = 2048;
  Matmul matmul_;
};

double Median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

// Median GFLOP/s of 7 runs.
double CeilingGflops(bool bf16) {
  Ceiling ceiling(bf16);
  std::vector<double> gflops;
  for (int i = 0; i < 7; ++i) gflops.push_back(ceiling.Sample());
  return Median(gflops);
}

// ATTNSERVE_BLOCK_KERNELS=onednn|auto, read once at start-up as the server
// reads it: which kernels the blocked path's blocks run on (to compare them).
BlockKernels BlockKernelsFromEnvironment() {
  static const BlockKernels kernels = [] {
    const char* const name = std::getenv("ATTNSERVE_BLOCK_KERNELS");
    if (name == nullptr) return BlockKernels::kAuto;
    const absl::StatusOr<BlockKernels> parsed = ParseBlockKernels(name);
    if (!parsed.ok()) {
      std::cerr << parsed.status() << "\n";
      std::exit(2);
    }
    return *parsed;
  }();
  return kernels;
}

enum Flags : int64_t {
  kCausal = 1,
  kBf16 = 2,
  kPerHeadMaps = 4,
  kMaterialized = 8,  // force the materialized path (no maps)
  kBlocked = 16,      // force the blocked path
};

// args: batch, seq, d_model, heads, kv_heads, flags; block sizes 0: the core's.
void RunLayer(benchmark::State& state, int64_t block_queries, int64_t block_keys) {
  const int64_t batch = state.range(0), seq = state.range(1), d = state.range(2),
                heads = state.range(3), kv_heads = state.range(4), flags = state.range(5);
  const bool causal = flags & kCausal, bf16 = flags & kBf16;
  if (bf16 && !Bf16Supported()) {
    // BF16 requests would run FP32, and the BF16 ceiling cannot be measured.
    state.SkipWithError("BF16 needs AVX512-BF16 (this CPU runs BF16 requests in FP32)");
    return;
  }
  HeadConfig requested;
  requested.d_model = d;
  requested.num_heads = heads;
  requested.num_kv_heads = kv_heads;
  const HeadConfig config = *ResolveHeadConfig(requested);
  auto layer = *AttentionLayer::Create(config, SeededWeights(config, 1));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> input(batch * seq * d), output(input.size()), maps;
  for (float& x : input) x = normal(rng);
  LayerInputs inputs;
  inputs.hidden_states = input;
  inputs.layout = *SequenceLayout::Padded(batch, seq);
  inputs.causal = causal;
  ForwardOptions options;
  options.precision = bf16 ? Precision::kBf16 : Precision::kFp32;
  if (flags & kMaterialized) options.attention_path = AttentionPath::kMaterialized;
  if (flags & kBlocked) options.attention_path = AttentionPath::kBlocked;
  options.block_queries = block_queries;
  options.block_keys = block_keys;
  options.block_kernels = BlockKernelsFromEnvironment();
  // A compute worker's workspace, kept across forwards.
  const std::unique_ptr<Workspace> workspace = *Workspace::Create();
  ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  if (flags & kPerHeadMaps) {
    options.maps.mode = AttentionMapMode::kPerHead;
    maps.resize(batch * heads * seq * seq);
    outputs.attention_maps = absl::MakeSpan(maps);
  }
  const absl::StatusOr<ForwardInfo> info =
      layer->Forward(inputs, options, outputs, workspace.get());
  if (!info.ok()) {
    state.SkipWithError(std::string(info.status().message()).c_str());
    return;
  }
  layer->Forward(inputs, options, outputs, workspace.get()).IgnoreError();  // warm-up
  // Peak RSS of the forwards (inputs, weights, scratch, libraries), taken
  // before the ceiling's 2048^2 matrices are made.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const double peak_rss_mb = usage.ru_maxrss / 1024.0;
  const int64_t hd = config.head_dim;
  const double projections =
      2.0 * batch * seq * d * (heads + 2 * kv_heads) * hd + 2.0 * batch * seq * heads * hd * d;
  const double attention = 4.0 * batch * heads * seq * seq * hd * (causal ? 0.5 : 1.0);
  const double flops = projections + attention;
  // The ceiling is sampled between windows of >= 50 ms of forwards (outside
  // the timed region); each window's GFLOP/s is divided by the mean of the
  // samples on either side, so the ratio sees the machine's load of that
  // moment. of_ceiling is the median of those ratios.
  Ceiling ceiling(bf16);
  std::vector<double> ceilings = {ceiling.Sample()};
  std::vector<double> ratios;
  double window_seconds = 0.0;
  int64_t window_forwards = 0;
  int64_t allocations = 0;
  for (auto _ : state) {
    const int64_t allocations_before = attnserve::testing::AllocationCount();
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(layer->Forward(inputs, options, outputs, workspace.get()));
    window_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    allocations += attnserve::testing::AllocationCount() - allocations_before;
    ++window_forwards;
    if (window_seconds >= 0.05) {
      state.PauseTiming();
      ceilings.push_back(ceiling.Sample());
      const double gflops = flops * window_forwards / window_seconds * 1e-9;
      ratios.push_back(gflops / (0.5 * (ceilings.back() + ceilings[ceilings.size() - 2])));
      window_seconds = 0.0;
      window_forwards = 0;
      state.ResumeTiming();
    }
  }
  if (ratios.empty() && window_forwards > 0) {
    ceilings.push_back(ceiling.Sample());
    ratios.push_back(flops * window_forwards / window_seconds * 1e-9 /
                     (0.5 * (ceilings.back() + ceilings[ceilings.size() - 2])));
  }
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(batch * seq),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.counters["of_ceiling"] = Median(ratios);
  state.counters["ceiling_GFLOP"] = Median(ceilings);
  state.counters["allocs"] = static_cast<double>(allocations) / state.iterations();
  // One more forward, untimed, with the allocations attributed: how many of
  // them oneDNN's library makes (its per-execute bookkeeping).
  attnserve::testing::SetAllocationAttribution(true);
  const int64_t onednn_before = attnserve::testing::OneDnnAllocationCount();
  layer->Forward(inputs, options, outputs, workspace.get()).IgnoreError();
  state.counters["allocs_onednn"] =
      static_cast<double>(attnserve::testing::OneDnnAllocationCount() - onednn_before);
  attnserve::testing::SetAllocationAttribution(false);
  state.counters["peak_rss_mb"] = peak_rss_mb;
  state.SetLabel(info->kernel_path);
}

void BM_AttentionLayer(benchmark::State& state) { RunLayer(state, 0, 0); }

// args: as BM_AttentionLayer, then block_queries, block_keys.
void BM_BlockSizes(benchmark::State& state) { RunLayer(state, state.range(6), state.range(7)); }

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "S", "D", "H", "Hkv", "flags"});
  // FP32 without maps. {1, 128} and {32, 128}: one serving request of B=1,
  // S=128 alone, and the tokens of a batch of 32 of them (the in-process peer
  // of `attnctl bench --concurrency=32 --batch=1 --seq=128`).
  b->Args({1, 128, 768, 12, 12, 0});
  b->Args({32, 128, 768, 12, 12, 0});
  // A lone small request (compute_gap.py compares the server's compute with it).
  b->Args({1, 16, 768, 12, 12, 0});
  b->Args({8, 128, 768, 12, 12, 0});
  b->Args({1, 512, 768, 12, 12, 0});
  b->Args({1, 2048, 768, 12, 12, 0});
  b->Args({1, 4096, 1024, 16, 16, 0});
  // Causal beside bidirectional (S >= 2048).
  b->Args({1, 2048, 768, 12, 12, kCausal});
  b->Args({1, 4096, 1024, 16, 16, kCausal});
  // Per-head maps (materialized).
  b->Args({8, 128, 768, 12, 12, kPerHeadMaps});
  b->Args({1, 512, 768, 12, 12, kPerHeadMaps});
  b->Args({1, 2048, 768, 12, 12, kPerHeadMaps});
  // BF16.
  b->Args({8, 128, 768, 12, 12, kBf16});
  b->Args({1, 512, 768, 12, 12, kBf16});
  b->Args({1, 2048, 768, 12, 12, kBf16});
  b->Args({1, 4096, 1024, 16, 16, kBf16});
  // Grouped-query 8:1 beside full multi-head attention (same query heads).
  b->Args({1, 2048, 1024, 16, 2, 0});
  b->Args({1, 2048, 1024, 16, 16, 0});
  // The materialized path without maps, for comparison (and kAuto's rule).
  b->Args({8, 128, 768, 12, 12, kMaterialized});
  b->Args({1, 512, 768, 12, 12, kMaterialized});
  b->Args({1, 2048, 768, 12, 12, kMaterialized});
  b->Args({8, 128, 768, 12, 12, kBlocked});
  b->Args({1, 512, 768, 12, 12, kBlocked});
  b->Args({8, 128, 768, 12, 12, kBf16 | kMaterialized});
  b->Args({1, 512, 768, 12, 12, kBf16 | kMaterialized});
  b->Args({1, 2048, 768, 12, 12, kBf16 | kMaterialized});
  // A tiny shape for compare_with_pytorch.py --quick.
  b->Args({2, 16, 64, 4, 4, 0});
}
BENCHMARK(BM_AttentionLayer)->Apply(Shapes)->Unit(benchmark::kMillisecond)->UseRealTime();

// Long sequences on the blocked path (one iteration each is seconds).
BENCHMARK(BM_AttentionLayer)
    ->ArgNames({"B", "S", "D", "H", "Hkv", "flags"})
    ->Args({1, 32768, 1024, 16, 16, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1)
    ->Name("BM_AttentionLayerLong");

// Block sizes of the blocked path (how kDefaultBlockQueries/Keys were chosen),
// beside the materialized path on the same shapes.
void BlockSizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "S", "D", "H", "Hkv", "flags", "bq", "bk"});
  for (const int64_t seq : {512, 2048}) {
    b->Args({1, seq, 768, 12, 12, kMaterialized, 0, 0});
    for (const int64_t bq : {64, 128, 256}) {
      for (const int64_t bk : {256, 512, 1024, 2048}) {
        if (bk <= seq) b->Args({1, seq, 768, 12, 12, kBlocked, bq, bk});
      }
    }
  }
  // BF16, where the matmuls take half the time and the softmax the same.
  for (const int64_t seq : {512, 2048}) {
    for (const auto& [bq, bk] : std::vector<std::pair<int64_t, int64_t>>{
             {256, 256}, {256, 512}, {512, 512}, {128, 512}, {256, 1024}}) {
      if (bq <= seq && bk <= seq) b->Args({1, seq, 768, 12, 12, kBlocked | kBf16, bq, bk});
    }
  }
  for (const int64_t bk : {256, 512, 1024, 2048}) {
    b->Args({1, 4096, 1024, 16, 16, kBlocked | kBf16, 256, bk});
  }
  for (const int64_t bk : {256, 512, 1024}) b->Args({1, 4096, 1024, 16, 16, kBlocked, 256, bk});
  // Causal: on oneDNN's block matmuls the diagonal blocks are computed whole
  // (half of them masked); the own kernels skip the key tiles a strip of
  // query rows does not see.
  for (const auto& [bq, bk] : std::vector<std::pair<int64_t, int64_t>>{
           {256, 256}, {256, 512}, {256, 1024}, {128, 256}, {128, 128}, {64, 128}, {64, 64}}) {
    b->Args({1, 2048, 768, 12, 12, kBlocked | kCausal, bq, bk});
  }
  for (const int64_t bk : {256, 512, 1024}) {
    b->Args({1, 2048, 768, 12, 12, kBlocked | kCausal | kBf16, 256, bk});
  }
}
BENCHMARK(BM_BlockSizes)->Apply(BlockSizes)->Unit(benchmark::kMillisecond)->UseRealTime();

// The blocked path's row kernel alone: one online-softmax step over a key
// block's row of `width` scores (its output feeds the next iteration; the
// kernel is branch-free, so the values do not change the work), writing the
// probabilities in place (bf16 0) or as BF16 beside them (bf16 1, the BF16
// path's row). The items_per_second counter is scores per second.
void BM_OnlineSoftmaxRow(benchmark::State& state) {
  const int64_t width = state.range(0);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> row(width);
  for (float& x : row) x = normal(rng);
  std::vector<uint16_t> p_bf16(state.range(1) != 0 ? width : 0);
  for (auto _ : state) {
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    benchmark::DoNotOptimize(internal::OnlineSoftmaxRow(row.data(), width, width, 0.125f, m, l,
                                                        p_bf16.empty() ? nullptr : p_bf16.data()));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * width);
}
BENCHMARK(BM_OnlineSoftmaxRow)
    ->ArgNames({"width", "bf16"})
    ->Args({256, 0})
    ->Args({256, 1})
    ->Args({1024, 0})
    ->Args({1024, 1})
    ->Args({2048, 0})
    ->Args({2048, 1});

// Forwards whose shapes keep changing, as a server's batches do: one sequence
// of 1..`distinct` tokens (a random order, the same in every run; FP32,
// d_model 768, 12 heads) per forward, on one workspace kept across them.
// Every row count is two projection primitives of its own (Q/K/V, output),
// so past about 128 row counts the workspace's cache of 256 primitives evicts
// and rebuilds them; whether a rebuild is cheap depends on oneDNN's own
// primitive cache. Compare processes run with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0
// (as attnserve sets it) and unset (oneDNN's 1024). Counters: tokens (per
// second) and us_per_forward. args: distinct row counts.
void BM_ChangingShapes(benchmark::State& state) {
  const int64_t distinct = state.range(0);
  HeadConfig requested;
  requested.d_model = 768;
  requested.num_heads = 12;
  const HeadConfig config = *ResolveHeadConfig(requested);
  auto layer = *AttentionLayer::Create(config, SeededWeights(config, 1));
  std::vector<int64_t> order(static_cast<size_t>(4 * distinct));
  for (size_t i = 0; i < order.size(); ++i) order[i] = 1 + static_cast<int64_t>(i) % distinct;
  std::shuffle(order.begin(), order.end(), std::mt19937(3));
  std::vector<float> input(distinct * config.d_model, 0.25f), output(input.size());
  const std::unique_ptr<Workspace> workspace = *Workspace::Create();
  const auto forward = [&](int64_t seq) {
    LayerInputs inputs;
    inputs.hidden_states = absl::MakeConstSpan(input.data(), seq * config.d_model);
    inputs.layout = *SequenceLayout::Padded(1, seq);
    ForwardOutputs outputs;
    outputs.output = absl::MakeSpan(output.data(), seq * config.d_model);
    return layer->Forward(inputs, {}, outputs, workspace.get());
  };
  for (const int64_t seq : order) {  // warm-up: every shape met once
    if (absl::Status status = forward(seq).status(); !status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
  }
  size_t next = 0;
  int64_t tokens = 0;
  for (auto _ : state) {
    const int64_t seq = order[next];
    next = (next + 1) % order.size();
    benchmark::DoNotOptimize(forward(seq));
    tokens += seq;
  }
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(tokens),
                                                benchmark::Counter::kIsRate);
  state.counters["us_per_forward"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * 1e-6,
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  const char* capacity = std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY");
  state.SetLabel(std::string("ONEDNN_PRIMITIVE_CACHE_CAPACITY=") +
                 (capacity != nullptr ? capacity : "(unset)"));
}
BENCHMARK(BM_ChangingShapes)
    ->Arg(32)
    ->Arg(100)
    ->Arg(200)
    ->Arg(400)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The attention alone (AttentionCore, blocked path: scores, online softmax,
// P V), on dense FP32 Q/K/V [B, H, S, hd] (BF16: converted inside, as the
// core does). GFLOP counts 4*B*H*S^2*hd (halved when causal); of_ceiling
// divides it by the matmul ceiling measured before and after. Run it with
// ATTNSERVE_BLOCK_KERNELS=onednn in another process to compare the block
// kernels (BlockKernelsFromEnvironment). args: batch, seq, heads, head_dim, flags (causal, BF16).
void BM_AttentionCore(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1), heads = state.range(2),
                hd = state.range(3), flags = state.range(4);
  const bool bf16 = flags & kBf16;
  if (bf16 && !Bf16Supported()) {
    // BF16 requests would run FP32, and the BF16 ceiling cannot be measured.
    state.SkipWithError("BF16 needs AVX512-BF16 (this CPU runs BF16 requests in FP32)");
    return;
  }
  HeadConfig requested;
  requested.d_model = heads * hd;
  requested.num_heads = heads;
  requested.head_dim = hd;
  const HeadConfig config = *ResolveHeadConfig(requested);
  auto core = *AttentionCore::Create(config);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> q(batch * heads * seq * hd), k(q.size()), v(q.size()), output(q.size());
  for (std::vector<float>* x : {&q, &k, &v}) {
    for (float& e : *x) e = normal(rng);
  }
  CoreInputs inputs{q, k, v, batch, seq, seq, {}, {}, (flags & kCausal) != 0, {}, {}};
  ForwardOptions options;
  options.precision = bf16 ? Precision::kBf16 : Precision::kFp32;
  options.attention_path = AttentionPath::kBlocked;
  options.block_kernels = BlockKernelsFromEnvironment();
  const std::unique_ptr<Workspace> workspace = *Workspace::Create();
  ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  const absl::StatusOr<ForwardInfo> info = core->Run(inputs, options, outputs, workspace.get());
  if (!info.ok()) {
    state.SkipWithError(std::string(info.status().message()).c_str());
    return;
  }
  const double before = CeilingGflops(bf16);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    benchmark::DoNotOptimize(core->Run(inputs, options, outputs, workspace.get()));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double ceiling = 0.5 * (before + CeilingGflops(bf16));
  const double flop = 4.0 * batch * heads * seq * seq * hd * ((flags & kCausal) ? 0.5 : 1.0);
  const double gflops = flop * static_cast<double>(state.iterations()) / seconds * 1e-9;
  state.counters["GFLOP"] = gflops;  // per second
  state.counters["ceiling_GFLOP"] = ceiling;
  state.counters["of_ceiling"] = gflops / ceiling;
  state.SetLabel(info->kernel_path);
}
BENCHMARK(BM_AttentionCore)
    ->Args({8, 128, 12, 64, 0})
    ->Args({8, 128, 12, 64, kBf16})
    ->Args({1, 512, 12, 64, 0})
    ->Args({1, 512, 12, 64, kBf16})
    ->Args({1, 2048, 12, 64, 0})
    ->Args({1, 2048, 12, 64, kBf16})
    ->Args({1, 2048, 12, 64, kCausal})
    ->Args({1, 2048, 12, 64, kCausal | kBf16})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The own block kernels alone on one thread (core/kernels/block_kernels.h): a query
// block of 256 rows in strips of kStripRows against one packed key block,
// scores then P V (P fixed, no softmax), operands in cache. GFLOP counts
// 4 * 256 * keys * head_dim. args: keys, head_dim, bf16.
void BM_BlockKernels(benchmark::State& state) {
  const int64_t keys = state.range(0), hd = state.range(1);
  const bool bf16 = state.range(2) != 0;
  if (!internal::OwnBlockKernelsAvailable(bf16, hd)) {
    state.SkipWithError("the own block kernels do not run on this CPU");
    return;
  }
  constexpr int64_t kRows = 256;
  const int64_t element = bf16 ? 2 : 4;
  std::vector<char> q(kRows * hd * element, 0x3c), k(keys * hd * element, 0x3c),
      v(keys * hd * element, 0x3c);
  std::vector<char> k_packed(internal::PackedBlockElements(keys, hd) * element);
  std::vector<Bf16> v_packed(internal::PackedBlockElements(keys, hd));
  internal::PackKeyBlock(k.data(), hd, keys, keys, hd, bf16, k_packed.data());
  internal::PackValueBlockBf16(reinterpret_cast<const Bf16*>(v.data()), hd, keys, keys, hd,
                               v_packed.data());
  const int64_t stride = (keys + 15) / 16 * 16;
  std::vector<float> scores(internal::kStripRows * stride, 0.01f), acc(kRows * hd);
  std::vector<Bf16> probs(internal::kStripRows * stride, 0x3c00);
  const std::vector<float> alpha(internal::kStripRows, 1.0f);
  for (auto _ : state) {
    for (int64_t r0 = 0; r0 < kRows; r0 += internal::kStripRows) {
      internal::BlockScores(bf16, q.data() + r0 * hd * element, hd, internal::kStripRows,
                            k_packed.data(), stride / 16, hd, scores.data(), stride);
      if (bf16) {
        internal::BlockValuesBf16(probs.data(), stride, internal::kStripRows, stride,
                                  v_packed.data(), hd, alpha.data(), false, acc.data() + r0 * hd,
                                  hd);
      } else {
        internal::BlockValuesFp32(scores.data(), stride, internal::kStripRows, keys,
                                  reinterpret_cast<const float*>(v.data()), hd, hd, alpha.data(),
                                  false, acc.data() + r0 * hd, hd);
      }
    }
    benchmark::DoNotOptimize(acc.data());
  }
  state.counters["GFLOP"] = benchmark::Counter(4.0 * kRows * keys * hd * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_BlockKernels)
    ->ArgNames({"keys", "hd", "bf16"})
    ->ArgsProduct({{128, 256, 512, 1024}, {64}, {0, 1}});

// The own kernels' softmax step over a strip of 8 rows of a key block
// (OnlineSoftmaxStrip: the rows' passes interleaved) against the same rows one
// call each (OnlineSoftmaxRow), FP32 in place or BF16. items_per_second is
// scores per second. args: width, bf16, strip (1) or rows (0).
void BM_OnlineSoftmaxStrip(benchmark::State& state) {
  const int64_t width = state.range(0);
  const bool bf16 = state.range(1) != 0, strip = state.range(2) != 0;
  constexpr int64_t kRows = 8;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  // Rows one tile apart beyond the width, as the kernels lay out a strip.
  const int64_t stride = width + 16;
  std::vector<float> scores(kRows * stride);
  for (float& x : scores) x = normal(rng);
  std::vector<uint16_t> p_bf16(bf16 ? scores.size() : 0);
  const std::vector<int64_t> limits(kRows, width);
  std::vector<float> m(kRows), l(kRows), alpha(kRows);
  for (auto _ : state) {
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.0f);
    uint16_t* const p = bf16 ? p_bf16.data() : nullptr;
    if (strip) {
      internal::OnlineSoftmaxStrip(scores.data(), stride, kRows, limits.data(), width, 0.125f,
                                   m.data(), l.data(), alpha.data(), p);
    } else {
      for (int64_t r = 0; r < kRows; ++r) {
        alpha[r] = internal::OnlineSoftmaxRow(scores.data() + r * stride, width, width, 0.125f,
                                              m[r], l[r], p != nullptr ? p + r * stride : nullptr);
      }
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kRows * width);
}
BENCHMARK(BM_OnlineSoftmaxStrip)
    ->ArgNames({"width", "bf16", "strip"})
    ->ArgsProduct({{128, 512, 1024}, {0, 1}, {0, 1}});

// The layer's two projections alone, as oneDNN runs them at its best: the
// fused Q/K/V matmul [B*S, D] x [D, (Hq + 2 Hkv) hd] and the output matmul
// [B*S, Hq hd] x [Hq hd, D], with bias, in the precision of `flags`, on
// dense inputs. Work any implementation of the layer does, at oneDNN's
// speed; bound_ms adds the attention's FLOPs at the ceiling's GFLOP/s
// (measured here): a floor under any layer's time built on these matmuls,
// which compare_with_pytorch.py divides PyTorch's time by.
void BM_ProjectionsAlone(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1), d = state.range(2),
                heads = state.range(3), kv_heads = state.range(4), flags = state.range(5);
  const bool bf16 = flags & kBf16;
  if (bf16 && !Bf16Supported()) {
    // BF16 requests would run FP32, and the BF16 ceiling cannot be measured.
    state.SkipWithError("BF16 needs AVX512-BF16 (this CPU runs BF16 requests in FP32)");
    return;
  }
  const int64_t hd = d / heads;
  const int64_t tokens = batch * seq;
  Matmul qkv(tokens, d, (heads + 2 * kv_heads) * hd, bf16, /*bias=*/true);
  Matmul out(tokens, heads * hd, d, bf16, /*bias=*/true);
  std::vector<double> seconds;
  for (auto _ : state) {
    const double run = qkv.Seconds() + out.Seconds();
    state.SetIterationTime(run);
    seconds.push_back(run);
  }
  const double ceiling = CeilingGflops(bf16);
  const double attention = 4.0 * batch * heads * seq * seq * hd * ((flags & kCausal) ? 0.5 : 1.0);
  const double projections_ms = Median(seconds) * 1e3;
  state.counters["GFLOP"] = benchmark::Counter((qkv.flop() + out.flop()) * 1e-9,
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ceiling_GFLOP"] = ceiling;
  state.counters["projections_ms"] = projections_ms;
  state.counters["bound_ms"] = projections_ms + attention / (ceiling * 1e9) * 1e3;
}
// (The shapes of BM_AttentionLayer; its flags other than BF16 and causal do
// not change the matmuls.)
BENCHMARK(BM_ProjectionsAlone)->Apply(Shapes)->Unit(benchmark::kMillisecond)->UseManualTime();

// The ceilings alone.
void BM_OneDnnMatmulCeiling(benchmark::State& state) {
  double gflops = 0;
  for (auto _ : state) gflops = CeilingGflops(state.range(0) != 0);
  state.counters["ceiling_GFLOP"] = gflops;
}
BENCHMARK(BM_OneDnnMatmulCeiling)->ArgName("bf16")->Arg(0)->Arg(1)->Iterations(1);

}  // namespace
}  // namespace attnserve::core

BENCHMARK_MAIN();
