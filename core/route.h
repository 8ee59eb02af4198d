#ifndef ATTNSERVE_CORE_ROUTE_H_
#define ATTNSERVE_CORE_ROUTE_H_

// The route of a forward: every decision about how a call runs (precision,
// materialized, blocked or paged, which block kernels, staging or reading the
// projections in place, chunking) and every scratch buffer's size, made once,
// in MakeRoute (AttentionLayer::Forward, AttentionCore::Run) or
// MakeExtendRoute (AttentionLayer::Extend, the decode route). The calls
// execute the route; a server sizes its admission with the same route
// (scratch_bytes), and the kernel-path name a response and a metric carry is
// the route's.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/attention_inputs.h"
#include "core/head_config.h"

namespace attnserve::core {

// The scratch buffers a forward works in (see Workspace), in the order a
// forward uses them. Each is sized by the route; a buffer a route does not use
// has 0 bytes.
enum class Scratch : int {
  kInputs,          // paged: the items' hidden states gathered, [R, d_model] FP32
  kInputsBf16,      // the hidden states in BF16 [R, d_model]
  kContextBf16,     // cross-attention: the context in BF16 [Rc, context_dim]
  kProjections,     // QKV [R, N], or Q [R, Hq hd] then KV [Rc, 2 Hkv hd] (FP32, or BF16 in place)
  kRotary,          // RoPE cos and sin of the queries' rows (and of the context's)
  kQStage,          // staged Q [chunk, Hq, S, hd] in the operand type; paged: [R, Hq, hd] FP32
  kKStage,          // staged K [chunk, Hkv, T, hd]; paged: [R, Hkv, hd] FP32
  kVStage,          // staged V [chunk, Hkv, T, hd]; paged: [R, Hkv, hd] FP32
  kScores,          // materialized: scores / P [chunk, Hq, S, T] FP32
  kProbsBf16,       // materialized BF16: P in BF16
  kMask,            // materialized, when anything is masked: [chunk, G S, T] FP32
  kDeadRows,        // materialized, when anything is masked: [chunk, S] bytes
  kBlockWorkspace,  // blocked: per thread, one block's scores, P, P V, accumulator, row state
  kBlockPacks,      // blocked on the own kernels: packed key (and BF16 value) blocks
  kPackStates,      // blocked on the own kernels: [chunk, Hkv, key blocks] int32
  kContextHeads,    // materialized layer: context heads [chunk, Hq, S, hd] FP32;
                    // paged BF16: [R, Hq, hd] FP32 (before conversion)
  kContextTokens,   // layer: the heads concatenated, [R, Hq hd] in the operand type
  kOutputs,         // paged: the output projection [R, d_model] FP32, before it
                    // is scattered to the items
  kCount,
};
constexpr int kScratchCount = static_cast<int>(Scratch::kCount);
// Buffers are allocated in multiples of this (a cache line, the widest vector).
constexpr int64_t kScratchAlignment = 64;

// "projections", "q_stage", ...: the buffer's name in messages and docs.
absl::string_view ScratchName(Scratch buffer);

// What a route depends on besides the head configuration and the options.
struct RouteRequest {
  SequenceLayout queries;
  // The keys' layout: the queries' again in self-attention, the context's in
  // cross-attention.
  SequenceLayout keys;
  bool cross_attention = false;
  // AttentionCore::Run: the heads come projected (no projections, no output
  // projection).
  bool projected_inputs = false;
  bool causal = false;
  ExplicitMask::Kind mask = ExplicitMask::Kind::kNone;
};

struct Route {
  // What runs: kBf16 only where asked for and Bf16Supported().
  Precision precision = Precision::kFp32;
  // The decode route (MakeExtendRoute): the new tokens' rows attend to paged
  // KV caches (core::PagedAttention); precision is the projections'.
  bool paged = false;
  // The blocked (flash-style) path, or the materialized one (maps, statistics).
  bool blocked = false;
  // Blocked: attnserve's own AVX-512 block kernels, or oneDNN's block matmuls.
  bool own_block_kernels = false;
  // Blocked: query rows and key rows per block (>= 1, at most the lengths).
  int64_t block_queries = 0;
  int64_t block_keys = 0;
  // Sequences per attention chunk (materialized: as many as keep the scores
  // within a budget; blocked: the whole batch).
  int64_t chunk = 0;
  // Q, K and V are copied into dense head-major staging (kQStage...): to
  // apply RoPE, to convert to BF16, or where padding would be read. Otherwise
  // the blocked kernels read them where they are (the projections' rows, or
  // the caller's heads).
  bool staged = true;
  // The layer's projection matmul writes BF16 (read in place in BF16).
  bool projections_bf16 = false;
  // The OpenMP threads the blocked path's per-thread buffers are sized for.
  int threads = 1;
  // Bytes of each buffer (see Scratch), in multiples of kScratchAlignment.
  std::array<int64_t, kScratchCount> bytes = {};

  bool bf16() const { return precision == Precision::kBf16; }
  int64_t bytes_of(Scratch buffer) const { return bytes[static_cast<int>(buffer)]; }
  // The sum of the buffers: the scratch memory a forward on this route
  // reserves beyond the caller's buffers (oneDNN's own scratchpads, a few
  // hundred KiB sized by its primitives, are not counted).
  int64_t scratch_bytes() const;
  // "<precision>/<path>": "fp32/materialized", "bf16/blocked", "fp32/paged", ...
  std::string kernel_path() const;
};

// Elements per row of a projection the attention reads in place
// (kProjections): `width` rounded up to whole 64-byte lines, and one line more
// where that count is even. Rows a multiple of 4 KiB apart (12 KiB for FP32
// QKV at D=1024) all fall into the same L1 sets, and the blocked kernels read
// a strip's query rows and a key block's value rows at that stride.
int64_t ProjectionRowStride(int64_t width, int64_t element_bytes);

// Every kernel_path() a route can have on this CPU (BF16 ones only where
// Bf16Supported(): elsewhere BF16 requests run FP32), for metrics that exist
// from start-up.
std::vector<std::string> KernelPathNames();

// The route of a call with these sizes and options (already validated; see
// ValidateForwardOptions). INVALID_ARGUMENT when a buffer's size overflows
// int64 (naming "layout"). Thread-safe.
absl::StatusOr<Route> MakeRoute(const HeadConfig& config, const RouteRequest& request,
                                const ForwardOptions& options);

// The route of AttentionLayer::Extend (the decode route) for a step of
// `new_tokens` (>= 0) new tokens in all, over the items that run, with
// projections in `precision` (kBf16 runs only where Bf16Supported()): paged,
// and the buffers of the new tokens' rows -- the gathered hidden states
// (kInputs, or kInputsBf16), their projections, RoPE's tables, Q, K and V
// staged token-major, the context rows (BF16: and their FP32 heads), the
// output rows. The attention reads the caches in place and its own per-call
// bookkeeping (core::PagedAttention) is not counted, nor are the caches
// (their pool has its own budget). INVALID_ARGUMENT naming "items" when a
// size overflows int64. Thread-safe.
absl::StatusOr<Route> MakeExtendRoute(const HeadConfig& config, int64_t new_tokens,
                                      Precision precision);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ROUTE_H_
