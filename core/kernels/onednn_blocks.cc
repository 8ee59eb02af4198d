#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "core/kernels/blocked_sdpa.h"
#include "core/kernels/primitives.h"
#include "core/onednn_util.h"
#include "core/kernels/online_softmax.h"
#include "core/status_macros.h"
#include "omp.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

constexpr float kMasked = -std::numeric_limits<float>::infinity();

// The blocked path. Work items are (sequence c, query head h, query block
// [i0, i0 + mq)), spread over the OpenMP threads; each runs its key blocks
// [j0, j0 + mk) in turn (bq, bk: the block sizes; the last blocks may be
// shorter) with oneDNN matmuls that run single-threaded inside the parallel
// region (oneDNN's OpenMP runtime does not nest), on 2-D views of the
// operands where HeadRows says they are (no copies; K/V of head g = h / G are
// read by each of its G query heads, from cache when the items of a group run
// in turn):
//
//   S  [mq, mk] = Q_h [mq, hd] x K_g^T [hd, mk] * scale     (K^T by strides;
//        brg on dense operands, gemm:jit on rows further apart than head_dim)
//   per row: mask (padding keys, causal, explicit), online softmax
//        (running max m, sum l; alpha = exp(m_old - m_new)), P in place (FP32)
//        or as BF16 beside it
//   PV [mq, hd] = P x V_g [mk, hd]
//   O  = alpha * O + PV, O the thread's FP32 accumulator
//   after the last key block: the item's rows of `context` = O * head_mask[h]
//        / l, FP32 or BF16 (rows with l = 0, NaN or inf -- every key masked, or
//        overflowing scores -- get 0; rows past a query length get 0 or are
//        left alone)
//
// Causal: key blocks entirely after the item's last query row are never
// computed. The primitives (at most four shapes per matmul: full and last
// blocks) are made before the parallel region; each thread has its own
// stream, workspace and oneDNN scratchpad.
// The primitives of one block shape.
struct BlockSteps {
  Step scores, values;
  memory::desc q_desc, k_t_desc, s_desc, p_desc, v_desc, pv_desc;
};
// [last query block][last key block]: full blocks and the shorter last ones.
using StepTable = BlockSteps[2][2];

// One thread's part of kBlockWorkspace: scores [bq, bk] FP32, P [bq, bk] BF16
// (BF16 only), P V [bq, hd] FP32, the accumulator O [bq, hd] FP32 and the row
// state (max, sum, alpha) [bq] FP32 each, every part on its own cache lines.
struct ThreadBuffers {
  float* scores;
  Bf16* probs;  // nullptr in FP32: P in place of the scores
  float* values;
  float* acc;
  float* row_max;
  float* row_sum;
  float* row_alpha;
};
ThreadBuffers ThreadBuffersAt(char* base, const BlockedShape& shape, bool bf16) {
  auto line = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t bq = shape.bq;
  const int64_t bk = shape.bk;
  ThreadBuffers buffers;
  buffers.scores = reinterpret_cast<float*>(base);
  buffers.probs = bf16 ? reinterpret_cast<Bf16*>(base + line(bq * bk * 4)) : nullptr;
  buffers.values =
      reinterpret_cast<float*>(base + line(bq * bk * 4) + (bf16 ? line(bq * bk * 2) : 0));
  buffers.acc = buffers.values + line(bq * shape.hd * 4) / 4;
  buffers.row_max = buffers.acc + line(bq * shape.hd * 4) / 4;
  buffers.row_sum = buffers.row_max + bq;
  buffers.row_alpha = buffers.row_sum + bq;
  return buffers;
}

