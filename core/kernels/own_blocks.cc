#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "core/kernels/block_kernels.h"
#include "core/kernels/blocked_sdpa.h"
#include "core/kernels/online_softmax.h"
#include "core/kernels/simd.h"
#include "omp.h"

namespace attnserve::core::internal {
namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();

int64_t Line(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// A spin-wait's pause.
inline void CpuRelax() {
#ifdef ATTNSERVE_X86_INTRINSICS
  _mm_pause();
#endif
}

// SdpaBlocked on the own block kernels (core/kernels/block_kernels.h). The same work
// items; first, every key block of the chunk is packed once (per sequence,
// key/value head and key block, spread over the threads), then each item runs
// its key blocks in strips of kStripRows query rows:
//
//   S [rows, keys] = Q [rows, hd] x K^T           keys: the strip's visible
//                                                 keys rounded up to 16
//   per row: online softmax of S * scale (+ explicit mask) as above (P in
//        place, or BF16)
//   O [rows, hd] = alpha * O + P x V              (one kernel; O in the
//                                                 thread's accumulator)
//
// A strip's scores and P stay in L1; the packed K and V block in L2 serve
// every strip of the item. Causal: strips that see no key of a block skip it;
// the diagonal strips compute only the key tiles they see.
// The packed key (and BF16 value) blocks of a chunk in kBlockPacks, per
// (sequence, key/value head, key block), and their states in kPackStates. A
// block is packed by the first item that needs it, right before its use (hot
// in that thread's cache), while items needing it on other threads wait:
// 0 not packed, 1 being packed, 2 ready.
class Packs {
 public:
  Packs(const SdpaCall& call, const BlockedShape& shape, const BlockedOperands& operands,
        int64_t first, int64_t n, WorkspaceState& workspace)
      : call_(call),
        shape_(shape),
        operands_(operands),
        first_(first),
        key_blocks_(KeyBlocks(shape.t, shape.bk)),
        packed_bytes_(PackedBlocksBytes(call.bf16, shape.bk, shape.hd)),
        packed_elements_(PackedBlockElements(shape.bk, shape.hd)),
        units_(n * shape.kv_heads * key_blocks_),
        base_(workspace.data<char>(Scratch::kBlockPacks)),
        states_(workspace.data<int32_t>(Scratch::kPackStates)) {}

  int64_t bytes() const { return units_ * packed_bytes_; }
  int64_t packed_elements() const { return packed_elements_; }
  void Reset() { std::fill(states_, states_ + units_, 0); }

  // Key block kb of key/value head `group` of chunk sequence c, packed.
  const char* Get(int64_t c, int64_t group, int64_t kb) {
    const int64_t unit = (c * shape_.kv_heads + group) * key_blocks_ + kb;
    char* const to = base_ + unit * packed_bytes_;
    std::atomic_ref<int32_t> state(states_[unit]);
    if (state.load(std::memory_order_acquire) == 2) return to;
    int32_t unpacked = 0;
    if (!state.compare_exchange_strong(unpacked, 1, std::memory_order_acq_rel)) {
      while (state.load(std::memory_order_acquire) != 2) CpuRelax();
      return to;
    }
    const int64_t bk = shape_.bk;
    const int64_t bytes = shape_.operand_bytes;
    const int64_t j0 = kb * bk;
    const int64_t mk = std::min(bk, shape_.t - j0);
    const int64_t valid = std::clamp<int64_t>(call_.kv_lengths[first_ + c] - j0, 0, mk);
    const HeadRows& k = operands_.k;
    const HeadRows& v = operands_.v;
    PackKeyBlock(k.Row(c, j0, group, bytes), k.row_stride, mk, valid, shape_.hd, call_.bf16, to);
    if (call_.bf16) {
      PackValueBlockBf16(reinterpret_cast<const Bf16*>(v.Row(c, j0, group, bytes)), v.row_stride,
                         mk, valid, shape_.hd, reinterpret_cast<Bf16*>(to) + packed_elements_);
    }
    state.store(2, std::memory_order_release);
    return to;
  }

 private:
  const SdpaCall& call_;
  const BlockedShape& shape_;
  const BlockedOperands& operands_;
  const int64_t first_;
  const int64_t key_blocks_;
  const int64_t packed_bytes_;
  const int64_t packed_elements_;
  const int64_t units_;
  char* const base_;
  int32_t* const states_;
};

// One thread's part of kBlockWorkspace: a strip's scores [kStripRows,
// strip_stride] FP32 and P (BF16 only), the accumulator O [bq, hd] FP32 and
// the row state (max, sum, alpha) [bq] FP32 each, on their own cache lines.
struct ThreadBuffers {
  float* scores;
  Bf16* probs;  // nullptr in FP32: P in place of the scores
  float* acc;
  float* row_max;
  float* row_sum;
  float* row_alpha;
};
ThreadBuffers ThreadBuffersAt(char* base, const BlockedShape& shape, bool bf16) {
  const int64_t strip = kStripRows * StripStride(shape.bk);
  ThreadBuffers buffers;
  buffers.scores = reinterpret_cast<float*>(base);
  buffers.probs = bf16 ? reinterpret_cast<Bf16*>(base + Line(strip * 4)) : nullptr;
  buffers.acc = reinterpret_cast<float*>(base + Line(strip * 4) + (bf16 ? Line(strip * 2) : 0));
  buffers.row_max = buffers.acc + Line(shape.bq * shape.hd * 4) / 4;
  buffers.row_sum = buffers.row_max + shape.bq;
  buffers.row_alpha = buffers.row_sum + shape.bq;
  return buffers;
}

// Query rows [r0, r0 + rows) of a work item against key block [j0, j0 + mk)
// (packed at `block`): scores, online softmax, O = alpha O + P V.
void RunStrip(const HeadConfig& config, const SdpaCall& call, const BlockedShape& shape,
              const BlockedOperands& operands, const BlockedItem& work, int64_t b, int64_t r0,
              int64_t rows, int64_t j0, int64_t mk, const char* block, int64_t packed_elements,
              const ThreadBuffers& buffers) {
  const int64_t hd = shape.hd;
  const int64_t strip_stride = StripStride(shape.bk);
  const int64_t i0 = work.i0 + r0;
  int64_t limits[kStripRows];
  int64_t strip_limit = 0;
  for (int64_t r = 0; r < rows; ++r) {
    limits[r] = VisibleKeys(call, b, i0 + r, j0, mk);
    strip_limit = std::max(strip_limit, limits[r]);
  }
  // Only past the first key block (causal): nothing to add, alpha 1.
  if (strip_limit == 0) return;
  const int64_t tiles = (strip_limit + kKeyTile - 1) / kKeyTile;
  const HeadRows& q = operands.q;
  BlockScores(call.bf16, q.Row(work.c, i0, work.h, shape.operand_bytes), q.row_stride, rows, block,
              tiles, hd, buffers.scores, strip_stride);
  // The scale goes into the exponent, or, with a mask, before it.
  if (shape.has_mask) {
    for (int64_t r = 0; r < rows; ++r) {
      ApplyExplicitMask(call.mask, b, i0 + r, j0, limits[r], config.scale,
                        buffers.scores + r * strip_stride);
    }
  }
  const float softmax_scale = shape.has_mask ? 1.0f : config.scale;
  float* const alpha = buffers.row_alpha + r0;
  float* const acc = buffers.acc + r0 * hd;
  OnlineSoftmaxStrip(buffers.scores, strip_stride, rows, limits, tiles * kKeyTile, softmax_scale,
                     buffers.row_max + r0, buffers.row_sum + r0, alpha, buffers.probs);
  if (call.bf16) {
    BlockValuesBf16(buffers.probs, strip_stride, rows, (strip_limit + 1) / 2 * 2,
                    reinterpret_cast<const Bf16*>(block) + packed_elements, hd, alpha, j0 == 0,
                    acc, hd);
  } else {
    // FP32 values are read in place.
    const HeadRows& v = operands.v;
    const float* const v_rows =
        reinterpret_cast<const float*>(v.Row(work.c, j0, work.h / shape.g, shape.operand_bytes));
    BlockValuesFp32(buffers.scores, strip_stride, rows, strip_limit, v_rows, v.row_stride, hd,
                    alpha, j0 == 0, acc, hd);
  }
}

class OwnBlocksImpl final : public BlockedSdpa {
 public:
  absl::Status Run(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
                   const BlockedOperands& operands, WorkspaceState& workspace) const override;
};

absl::Status OwnBlocksImpl::Run(const HeadConfig& config, const SdpaCall& call, int64_t first,
                                int64_t n, const BlockedOperands& operands,
                                WorkspaceState& workspace) const {
  const BlockedShape shape(config, call, n);
  Packs packs(call, shape, operands, first, n, workspace);
  // The route sized these for call.threads and the chunk; an embedder changing
  // the thread count in between must not make the threads run past them.
  if (workspace.buffer(Scratch::kBlockWorkspace).capacity() < call.threads * shape.thread_bytes ||
      workspace.buffer(Scratch::kBlockPacks).capacity() < packs.bytes()) {
    return absl::InternalError("blocked attention: the scratch was reserved for a smaller call");
  }
  packs.Reset();
#pragma omp parallel num_threads(call.threads)
  {
    const ThreadBuffers buffers = ThreadBuffersAt(
        workspace.data<char>(Scratch::kBlockWorkspace) + omp_get_thread_num() * shape.thread_bytes,
        shape, call.bf16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < shape.items; ++item) {
      const BlockedItem work = DecodeItem(shape, item);
      const int64_t b = first + work.c;
      std::fill(buffers.row_max, buffers.row_max + work.mq, kMasked);
      std::fill(buffers.row_sum, buffers.row_sum + work.mq, 0.0f);
      // Rows past the query length are never read (they may lie in padding,
      // in the next sequence or past the end of the operand).
      const int64_t valid_rows = std::clamp<int64_t>(call.q_lengths[b] - work.i0, 0, work.mq);
      const int64_t t = shape.t;
      const int64_t key_end =
          std::min(call.kv_lengths[b], call.causal ? std::min(t, work.i0 + work.mq) : t);
      for (int64_t j0 = 0; valid_rows > 0 && j0 < key_end; j0 += shape.bk) {
        const int64_t mk = std::min(shape.bk, t - j0);
        const char* const block = packs.Get(work.c, work.h / shape.g, j0 / shape.bk);
        for (int64_t r0 = 0; r0 < valid_rows; r0 += kStripRows) {
          RunStrip(config, call, shape, operands, work, b, r0,
                   std::min(kStripRows, valid_rows - r0), j0, mk, block, packs.packed_elements(),
                   buffers);
        }
      }
      WriteContextRows(call, operands, b, work, shape.hd, buffers.acc, buffers.row_sum);
    }
  }
  return absl::OkStatus();
}

}  // namespace

const BlockedSdpa& OwnBlocks() {
  static const OwnBlocksImpl* const kInstance = new OwnBlocksImpl();
  return *kInstance;
}

}  // namespace attnserve::core::internal
