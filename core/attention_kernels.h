#ifndef ATTNSERVE_CORE_ATTENTION_KERNELS_H_
#define ATTNSERVE_CORE_ATTENTION_KERNELS_H_

// Private to core/: the oneDNN kernels shared by AttentionLayer and
// AttentionCore. The scaled dot-product attention lives here, once.

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/bf16.h"
#include "core/head_config.h"
#include "core/onednn_util.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {

// to[i] = FloatToBf16(from[i]) for i < n, on the OpenMP threads.
void ConvertToBf16(const float* from, int64_t n, Bf16* to);

// One attention call over a batch, validated, in per-sequence coordinates:
// queries of sequence b are rows [0, q_lengths[b]) of a [q_len, ...] block,
// its keys rows [0, kv_lengths[b]) of a [kv_len, ...] block.
struct SdpaCall {
  int64_t batch = 0;
  int64_t q_len = 0;                // S, the queries' max_length
  int64_t kv_len = 0;               // T, the keys' max_length
  std::vector<int64_t> q_lengths;   // [batch]
  std::vector<int64_t> kv_lengths;  // [batch]
  bool causal = false;
  ExplicitMask mask;
  absl::Span<const float> head_mask;  // empty or [num_heads]
  const MapSelection* maps = nullptr;
  bool statistics = false;
  bool bf16 = false;  // operands of the matmuls in BF16 (softmax stays FP32)
  // The blocked (flash-style) path: no maps, no statistics. Block sizes are
  // resolved (>= 1; at most q_len / kv_len) by MakeBlocked.
  bool blocked = false;
  int64_t block_queries = 0;
  int64_t block_keys = 0;
  // The blocked path runs its blocks on attnserve's own AVX-512 kernels
  // (core/block_kernels.h) rather than on oneDNN matmuls; set by MakeBlocked.
  bool own_block_kernels = false;
  // The caller's buffers (sizes validated): maps as MapSelection says,
  // statistics [batch, num_heads].
  absl::Span<float> attention_maps;
  absl::Span<float> head_entropy;
  absl::Span<float> head_max_weight;
};

// Where the blocked path finds one operand's rows: row `pos` of head h of
// the chunk's sequence c starts at element
//   (first_rows[c] + pos) * row_stride + h * head_stride
// of `data`. Dense [n, heads, len, head_dim] operands are one case
// (DenseHeadRows); the projections' token-major rows [tokens, heads *
// head_dim] another (row_stride the projection's width, head_stride head_dim,
// first_rows the sequences' row offsets). Inputs are only read.
struct HeadRows {
  void* data = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
  std::vector<int64_t> first_rows;  // [n]

  // Row `pos` of head h of sequence c, elements of element_bytes each.
  char* Row(int64_t c, int64_t pos, int64_t h, int64_t element_bytes) const {
    return static_cast<char*>(data) +
           ((first_rows[c] + pos) * row_stride + h * head_stride) * element_bytes;
  }
};

// data as [n, heads, len, head_dim], dense.
HeadRows DenseHeadRows(const void* data, int64_t n, int64_t heads, int64_t len, int64_t head_dim);

// The block sizes the blocked path uses when the caller leaves them 0,
// measured on Zen 4 (BM_BlockSizes, one configuration per process, three
// alternations; docs/measurements.md). Query blocks of 256. Causal: key
// blocks of 256 (a wider diagonal block computes more masked scores; 256 x 256
// was among the fastest at S=2048). Without a causal mask: key blocks of 1024,
// fewer block steps, each with its softmax bookkeeping and oneDNN executions:
// FP32 S=4096 86-89% of the ceiling against 85-86% with 256; BF16 S=2048
// 79-80% against 77%, S=4096 77-78% against 74-76%; S=512 takes all 512 keys
// either way. (Measured on oneDNN's block matmuls; the own block kernels ran
// 256, 512 and 1024 keys within noise of each other, causal too, so the same
// defaults serve both.)
constexpr int64_t kDefaultBlockQueries = 256;
constexpr int64_t kDefaultBlockKeysCausal = 256;
constexpr int64_t kDefaultBlockKeys = 1024;