// Makes (or finds) the block matmuls; returns the largest scratchpad they need.
size_t MakeBlockSteps(const HeadConfig& config, const SdpaCall& call, const BlockedShape& shape,
                      const BlockedOperands& operands, WorkspaceState& workspace,
                      StepTable& steps) {
  const auto [heads, kv_heads, g, s, t, hd, bq, bk, operand_bytes, has_mask, q_blocks, items,
              thread_bytes] = shape;
  const memory::data_type operand = OperandType(call.bf16);
  const int64_t scale_bits = std::bit_cast<int32_t>(config.scale);
  const int64_t q_stride = operands.q.row_stride;
  const int64_t k_stride = operands.k.row_stride;
  const int64_t v_stride = operands.v.row_stride;
  size_t scratchpad_bytes = 0;
  for (int last_q = 0; last_q < 2; ++last_q) {
    for (int last_k = 0; last_k < 2; ++last_k) {
      const int64_t mq = last_q ? (s - 1) % bq + 1 : bq;
      const int64_t mk = last_k ? (t - 1) % bk + 1 : bk;
      BlockSteps& step = steps[last_q][last_k];
      step.q_desc = memory::desc({mq, hd}, operand, memory::dims{q_stride, 1});
      step.k_t_desc = memory::desc({hd, mk}, operand, memory::dims{1, k_stride});
      step.s_desc = memory::desc({mq, mk}, memory::data_type::f32, Tag::ab);
      step.p_desc = memory::desc({mq, mk}, operand, Tag::ab);
      step.v_desc = memory::desc({mk, hd}, operand, memory::dims{v_stride, 1});
      step.pv_desc = memory::desc({mq, hd}, memory::data_type::f32, Tag::ab);
      step.scores = workspace.primitives.Get<dnnl::matmul>(
          {PrimitiveCache::kBlockScores, mq, mk, hd, call.bf16, q_stride, k_stride, scale_bits},
          [&] {
            dnnl::primitive_attr attr = UserScratchpad();
            attr.set_output_scales(0, {config.scale});
            return dnnl::matmul::primitive_desc(
                dnnl::matmul::desc(step.q_desc, step.k_t_desc, step.s_desc), attr,
                workspace.engine);
          });
      step.values = workspace.primitives.Get<dnnl::matmul>(
          {PrimitiveCache::kBlockValues, mq, mk, hd, call.bf16, v_stride}, [&] {
            return dnnl::matmul::primitive_desc(
                dnnl::matmul::desc(step.p_desc, step.v_desc, step.pv_desc), UserScratchpad(),
                workspace.engine);
          });
      scratchpad_bytes = std::max({scratchpad_bytes, step.scores.scratchpad.get_size(),
                                   step.values.scratchpad.get_size()});
    }
  }
  return scratchpad_bytes;
}

