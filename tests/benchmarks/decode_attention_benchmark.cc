// Decode attention over the paged KV cache against this machine's read
// bandwidth, measured in the same process. A program that prints numbers,
// not a test:
//   build/tests/benchmarks/decode_attention_benchmark [--benchmark_min_time=0.2]
//
// A decode step reads every cached K/V byte once and does little arithmetic
// per byte: it is bounded by memory bandwidth, not by the matmul ceiling.
// Each benchmark rotates over enough sequences that their KV is at least 4x
// the L3 cache (read from sysfs and printed), so each call reads from memory.
//
// BM_ReadProbe: a large-array sum on all OpenMP threads (GB/s), the ceiling
// (independent accumulators in the CPU's widest vectors: bounded by memory,
// not by the adds).
// BM_ReadProbeByHead/chunk_kib: the same array read in chunks, the order of
// one KV head's rows through a cache's blocks (of_probe against the probe).
// BM_ReadProbeCall/kib: the probe's array read `kib` KiB a call (a fresh
// slice each), timed as the decode calls are: what a call reading that many
// bytes can reach here, its start and end included (of_probe as above).
// BM_PagedDecode/seqs/context/heads/kv_heads/bf16: one decode step (n = 1 new
// query row per sequence, head_dim 64) of a micro-batch of `seqs` sequences.
// Counters:
//   KV_GBps    cached K/V bytes read per second (seqs * context * kv_heads *
//              head_dim * 2 * element bytes per call)
//   of_probe   KV_GBps / the probe's GB/s (the best of 20 probe runs in
//              this process before the benchmarks: a ceiling is what the
//              machine can deliver; a run slowed by a neighbour on the shared
//              core would lower the ceiling and flatter every fraction)
//   of_alongside  KV_GBps / the GB/s of probe passes run between the calls
//              (TimedCalls: a pass whenever the calls have taken as long
//              as one, outside the timing; their total bytes over their total
//              seconds, a mean, not a best): the share of what memory gave in
//              the same minutes, on a host whose bandwidth moves. A diagnostic
//              beside of_probe, not a ceiling: it reads high when the passes
//              do. The passes roughly double each row's wall time, and each
//              empties the caches before the next call
//   KV_MB      K/V bytes one call reads
// BM_PagedDecodeInCache/...: one session's step called again on the same
// cache, whose KV stays in L3: the arithmetic's own time (KV_GBps only).
//
// BM_ExtendStep/seqs/context/d_model/heads/kv_heads/bf16_kv: the whole
// in-process decode step, AttentionLayer::Extend with one new token per
// sequence (FP32 projections, head_dim 64, full RoPE, a workspace kept across
// calls): the projections, RoPE, the append, the paged attention over
// `context` cached tokens and the output projection. Each cache holds
// context - 1 tokens before the call and is truncated back after it (outside
// the timed call). interleaved: 0, each cache's blocks filled one cache after
// another (one run of memory each); 1, the caches filled a block's tokens at
// a time, taking turns, as sessions decoding in step grow (their caches take
// runs of blocks as LayerKvCache does for any caller; one block at a time,
// their blocks alternated in memory). Counters:
//   tokens_per_s  new tokens per second (seqs per call)
//   step_us       microseconds per call
//   GBps          (KV bytes of every sequence + weight bytes once per call) / time
//   of_probe      GBps / the probe's GB/s: the fraction of the bytes/bandwidth bound
//   of_alongside  GBps / the GB/s of probe passes between the calls (as above)
//   KV_MB, weights_MB  what one call reads of each
//
// BM_Append/seqs/tokens/bf16_kv: LayerKvCache::Append alone, as a served
// step makes it: `tokens` new tokens (12 KV heads, head_dim 64) appended to
// each of `seqs` caches in turn, the caches growing to 2048 tokens and then
// truncated to empty (outside the timing), so that the calls take blocks as
// they run out, pages populated as a server's fresh blocks are. tokens 1: a
// decode step's appends; 512: a prefill chunk's. Counters:
//   ns_per_row  nanoseconds per K or V row of one KV head written
//   write_GBps  cache bytes written per second
//
// BM_FreshPages/huge: what memory the process has not touched costs here, as
// the KV pool's blocks get it: 64 MiB freshly mapped (2 MiB-aligned; huge 1:
// advised MADV_HUGEPAGE), made resident with MADV_POPULATE_WRITE as the pool
// does, then written twice. Counters:
//   populate_us_per_page  the populate call per 4 KiB page
//   first_GBps, second_GBps  the first and the second write after it (on a
//              machine where populating maps the pages for the process, the two
//              are alike)
//
// BM_Prefill/seqs/tokens/chunk/bf16_kv: a micro-batch's prefill in process,
// as `attnctl bench --decode` sends it to a server: `seqs` empty caches (the
// built-in model's shape: d_model 768, 12 heads, head_dim 64, no RoPE), each
// Extend call one chunk of `chunk` tokens for every sequence, until each
// holds `tokens`; then the caches are truncated to empty (outside the
// timing), so that every prefill takes fresh blocks. 32 sessions in chunks
// of 256 are the rounds a server computes for `attnctl bench --decode
// --sessions=32` at its default --prefill_chunk_tokens. The host's minutes
// move these rows: compare one prefill at a time, alternated
// (--benchmark_min_time=0). Counters:
//   tokens_per_s  prefilled tokens per second (seqs * tokens per prefill)
//   prefill_ms    milliseconds per prefill
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "benchmark/benchmark.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/decode/extend.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "core/decode/paged_attention.h"
#include "core/head_config.h"
#include "core/workspace.h"

