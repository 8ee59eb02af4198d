// Throughput of the attention layer, beside oneDNN's own FP32 matmul ceiling
// measured in the same process. A program that prints numbers, not a test:
//   build/tests/benchmarks/attention_layer_benchmark --benchmark_repetitions=5
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "dnnl.hpp"

namespace attnserve::core {
namespace {

// args: batch, seq, d_model, heads.
void BM_AttentionLayerFp32(benchmark::State& state) {
  const int64_t batch = state.range(0), seq = state.range(1), d = state.range(2),
                heads = state.range(3);
  HeadConfig requested;
  requested.d_model = d;
  requested.num_heads = heads;
  const HeadConfig config = *ResolveHeadConfig(requested);
  auto layer = *AttentionLayer::Create(config, SeededWeights(config, 1));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> input(batch * seq * d), output(input.size());
  for (float& x : input) x = normal(rng);
  LayerInputs inputs;
  inputs.hidden_states = input;
  inputs.layout = *SequenceLayout::Padded(batch, seq);
  ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  if (!layer->Forward(inputs, {}, outputs).ok()) state.SkipWithError("warm-up failed");
  for (auto _ : state) {
    benchmark::DoNotOptimize(layer->Forward(inputs, {}, outputs));
  }
  // 2*B*S*D*3D (Q/K/V) + 2*B*S*D*D (output) + 4*B*H*S^2*head_dim (scores, values).
  const double flops = 8.0 * batch * seq * d * d + 4.0 * batch * heads * seq * seq * (d / heads);
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(batch * seq),
                                                benchmark::Counter::kIsIterationInvariantRate);
}
// {32, 128, ...}: the tokens of one batch of 32 serving requests of B=1, S=128
// (the in-process peer of `attnctl bench --concurrency=32 --batch=1 --seq=128`);
// {1, 128, ...}: one such request alone.
BENCHMARK(BM_AttentionLayerFp32)
    ->Args({1, 128, 768, 12})
    ->Args({8, 128, 768, 12})
    ->Args({32, 128, 768, 12})
    ->Args({1, 512, 768, 12})
    ->Args({1, 2048, 768, 12})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The ceiling: oneDNN's FP32 matmul on 2048^3.
void BM_OneDnnMatmulFp32(benchmark::State& state) {
  using dnnl::memory;
  const int64_t n = 2048;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc desc({n, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul matmul(
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(desc, desc, desc), engine));
  memory a(desc, engine), b(desc, engine), c(desc, engine);
  for (auto* m : {&a, &b}) {
    float* p = static_cast<float*>(m->get_data_handle());
    for (int64_t i = 0; i < n * n; ++i) p[i] = 0.001f * static_cast<float>(i % 1000);
  }
  for (auto _ : state) {
    matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
  state.counters["GFLOP"] = benchmark::Counter(2.0 * n * n * n * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_OneDnnMatmulFp32)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace attnserve::core

BENCHMARK_MAIN();