// Each thread's memory objects and argument arrays per block shape, kept
// across calls of the same block shapes; the blocks only move their data
// handles (oneDNN's execute then allocates only its own execution context).
void PrepareThreadArgs(const SdpaCall& call, const BlockedShape& shape,
                       const BlockedOperands& operands, const StepTable& steps, int64_t pad_stride,
                       WorkspaceState& workspace) {
  const int threads = call.threads;
  if (static_cast<int>(workspace.block_args.size()) < threads) workspace.block_args.resize(threads);
  const decltype(OneDnnBlockArgsSet::key) args_key = {
      shape.bq, shape.bk, (shape.s - 1) % shape.bq + 1, (shape.t - 1) % shape.bk + 1, shape.hd,
      call.bf16, operands.q.row_stride, operands.k.row_stride, operands.v.row_stride};
  const dnnl::engine& engine = workspace.engine;
  for (int thread = 0; thread < threads; ++thread) {
    OneDnnBlockArgsSet& set = workspace.block_args[thread];
    const ThreadBuffers buffers = ThreadBuffersAt(
        workspace.data<char>(Scratch::kBlockWorkspace) + thread * shape.thread_bytes, shape,
        call.bf16);
    void* const probs =
        buffers.probs != nullptr ? static_cast<void*>(buffers.probs) : buffers.scores;
    void* const pad = static_cast<char*>(workspace.block_scratchpads.data()) + thread * pad_stride;
    for (int last_q = 0; last_q < 2; ++last_q) {
      for (int last_k = 0; last_k < 2; ++last_k) {
        OneDnnBlockArgs& a = set.args[last_q][last_k];
        const BlockSteps& step = steps[last_q][last_k];
        if (set.key != args_key) {
          a = OneDnnBlockArgs();
          a.q = memory(step.q_desc, engine, nullptr);
          a.k_t = memory(step.k_t_desc, engine, nullptr);
          a.s = memory(step.s_desc, engine, nullptr);
          a.p = memory(step.p_desc, engine, nullptr);
          a.v = memory(step.v_desc, engine, nullptr);
          a.pv = memory(step.pv_desc, engine, nullptr);
          a.scores_args[0] = {DNNL_ARG_SRC, a.q.get()};
          a.scores_args[1] = {DNNL_ARG_WEIGHTS, a.k_t.get()};
          a.scores_args[2] = {DNNL_ARG_DST, a.s.get()};
          a.values_args[0] = {DNNL_ARG_SRC, a.p.get()};
          a.values_args[1] = {DNNL_ARG_WEIGHTS, a.v.get()};
          a.values_args[2] = {DNNL_ARG_DST, a.pv.get()};
          if (!step.scores.scratchpad.is_zero()) {
            a.scores_pad = memory(step.scores.scratchpad, engine, nullptr);
            a.scores_args[a.scores_count++] = {DNNL_ARG_SCRATCHPAD, a.scores_pad.get()};
          }
          if (!step.values.scratchpad.is_zero()) {
            a.values_pad = memory(step.values.scratchpad, engine, nullptr);
            a.values_args[a.values_count++] = {DNNL_ARG_SCRATCHPAD, a.values_pad.get()};
          }
        }
        // The buffers may have moved since (Reserve grows them).
        a.s.set_data_handle(buffers.scores);
        a.p.set_data_handle(probs);
        a.pv.set_data_handle(buffers.values);
        if (a.scores_pad) a.scores_pad.set_data_handle(pad);
        if (a.values_pad) a.values_pad.set_data_handle(pad);
      }
    }
    set.key = args_key;
  }
}

// The key blocks of one work item into buffers.acc and the row state.
// Throws dnnl::error when a matmul fails.
void RunItem(const SdpaCall& call, const BlockedShape& shape, const BlockedOperands& operands,
             const StepTable& steps, const BlockedItem& work, int64_t b, dnnl::stream& stream,
             OneDnnBlockArgs (&block_args)[2][2], const ThreadBuffers& buffers) {
  const auto [c, h, i0, mq] = work;
  const int64_t bytes = shape.operand_bytes;
  const int64_t hd = shape.hd;
  const int64_t kv_group = h / shape.g;
  const char* const q_rows = operands.q.Row(c, i0, h, bytes);
  const char* const k_base = operands.k.Row(c, 0, kv_group, bytes);
  const char* const v_base = operands.v.Row(c, 0, kv_group, bytes);
  std::fill(buffers.row_max, buffers.row_max + mq, kMasked);
  std::fill(buffers.row_sum, buffers.row_sum + mq, 0.0f);
  auto execute = [&stream](const Step& step, const dnnl_exec_arg_t* args, int count) {
    dnnl::error::wrap_c_api(dnnl_primitive_execute(step.primitive.get(), stream.get(), count, args),
                            "could not execute a primitive");
  };
  const int64_t t = shape.t;
  const int64_t key_end = std::min(call.kv_lengths[b], call.causal ? std::min(t, i0 + mq) : t);
  for (int64_t j0 = 0; j0 < key_end; j0 += shape.bk) {
    const int64_t mk = std::min(shape.bk, t - j0);
    const BlockSteps& step = steps[mq != shape.bq][mk != shape.bk];
    OneDnnBlockArgs& a = block_args[mq != shape.bq][mk != shape.bk];
    // oneDNN takes non-const handles; the operands are only read.
    a.q.set_data_handle(const_cast<char*>(q_rows));
    a.k_t.set_data_handle(const_cast<char*>(k_base + j0 * operands.k.row_stride * bytes));
    a.v.set_data_handle(const_cast<char*>(v_base + j0 * operands.v.row_stride * bytes));
    execute(step.scores, a.scores_args, a.scores_count);
    for (int64_t r = 0; r < mq; ++r) {
      float* const x = buffers.scores + r * mk;
      const int64_t limit = VisibleKeys(call, b, i0 + r, j0, mk);
      // (The scores matmul applied the scale.)
      if (shape.has_mask) ApplyExplicitMask(call.mask, b, i0 + r, j0, limit, 1.0f, x);
      buffers.row_alpha[r] =
          OnlineSoftmaxRow(x, limit, mk, 1.0f, buffers.row_max[r], buffers.row_sum[r],
                           buffers.probs != nullptr ? buffers.probs + r * mk : nullptr);
    }
    execute(step.values, a.values_args, a.values_count);
    for (int64_t r = 0; r < mq; ++r) {
      ScaleAndAdd(buffers.acc + r * hd, buffers.values + r * hd, hd, buffers.row_alpha[r],
                  j0 == 0);
    }
  }
}