namespace attnserve::core {
namespace {

// Tokens a KV block holds here: the server's default (--kv_block_tokens).
constexpr int kBenchBlockTokens = 32;

// Bytes of the last-level (L3) cache from sysfs; 32 MiB when unreadable.
int64_t L3Bytes() {
  std::ifstream file("/sys/devices/system/cpu/cpu0/cache/index3/size");
  std::string size;
  if (!(file >> size) || size.empty()) return int64_t{32} << 20;
  int64_t value = std::stoll(size);
  if (size.back() == 'K') value <<= 10;
  if (size.back() == 'M') value <<= 20;
  return value;
}

std::string CpuModel() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Sums n floats with independent accumulators in the widest vectors this CPU
// has, so that the loop waits on memory, not on the adds: a plain sum with
// one accumulator in baseline x86-64 vectors is bounded by the add's latency
// on some CPUs (18-19 GB/s on two threads of an Intel Xeon whose decode
// kernels read 21 GB/s, where this reads 24-27 GB/s; there the width counts
// too: eight 4-lane accumulators read about a fifth less than four 16-lane
// ones). Each ISA gets the vector width GCC lowers well under its target.
template <typename Lanes, int kAccumulators>
[[gnu::always_inline]] inline float SumFloatsWith(const float* data, int64_t n) {
  constexpr int64_t kLanes = sizeof(Lanes) / sizeof(float);
  constexpr int64_t kStride = kLanes * kAccumulators;
  Lanes acc[kAccumulators] = {};
  int64_t i = 0;
  for (; i + kStride <= n; i += kStride) {
    for (int k = 0; k < kAccumulators; ++k) {
      Lanes x;
      std::memcpy(&x, data + i + kLanes * k, sizeof(x));
      acc[k] += x;
    }
  }
  for (int k = 1; k < kAccumulators; ++k) acc[0] += acc[k];
  float sum = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[0][j];
  for (; i < n; ++i) sum += data[i];
  return sum;
}
using Lanes4 = float __attribute__((vector_size(16)));
using Lanes8 = float __attribute__((vector_size(32)));
using Lanes16 = float __attribute__((vector_size(64)));
__attribute__((target("avx512f"))) float SumFloatsAvx512(const float* data, int64_t n) {
  return SumFloatsWith<Lanes16, 4>(data, n);
}
__attribute__((target("avx2"))) float SumFloatsAvx2(const float* data, int64_t n) {
  return SumFloatsWith<Lanes8, 8>(data, n);
}
float SumFloats(const float* data, int64_t n) {
  static const auto sum = __builtin_cpu_supports("avx512f") ? &SumFloatsAvx512
                          : __builtin_cpu_supports("avx2")  ? &SumFloatsAvx2
                                                            : &SumFloatsWith<Lanes4, 8>;
  return sum(data, n);
}

// Sums n floats on all OpenMP threads, each its own contiguous part.
float SumFloatsOnThreads(const float* data, int64_t n) {
  float sum = 0.0f;
#pragma omp parallel reduction(+ : sum)
  {
    const int64_t threads = omp_get_num_threads();
    const int64_t thread = omp_get_thread_num();
    const int64_t begin = n * thread / threads;
    sum += SumFloats(data + begin, n * (thread + 1) / threads - begin);
  }
  return sum;
}

// Sums a large array on all OpenMP threads, each its own contiguous part; the
// array is 4x L3 and at least 256 MiB. Returns GB/s of one pass.
class ReadProbe {
 public:
  ReadProbe()
      : data_(static_cast<size_t>(std::max<int64_t>(4 * L3Bytes(), int64_t{256} << 20) / 4)) {
    const int64_t n = static_cast<int64_t>(data_.size());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) data_[static_cast<size_t>(i)] = static_cast<float>(i & 7);
  }