// Sets call.blocked and resolves its block sizes from the requested ones (0:
// the defaults for call.causal), clamped to the call's lengths. Chooses the
// own block kernels where this CPU and head_dim allow them, unless the
// environment variable ATTNSERVE_BLOCK_KERNELS is "onednn" (read on each call:
// for comparing the two, and the fallback's tests).
void MakeBlocked(const HeadConfig& config, int64_t block_queries, int64_t block_keys,
                 SdpaCall& call);

// Scratch bytes AttentionKernels needs for `call` in chunks of `chunk`
// sequences (staging when `staging`, scores or blocks and packed blocks,
// masks), or nullopt on overflow.
std::optional<int64_t> KernelScratchBytes(const HeadConfig& config, const SdpaCall& call,
                                          int64_t chunk, bool staging);

// Sequences per chunk for `call` (see AttentionKernels::ChunkSequences).
int64_t ChunkFor(const HeadConfig& config, const SdpaCall& call);

// The oneDNN primitives of one layer (or core), cached by shape, with the
// stream and the scratch memory they run in. Not thread-safe: the owner
// serializes calls.
class AttentionKernels {
 public:
  // `config` must be resolved.
  AttentionKernels(const HeadConfig& config, dnnl::engine engine);
  AttentionKernels(const AttentionKernels&) = delete;
  AttentionKernels& operator=(const AttentionKernels&) = delete;

  const dnnl::engine& engine() const { return engine_; }
  void Wait() { stream_.wait(); }

  // y [rows, out] = x [rows, in] w [in, out] + b [out], row-major, w with a
  // row stride of w_stride >= out elements (a column block of a wider
  // matrix); x and w are FP32 or (bf16) BF16, b FP32, y FP32 or (y_bf16)
  // BF16.
  absl::Status Linear(int64_t rows, int64_t in, int64_t out, int64_t w_stride, bool bf16,
                      const void* x, const void* w, const float* b, void* y, bool y_bf16);

  // How many sequences one SDPA chunk takes: materialized, as many as keep
  // the scores within a budget (at least one); blocked, the whole batch (its
  // scratch is per thread, not per sequence).
  int64_t ChunkSequences(const SdpaCall& call) const;

  // Makes the scratch memory ready for chunks of up to `chunk` sequences:
  // the staging buffers below (when `staging`: the caller copies its operands
  // there) and the scores or blocks. RESOURCE_EXHAUSTED when the memory is not
  // available.
  absl::Status ReserveChunk(const SdpaCall& call, int64_t chunk, bool staging);

  // Staging for a chunk's operands, dense row-major, FP32 or (call.bf16) BF16:
  // q [chunk, num_heads, q_len, head_dim], k and v [chunk, num_kv_heads,
  // kv_len, head_dim]. Valid after ReserveChunk with staging.
  void* q_stage() const { return q_stage_.data(); }
  void* k_stage() const { return k_stage_.data(); }
  void* v_stage() const { return v_stage_.data(); }

  // Attention for sequences [first, first + n) of `call`, per head h with
  // g = h / G (G = num_heads / num_kv_heads):
  //   P_h = softmax(Q_h K_g^T * scale + mask)   (rows with every key masked: 0)
  //   P_h *= head_mask[h]
  //   context_h = P_h V_g
  // q: [n, num_heads, S, head_dim], k, v: [n, num_kv_heads, T, head_dim],
  // dense, FP32 or BF16 as call.bf16, padding positions finite (zero).
  // context: [n, num_heads, S, head_dim] FP32; rows past a query length are 0.
  // Fills the chunk's part of call's maps and statistics.
  // Runs the blocked path when call.blocked (same contract, no maps or
  // statistics).
  absl::Status Sdpa(const SdpaCall& call, int64_t first, int64_t n, const void* q, const void* k,
                    const void* v, float* context);

  // The blocked path of Sdpa (call.blocked) on operands anywhere (HeadRows):
  // the same attention, for sequences [first, first + n) of `call`, with
  // q [num_heads heads], k and v [num_kv_heads heads] in the call's operand
  // type (padding rows inside a sequence's max_length finite; rows past the
  // chunk's last sequence are never read when every sequence has the max
  // length), and context [num_heads heads] written as FP32 or (context_bf16)
  // BF16. Rows of a query past its sequence's length are written as zeros when
  // zero_rows_past_length, else left as they are (token-major outputs, where
  // such rows belong to padding or another sequence).
  absl::Status SdpaBlocked(const SdpaCall& call, int64_t first, int64_t n, const HeadRows& q,
                           const HeadRows& k, const HeadRows& v, const HeadRows& context,
                           bool context_bf16, bool zero_rows_past_length);