class OneDnnBlocksImpl final : public BlockedSdpa {
 public:
  absl::Status Run(const HeadConfig& config, const SdpaCall& call, int64_t first, int64_t n,
                   const BlockedOperands& operands, WorkspaceState& workspace) const override;
};

absl::Status OneDnnBlocksImpl::Run(const HeadConfig& config, const SdpaCall& call, int64_t first,
                                   int64_t n, const BlockedOperands& operands,
                                   WorkspaceState& workspace) const {
  const BlockedShape shape(config, call, n);
  const int threads = call.threads;
  // The route sized the workspace for call.threads; an embedder changing the
  // thread count in between must not make the threads run past it.
  if (workspace.buffer(Scratch::kBlockWorkspace).capacity() < threads * shape.thread_bytes) {
    return absl::InternalError("blocked attention: the workspace was reserved for fewer threads");
  }
  StepTable steps;
  const size_t scratchpad_bytes = MakeBlockSteps(config, call, shape, operands, workspace, steps);
  const int64_t pad_stride = (static_cast<int64_t>(scratchpad_bytes) + 63) / 64 * 64;
  ATTNSERVE_RETURN_IF_ERROR(workspace.block_scratchpads.Reserve(threads * pad_stride));
  while (static_cast<int>(workspace.block_streams.size()) < threads) {
    workspace.block_streams.emplace_back(workspace.engine);
  }
  PrepareThreadArgs(call, shape, operands, steps, pad_stride, workspace);

  bool failed = false;
  std::string failure;
#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num();
    const ThreadBuffers buffers = ThreadBuffersAt(
        workspace.data<char>(Scratch::kBlockWorkspace) + thread * shape.thread_bytes, shape,
        call.bf16);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < shape.items; ++item) {
      const BlockedItem work = DecodeItem(shape, item);
      const int64_t b = first + work.c;
      try {
        RunItem(call, shape, operands, steps, work, b, workspace.block_streams[thread],
                workspace.block_args[thread].args, buffers);
      } catch (const dnnl::error& e) {
#pragma omp critical(attnserve_blocked_failure)
        {
          failed = true;
          failure = StatusFromDnnlError(e, "running a blocked attention matmul").ToString();
        }
      }
      WriteContextRows(call, operands, b, work, shape.hd, buffers.acc, buffers.row_sum);
    }
  }
  if (failed) return absl::InternalError(failure);
  return absl::OkStatus();
}

}  // namespace

const BlockedSdpa& OneDnnBlocks() {
  static const OneDnnBlocksImpl* const kInstance = new OneDnnBlocksImpl();
  return *kInstance;
}

}  // namespace attnserve::core::internal