  // GB/s of one pass.
  double Run() { return static_cast<double>(bytes()) / PassSeconds() * 1e-9; }
  // Seconds of one pass over bytes().
  double PassSeconds() {
    const int64_t n = static_cast<int64_t>(data_.size());
    const float* data = data_.data();
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(SumFloatsOnThreads(data, n));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  int64_t bytes() const { return static_cast<int64_t>(data_.size() * sizeof(float)); }
  const float* data() const { return data_.data(); }

 private:
  std::vector<float> data_;
};

double Median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

// The probe the benchmarks share (its array stays allocated).
ReadProbe& SharedProbe() {
  static ReadProbe* const probe = new ReadProbe();
  return *probe;
}

// The probe's best GB/s of 20 runs, measured once.
double ProbeGbps() {
  static const double gbps = [] {
    ReadProbe& probe = SharedProbe();
    probe.Run();  // first touch done in the constructor; one warm pass
    double best = 0;
    for (int i = 0; i < 20; ++i) best = std::max(best, probe.Run());
    return best;
  }();
  return gbps;
}

// A benchmark's calls, timed one by one, with probe passes between them: one
// whenever the calls have taken as long as a pass since the last, outside the
// benchmark's timing, so that the probe reads in the same minutes as the
// calls. A shared host's bandwidth can move by tens of percent from one
// minute to the next (docs/measurements.md, "Decode kernels against the probe
// read beside them"): the calls' GB/s over what the passes read (total bytes
// over total seconds) is the kernel's share of what memory gave then, a
// diagnostic beside of_probe, which compares with the best the machine gave
// at start-up. Each pass (4x L3) also empties the caches before the next call.
class TimedCalls {
 public:
  explicit TimedCalls(benchmark::State& state) : state_(state) {}
  // Runs call() timed, then a probe pass when one is due.
  template <typename Call>
  void Run(const Call& call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    const double call_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++calls_;
    seconds_ += call_seconds;
    since_pass_ += call_seconds;
    if (since_pass_ >= last_pass_) {
      state_.PauseTiming();
      Pass();
      state_.ResumeTiming();
    }
  }
  int64_t calls() const { return calls_; }
  // Seconds of the calls alone.
  double seconds() const { return seconds_; }
  // GB/s over the probe passes (after the benchmark's loop; one pass if none
  // ran).
  double ProbeGbps() {
    if (passes_ == 0) Pass();
    return static_cast<double>(probe_bytes_) / probe_seconds_ * 1e-9;
  }

 private:
  void Pass() {
    ReadProbe& probe = SharedProbe();
    last_pass_ = probe.PassSeconds();
    probe_seconds_ += last_pass_;
    probe_bytes_ += probe.bytes();
    since_pass_ = 0.0;
    ++passes_;
  }