  // The operands of SdpaBlocked; Dense: q, k, v as Sdpa takes them (dense
  // [n, heads, len, head_dim]).
  struct Operands {
    HeadRows q, k, v;
  };
  Operands Dense(const SdpaCall& call, int64_t n, const void* q, const void* k,
                 const void* v) const;

 private:
  using Args = std::unordered_map<int, dnnl::memory>;
  using Key = std::vector<int64_t>;
  // One primitive and the scratchpad it needs.
  struct Step {
    dnnl::primitive primitive;
    dnnl::memory::desc scratchpad;
  };
  struct CacheEntry {
    Step step;
    uint64_t last_use = 0;
  };

  // The cached step for `key`, made by make() (a primitive_desc) on a miss.
  template <typename Primitive, typename MakeDesc>
  Step GetStep(const Key& key, MakeDesc make);
  absl::Status Run(const Step& step, Args args);
  dnnl::memory Memory(const dnnl::memory::desc& desc, const void* data) const;

  // Writes the additive mask of the chunk, [n, 1, G * S, T] (0 or -inf plus
  // the explicit mask; one [S, T] block per sequence, repeated G times), and
  // returns whether a valid query row has every key masked.
  bool BuildMask(const SdpaCall& call, int64_t first, int64_t n);
  // Zeroes rows past the query lengths and fully masked rows, applies the
  // head mask, accumulates the statistics. probs: [n, num_heads, S, T].
  void FinishProbabilities(const SdpaCall& call, int64_t first, int64_t n, bool dead_rows,
                           float* probs);
  // SdpaBlocked on the own block kernels (call.own_block_kernels).
  absl::Status OwnBlocks(const SdpaCall& call, int64_t first, int64_t n, const HeadRows& q,
                         const HeadRows& k, const HeadRows& v, const HeadRows& context,
                         bool context_bf16, bool zero_rows_past_length);
  // Copies the selected maps of the chunk out of probs.
  void GatherMaps(const SdpaCall& call, int64_t first, int64_t n, const float* probs);

  // Constant after construction.
  const HeadConfig config_;
  const dnnl::engine engine_;

  dnnl::stream stream_;
  std::map<Key, CacheEntry> steps_;
  uint64_t clock_ = 0;
  ScratchBuffer q_stage_, k_stage_, v_stage_;
  ScratchBuffer scores_;            // [chunk, num_heads, S, T] FP32
  ScratchBuffer probs_bf16_;        // the same in BF16, for the BF16 context matmul
  ScratchBuffer mask_;              // [chunk, G * S, T]
  std::vector<uint8_t> dead_rows_;  // [chunk, S]: every key of the row is masked
  ScratchBuffer scratchpad_;        // oneDNN's
  // Blocked path, per OpenMP thread: its workspace (scores, P, P V and row
  // state of one block), its oneDNN scratchpad, its stream and its memory
  // objects and argument arrays for the block matmuls ([last query block][last
  // key block]), kept while the block shapes stay the same.
  struct BlockArgs {
    dnnl::memory q, k_t, s, p, v, pv, scores_pad, values_pad;
    dnnl_exec_arg_t scores_args[4] = {};
    dnnl_exec_arg_t values_args[4] = {};
    int scores_count = 3;
    int values_count = 3;
  };
  // bq, bk, last mq, last mk, head_dim, bf16, the row strides of q, k, v.
  using BlockArgsKey = std::array<int64_t, 9>;
  struct BlockArgsSet {
    BlockArgsKey key = {};
    BlockArgs args[2][2];
  };
  ScratchBuffer block_workspace_;
  // The own block kernels' packed key (and BF16 value) blocks of a chunk,
  // and whether each is packed yet (read and written through
  // std::atomic_ref by the OpenMP threads).
  ScratchBuffer block_packs_;
  std::vector<int32_t> pack_states_;
  ScratchBuffer block_scratchpads_;
  std::vector<dnnl::stream> block_streams_;
  std::vector<BlockArgsSet> block_args_;
};

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_ATTENTION_KERNELS_H_