  benchmark::State& state_;
  int64_t calls_ = 0, passes_ = 0, probe_bytes_ = 0;
  double seconds_ = 0.0, since_pass_ = 0.0, last_pass_ = 0.0, probe_seconds_ = 0.0;
};

void BM_ReadProbe(benchmark::State& state) {
  ReadProbe& probe = SharedProbe();
  probe.Run();
  std::vector<double> runs;
  for (auto _ : state) runs.push_back(probe.Run());
  state.counters["GBps"] = Median(runs);
}
BENCHMARK(BM_ReadProbe)->Unit(benchmark::kMillisecond)->UseRealTime();

// The probe's array read as the KV cache's blocks would be read one KV head
// at a time: each thread's part taken as 256 KiB blocks (16 KV heads' K and
// V rows of 8 KiB: 32 FP32 tokens of head_dim 64), chunk c of every block,
// then chunk c + 1 (chunk_kib each). of_probe: GB/s over the start-up
// probe's. A memory-system fact the decode's order rests on (PagedAttention
// reads a span of blocks in every KV head before the next span).
void BM_ReadProbeByHead(benchmark::State& state) {
  constexpr int64_t kBlockBytes = 256 << 10;
  const int64_t chunk_floats = state.range(0) * 1024 / 4;
  const int64_t block_floats = kBlockBytes / 4;
  ReadProbe& probe = SharedProbe();
  const float* data = probe.data();
  const int64_t n = probe.bytes() / 4;
  std::vector<double> runs;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    float sum = 0.0f;
    int64_t floats = 0;
#pragma omp parallel reduction(+ : sum, floats)
    {
      const int64_t threads = omp_get_num_threads();
      const int64_t thread = omp_get_thread_num();
      const int64_t begin = n * thread / threads / block_floats * block_floats;
      const int64_t blocks = (n * (thread + 1) / threads - begin) / block_floats;
      for (int64_t c = 0; c < block_floats; c += chunk_floats) {
        for (int64_t b = 0; b < blocks; ++b) {
          sum += SumFloats(data + begin + b * block_floats + c, chunk_floats);
        }
      }
      floats += blocks * block_floats;
    }
    benchmark::DoNotOptimize(sum);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    runs.push_back(static_cast<double>(floats) * 4 / seconds * 1e-9);
  }
  state.counters["GBps"] = Median(runs);
  state.counters["of_probe"] = Median(runs) / ProbeGbps();
}
BENCHMARK(BM_ReadProbeByHead)
    ->ArgName("chunk_kib")
    ->Arg(4)
    ->Arg(8)
    ->Arg(16)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The probe's array read `kib` KiB per call, as a decode call reads its KV:
// each call a fresh contiguous slice (the slices rotate through the array, so
// each comes from memory), split over the OpenMP threads in one parallel
// region, timed call by call with probe passes between them (TimedCalls) like
// BM_PagedDecode's calls. What memory gives a call of that size here, its
// start (waking the threads, the first misses of each thread's part) and end
// (the threads finishing apart) included: the most a decode call reading as
// many bytes could reach. of_probe: GB/s over the start-up probe's.
void BM_ReadProbeCall(benchmark::State& state) {
  const int64_t slice_floats = state.range(0) * 1024 / 4;
  ReadProbe& probe = SharedProbe();
  const float* data = probe.data();
  const int64_t slices = probe.bytes() / 4 / slice_floats;
  TimedCalls timed(state);
  for (auto _ : state) {
    const float* slice = data + timed.calls() % slices * slice_floats;
    timed.Run([&] { benchmark::DoNotOptimize(SumFloatsOnThreads(slice, slice_floats)); });
  }
  const double gbps =
      static_cast<double>(timed.calls() * slice_floats * 4) / timed.seconds() * 1e-9;
  state.counters["GBps"] = gbps;
  state.counters["of_probe"] = gbps / ProbeGbps();
  state.counters["of_alongside"] = gbps / timed.ProbeGbps();
}
BENCHMARK(BM_ReadProbeCall)
    ->ArgName("kib")
    ->Arg(4 << 10)
    ->Arg(8 << 10)
    ->Arg(16 << 10)
    ->Arg(32 << 10)
    ->Arg(128 << 10)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Fills a cache with `context` tokens of cheap pseudo-random K/V (the values
// do not matter to the bandwidth; they are finite and varied).
void Fill(LayerKvCache& cache, int64_t context, uint32_t seed) {
  constexpr int64_t kChunk = 256;
  const int64_t row = int64_t{cache.layout().num_kv_heads} * cache.layout().head_dim;
  std::vector<float> k(static_cast<size_t>(kChunk * row)), v(k.size());
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < k.size(); ++i) {
    x = x * 1664525u + 1013904223u;
    k[i] = static_cast<float>(x >> 8) * 0x1p-24f - 0.5f;
    v[i] = static_cast<float>((x >> 4) & 0xffff) * 0x1p-16f - 0.5f;
  }
  for (int64_t done = 0; done < context; done += kChunk) {
    const int64_t n = std::min(kChunk, context - done);
    const size_t size = static_cast<size_t>(n * row);
    if (!cache.Append(absl::MakeConstSpan(k.data(), size), absl::MakeConstSpan(v.data(), size), n)
             .ok()) {
      std::abort();
    }
  }
}

// One decode step of `seqs` sequences over groups of caches: rotated so that
// their KV is >= 4x L3 (from memory), or one group called again and again
// (in_cache: its KV stays in the caches, the arithmetic's own time).
void PagedDecode(benchmark::State& state, bool in_cache) {
  const int64_t seqs = state.range(0), context = state.range(1);
  const int heads = static_cast<int>(state.range(2)), kv_heads = static_cast<int>(state.range(3));
  const KvLayout layout{kv_heads, 64, state.range(4) ? KvPrecision::kBf16 : KvPrecision::kFp32};
  const int64_t call_bytes = seqs * context * layout.token_bytes();
  const int64_t groups =
      in_cache ? 1 : std::max<int64_t>(2, (4 * L3Bytes() + call_bytes - 1) / call_bytes);
  const int block_tokens = kBenchBlockTokens;
  const int64_t blocks = groups * seqs * ((context + block_tokens - 1) / block_tokens);
  std::unique_ptr<KvBlockPool> pool =
      KvBlockPool::Create({blocks * KvBlockBytes(layout, block_tokens), block_tokens}).value();
  std::vector<std::unique_ptr<LayerKvCache>> caches;
  for (int64_t s = 0; s < groups * seqs; ++s) {
    caches.push_back(LayerKvCache::Create(pool.get(), layout).value());
    Fill(*caches.back(), context, static_cast<uint32_t>(s));
  }
  const size_t row = static_cast<size_t>(heads) * 64;
  std::vector<float> q(static_cast<size_t>(seqs) * row, 0.01f), out(q.size());
  std::vector<std::vector<PagedAttentionItem>> items(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t s = 0; s < seqs; ++s) {
      const size_t at = static_cast<size_t>(s) * row;
      items[static_cast<size_t>(g)].push_back(PagedAttentionItem{
          caches[static_cast<size_t>(g * seqs + s)].get(), heads, 1, 0.125f,
          absl::MakeConstSpan(q.data() + at, row), absl::MakeSpan(out.data() + at, row), {}, {}});
    }
  }
  for (const auto& group : items) {
    if (!PagedAttention(group).ok()) std::abort();  // warm-up, one pass over all
  }
  if (in_cache) {
    for (auto _ : state) benchmark::DoNotOptimize(PagedAttention(items[0]));
    state.counters["KV_GBps"] = benchmark::Counter(static_cast<double>(call_bytes) * 1e-9,
                                                   benchmark::Counter::kIsIterationInvariantRate);
    state.counters["KV_MB"] = static_cast<double>(call_bytes) * 1e-6;
    return;
  }
  TimedCalls timed(state);
  for (auto _ : state) {
    const auto& group = items[static_cast<size_t>(timed.calls() % groups)];
    timed.Run([&] { benchmark::DoNotOptimize(PagedAttention(group)); });
  }
  const double gbps = static_cast<double>(timed.calls() * call_bytes) / timed.seconds() * 1e-9;
  state.counters["KV_GBps"] = gbps;
  state.counters["of_probe"] = gbps / ProbeGbps();
  state.counters["of_alongside"] = gbps / timed.ProbeGbps();
  state.counters["KV_MB"] = static_cast<double>(call_bytes) * 1e-6;
  state.counters["rotated_MB"] = static_cast<double>(groups * call_bytes) * 1e-6;
}

void BM_PagedDecode(benchmark::State& state) { PagedDecode(state, /*in_cache=*/false); }
void BM_PagedDecodeInCache(benchmark::State& state) { PagedDecode(state, /*in_cache=*/true); }

void Scenarios(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seqs", "context", "heads", "kv_heads", "bf16"});
  for (int bf16 : {0, 1}) {
    b->Args({1, 4096, 16, 16, bf16});
    b->Args({1, 4096, 16, 4, bf16});
    b->Args({32, 2048, 12, 12, bf16});
    // A context this short reads almost nothing: the call's fixed cost (its
    // planning, the parallel region's fork and join), which
    // OMP_WAIT_POLICY=PASSIVE shows as the server pays it.
    b->Args({1, 64, 16, 4, bf16});
  }
}
BENCHMARK(BM_PagedDecode)->Apply(Scenarios)->Unit(benchmark::kMicrosecond)->UseRealTime();

// One session's KV called again and again, small enough to stay in L3 (4-17
// MB against the L3 printed above; the MHA row at context 2048, half the
// context of BM_PagedDecode's): the time is the arithmetic's and the caches',
// not memory's, what a step would take if memory were free. A kernel cannot
// read memory faster than it computes: KV_GBps here bounds of_probe above.
void InCacheScenarios(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seqs", "context", "heads", "kv_heads", "bf16"});
  for (int bf16 : {0, 1}) {
    b->Args({1, 2048, 16, 16, bf16});
    b->Args({1, 4096, 16, 4, bf16});
  }
}
BENCHMARK(BM_PagedDecodeInCache)
    ->Apply(InCacheScenarios)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// Groups of `seqs` caches of `context` - 1 tokens, rotated so that their KV
// is >= 4x L3, with each group's items (one new token each) over shared
// input and output rows.
struct ExtendGroups {
  std::unique_ptr<KvBlockPool> pool;
  std::vector<std::unique_ptr<LayerKvCache>> caches;
  std::vector<float> hidden, output;
  std::vector<std::vector<ExtendItem>> items;
};

// `fill_tokens`: each group's caches are filled that many tokens at a time,
// taking turns (0: each cache whole, one after another). With one block's
// tokens a turn the caches' blocks alternate in memory, as sessions decoding
// in step leave the blocks they grow by.
ExtendGroups MakeExtendGroups(const HeadConfig& config, int64_t seqs, int64_t context,
                              const KvLayout& layout, int64_t call_kv_bytes,
                              int64_t fill_tokens = 0) {
  ExtendGroups g;
  const int64_t groups = std::max<int64_t>(2, (4 * L3Bytes() + call_kv_bytes - 1) / call_kv_bytes);
  const int block_tokens = kBenchBlockTokens;
  // Room for the caches' tokens and for the blocks each may hold ahead.
  const int64_t blocks =
      groups * seqs *
      ((context + block_tokens - 1) / block_tokens + LayerKvCache::kMaxRunBlocks);
  g.pool = KvBlockPool::Create({blocks * KvBlockBytes(layout, block_tokens), block_tokens}).value();
  const size_t d = static_cast<size_t>(config.d_model);
  g.hidden.resize(static_cast<size_t>(seqs) * d);
  for (size_t i = 0; i < g.hidden.size(); ++i) g.hidden[i] = static_cast<float>(i % 17) * 0.01f;
  g.output.resize(g.hidden.size());
  for (int64_t group = 0; group < groups; ++group) {
    g.items.emplace_back();
    const size_t first = g.caches.size();
    for (int64_t s = 0; s < seqs; ++s) {
      g.caches.push_back(LayerKvCache::Create(g.pool.get(), layout).value());
    }
    const int64_t turn = fill_tokens > 0 ? fill_tokens : context - 1;
    for (int64_t done = 0; done < context - 1; done += turn) {
      for (int64_t s = 0; s < seqs; ++s) {
        Fill(*g.caches[first + static_cast<size_t>(s)], std::min(turn, context - 1 - done),
             static_cast<uint32_t>(group * seqs + s));
      }
    }
    for (int64_t s = 0; s < seqs; ++s) {
      ExtendItem item;
      item.cache = g.caches[first + static_cast<size_t>(s)].get();
      item.hidden_states = absl::MakeConstSpan(g.hidden.data() + s * d, d);
      item.first_position = context - 1;
      item.output = absl::MakeSpan(g.output.data() + s * d, d);
      g.items.back().push_back(item);
    }
  }
  return g;
}

void BM_ExtendStep(benchmark::State& state) {
  const int64_t seqs = state.range(0), context = state.range(1);
  HeadConfig requested;
  requested.d_model = state.range(2);
  requested.num_heads = state.range(3);
  requested.num_kv_heads = state.range(4);
  requested.head_dim = 64;
  requested.rotary.rotary_dim = 64;
  const HeadConfig config = ResolveHeadConfig(requested).value();
  const std::unique_ptr<AttentionLayer> layer =
      AttentionLayer::Create(config, SeededWeights(config, 7)).value();
  const KvLayout layout{static_cast<int>(config.num_kv_heads), 64,
                        state.range(5) ? KvPrecision::kBf16 : KvPrecision::kFp32};
  const int64_t kv_bytes = seqs * context * layout.token_bytes();
  const int64_t weight_bytes =
      4 * (config.d_model * (config.q_width() + 2 * config.kv_width()) +
           config.q_width() * config.d_model);
  ExtendGroups g = MakeExtendGroups(config, seqs, context, layout, kv_bytes,
                                    state.range(6) ? kBenchBlockTokens : 0);
  const std::unique_ptr<Workspace> workspace = Workspace::Create().value();
  auto step = [&](std::vector<ExtendItem>& items) {
    if (!layer->Extend(absl::MakeSpan(items), {}, workspace.get()).ok()) std::abort();
  };
  auto truncate = [&](std::vector<ExtendItem>& items) {
    for (ExtendItem& item : items) {
      if (!item.status.ok() || !item.cache->Truncate(context - 1).ok()) std::abort();
    }
  };
  for (auto& items : g.items) {  // warm-up, one pass over all
    step(items);
    truncate(items);
  }
  TimedCalls timed(state);
  for (auto _ : state) {
    std::vector<ExtendItem>& items = g.items[static_cast<size_t>(timed.calls()) % g.items.size()];
    timed.Run([&] { step(items); });
    truncate(items);
  }
  const double per_call = timed.seconds() / static_cast<double>(timed.calls());
  const double gbps = static_cast<double>(kv_bytes + weight_bytes) / per_call * 1e-9;
  state.counters["tokens_per_s"] = static_cast<double>(seqs) / per_call;
  state.counters["step_us"] = per_call * 1e6;
  state.counters["GBps"] = gbps;
  state.counters["of_probe"] = gbps / ProbeGbps();
  state.counters["of_alongside"] = gbps / timed.ProbeGbps();
  state.counters["KV_MB"] = static_cast<double>(kv_bytes) * 1e-6;
  state.counters["weights_MB"] = static_cast<double>(weight_bytes) * 1e-6;
}

// `seqs` empty caches of `layout` on a pool with room for `tokens` tokens in
// each and the blocks each may hold ahead.
struct EmptyCaches {
  std::unique_ptr<KvBlockPool> pool;
  std::vector<std::unique_ptr<LayerKvCache>> caches;
};
EmptyCaches MakeEmptyCaches(const KvLayout& layout, int64_t seqs, int64_t tokens) {
  EmptyCaches g;
  const int64_t blocks_each =
      (tokens + kBenchBlockTokens - 1) / kBenchBlockTokens + LayerKvCache::kMaxRunBlocks;
  g.pool = KvBlockPool::Create(
               {seqs * blocks_each * KvBlockBytes(layout, kBenchBlockTokens), kBenchBlockTokens})
               .value();
  for (int64_t s = 0; s < seqs; ++s) {
    g.caches.push_back(LayerKvCache::Create(g.pool.get(), layout).value());
  }
  return g;
}

void BM_Append(benchmark::State& state) {
  constexpr int64_t kContext = 2048;
  const int64_t seqs = state.range(0), tokens = state.range(1);
  const KvLayout layout{12, 64, state.range(2) ? KvPrecision::kBf16 : KvPrecision::kFp32};
  const EmptyCaches g = MakeEmptyCaches(layout, seqs, kContext);
  const auto& caches = g.caches;
  const int64_t row = int64_t{layout.num_kv_heads} * layout.head_dim;
  std::vector<float> k(static_cast<size_t>(tokens * row)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i % 29) * 0.01f;
    v[i] = static_cast<float>(i % 31) * 0.01f;
  }
  TimedCalls timed(state);
  for (auto _ : state) {
    if (caches.front()->length() + tokens > kContext) {
      state.PauseTiming();
      for (auto& cache : caches) {
        if (!cache->Truncate(0).ok()) std::abort();
      }
      state.ResumeTiming();
    }
    timed.Run([&] {
      for (auto& cache : caches) {
        if (!cache->Append(k, v, tokens).ok()) std::abort();
      }
    });
  }
  const double per_call = timed.seconds() / static_cast<double>(timed.calls());
  const double rows = static_cast<double>(seqs * tokens * 2 * layout.num_kv_heads);
  state.counters["ns_per_row"] = per_call / rows * 1e9;
  state.counters["write_GBps"] =
      rows * static_cast<double>(layout.head_dim * layout.element_bytes()) / per_call * 1e-9;
}
BENCHMARK(BM_Append)
    ->ArgNames({"seqs", "tokens", "bf16_kv"})
    ->ArgsProduct({{32}, {1, 512}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_FreshPages(benchmark::State& state) {
  constexpr size_t kBytes = size_t{64} << 20, kAlign = size_t{2} << 20;
  double populate = 0, first = 0, second = 0;
  int64_t rounds = 0;
  for (auto _ : state) {
    void* mapped = mmap(nullptr, kBytes + kAlign, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) std::abort();
    auto* data = reinterpret_cast<char*>(
        (reinterpret_cast<uintptr_t>(mapped) + kAlign - 1) / kAlign * kAlign);
    if (state.range(0) != 0) madvise(data, kBytes, MADV_HUGEPAGE);
    const auto t0 = std::chrono::steady_clock::now();
    madvise(data, kBytes, MADV_POPULATE_WRITE);
    const auto t1 = std::chrono::steady_clock::now();
    std::memset(data, 1, kBytes);
    const auto t2 = std::chrono::steady_clock::now();
    std::memset(data, 2, kBytes);
    const auto t3 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(data[kBytes - 1]);
    munmap(mapped, kBytes + kAlign);
    populate += std::chrono::duration<double>(t1 - t0).count();
    first += std::chrono::duration<double>(t2 - t1).count();
    second += std::chrono::duration<double>(t3 - t2).count();
    ++rounds;
  }
  const double bytes = static_cast<double>(kBytes) * static_cast<double>(rounds);
  state.counters["populate_us_per_page"] = populate / (bytes / 4096) * 1e6;
  state.counters["first_GBps"] = bytes / first * 1e-9;
  state.counters["second_GBps"] = bytes / second * 1e-9;
}
BENCHMARK(BM_FreshPages)
    ->ArgName("huge")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Prefill(benchmark::State& state) {
  const int64_t seqs = state.range(0), tokens = state.range(1), chunk = state.range(2);
  HeadConfig requested;
  requested.d_model = 768;
  requested.num_heads = 12;
  requested.head_dim = 64;
  const HeadConfig config = ResolveHeadConfig(requested).value();
  const std::unique_ptr<AttentionLayer> layer =
      AttentionLayer::Create(config, SeededWeights(config, 7)).value();
  const KvLayout layout{static_cast<int>(config.num_kv_heads), 64,
                        state.range(3) ? KvPrecision::kBf16 : KvPrecision::kFp32};
  const EmptyCaches g = MakeEmptyCaches(layout, seqs, tokens);
  const auto& caches = g.caches;
  const size_t rows = static_cast<size_t>(chunk * config.d_model);
  std::vector<float> hidden(static_cast<size_t>(seqs) * rows), output(hidden.size());
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = static_cast<float>(i % 23) * 0.02f - 0.2f;
  std::vector<ExtendItem> items(static_cast<size_t>(seqs));
  for (int64_t s = 0; s < seqs; ++s) {
    ExtendItem& item = items[static_cast<size_t>(s)];
    item.cache = caches[static_cast<size_t>(s)].get();
    item.hidden_states = absl::MakeConstSpan(hidden.data() + s * rows, rows);
    item.output = absl::MakeSpan(output.data() + s * rows, rows);
  }
  const std::unique_ptr<Workspace> workspace = Workspace::Create().value();
  TimedCalls timed(state);
  for (auto _ : state) {
    timed.Run([&] {
      for (int64_t done = 0; done < tokens; done += chunk) {
        if (!layer->Extend(absl::MakeSpan(items), {}, workspace.get()).ok()) std::abort();
      }
    });
    state.PauseTiming();
    for (auto& cache : caches) {
      if (!cache->Truncate(0).ok()) std::abort();
    }
    state.ResumeTiming();
  }
  const double per_prefill = timed.seconds() / static_cast<double>(timed.calls());
  state.counters["tokens_per_s"] = static_cast<double>(seqs * tokens) / per_prefill;
  state.counters["prefill_ms"] = per_prefill * 1e3;
}
BENCHMARK(BM_Prefill)
    ->ArgNames({"seqs", "tokens", "chunk", "bf16_kv"})
    ->ArgsProduct({{8, 32}, {2048}, {256, 512}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void ExtendScenarios(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seqs", "context", "d_model", "heads", "kv_heads", "bf16_kv", "interleaved"});
  for (int bf16 : {0, 1}) {
    b->Args({1, 4096, 1024, 16, 16, bf16, 0});
    b->Args({1, 4096, 1024, 16, 4, bf16, 0});
    b->Args({1, 2048, 768, 12, 12, bf16, 0});  // one session of the built-in model's shape
    b->Args({32, 2048, 768, 12, 12, bf16, 0});
    // The same sessions with their blocks alternating in memory, as a server's
    // sessions decoding in step leave the blocks they grow by.
    b->Args({32, 2048, 768, 12, 12, bf16, 1});
  }
}
BENCHMARK(BM_ExtendStep)->Apply(ExtendScenarios)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
}  // namespace attnserve::core

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const double probe = attnserve::core::ProbeGbps();
  benchmark::AddCustomContext("cpu_model", attnserve::core::CpuModel());
  benchmark::AddCustomContext("l3_bytes", std::to_string(attnserve::core::L3Bytes()));
  benchmark::AddCustomContext("omp_threads", std::to_string(omp_get_max_threads()));
  benchmark::AddCustomContext("read_probe_GBps", std::to_string(probe));
  std::printf("L3 %lld bytes, read probe %.1f GB/s on %d OpenMP threads, %s\n",
              static_cast<long long>(attnserve::core::L3Bytes()), probe, omp_get_max_threads(),
              attnserve::core::CpuModel().c_str());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
