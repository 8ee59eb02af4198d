#include "core/attention_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/block_kernels.h"
#include "core/checked_math.h"
#include "core/onednn_util.h"
#include "core/online_softmax.h"
#include "core/simd.h"
#include "core/status_macros.h"
#include "omp.h"
#include "oneapi/dnnl/dnnl.hpp"

// The attention of a chunk of n sequences, S queries and T keys each, with
// G = Hq / Hkv query heads per key/value head, viewed GQA-style so that one
// K/V head serves its G query heads without a copy:
//
//   scores [n, Hkv, G*S, T] = Q [n, Hkv, G*S, hd] x K^T [n, Hkv, hd, T] * scale
//                             (+ mask [n, 1, G*S, T], a binary add post-op)
//   P = softmax(scores)       softmax_v2 over the last axis, in place, FP32
//   fix-ups                   rows with every key masked -> 0 (softmax gives
//                             NaN there), rows past a query length -> 0,
//                             P_h *= head_mask[h], statistics
//   context [n, Hkv, G*S, hd] = P x V [n, Hkv, T, hd]
//
// K^T is K read through strides (no copy; stays on brg). The mask is built
// per chunk in the one 4-D layout oneDNN 2.6 keeps on its brg kernels
// ([B, 1, M, N]; other broadcasts fall back to ref:any). Output scales apply
// before post-ops, so scores = Q K^T * scale + mask. Without anything masked
// the scores matmul has no post-op at all.

namespace attnserve::core::internal {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

constexpr memory::data_type kF32 = memory::data_type::f32;
constexpr memory::data_type kBf16 = memory::data_type::bf16;

// At most this many scores (16 MiB) are materialized at once; a chunk holds as
// many sequences as fit, and at least one.
constexpr int64_t kScoresBudget = int64_t{1} << 22;

// Primitives kept per layer; the least recently used goes. oneDNN's own
// primitive cache makes rebuilding an evicted one cheap.
constexpr size_t kMaxCachedSteps = 256;

// Below this many elements a loop runs on one thread (forking costs more).
constexpr int64_t kParallelGrain = int64_t{1} << 14;

constexpr float kMasked = -std::numeric_limits<float>::infinity();

// Cache key kinds.
enum StepKind : int64_t {
  kLinear,
  kScores,
  kSoftmax,
  kToBf16,
  kContext,
  kBlockScores,
  kBlockValues
};

int64_t Line(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// Elements per row of the own kernels' strip of scores (and of P): the key
// block rounded up to whole tiles, plus one tile so that the strip's rows do
// not all fall into the same L1 sets (at 1024 keys a power-of-two stride made
// the FP32 softmax of a strip 1.4x slower, BM_OnlineSoftmaxStrip).
int64_t StripStride(int64_t block_keys) {
  return (block_keys + kKeyTile - 1) / kKeyTile * kKeyTile + kKeyTile;
}

// Bytes of one thread's workspace on the blocked path, each part rounded up
// to a cache line. oneDNN blocks: scores [bq, bk] FP32, P [bq, bk] BF16 (BF16
// only), P V [bq, hd] FP32. Own kernels: a strip's scores [kStripRows,
// padded bk] FP32 and P (BF16 only). Both: the output accumulator [bq, hd]
// FP32 and row state [3, bq] FP32.
int64_t BlockWorkspaceBytes(const SdpaCall& call, int64_t head_dim) {
  const int64_t bq = call.block_queries;
  const int64_t bk = call.block_keys;
  const int64_t common = Line(bq * head_dim * 4) + Line(3 * bq * 4);
  if (call.own_block_kernels) {
    const int64_t strip = kStripRows * StripStride(bk);
    return Line(strip * 4) + (call.bf16 ? Line(strip * 2) : 0) + common;
  }
  return Line(bq * bk * 4) + (call.bf16 ? Line(bq * bk * 2) : 0) + Line(bq * head_dim * 4) + common;
}

// Key blocks of the blocked path (the last may be shorter).
int64_t KeyBlocks(const SdpaCall& call) {
  return (call.kv_len + call.block_keys - 1) / call.block_keys;
}

// Packed blocks of the own block kernels: per (sequence, key/value head, key
// block) the key block, and in BF16 the value block after it.
int64_t PackedBlocksBytes(const SdpaCall& call, int64_t head_dim) {
  return PackedBlockElements(call.block_keys, head_dim) * (call.bf16 ? 2 * 2 : 4);
}

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

memory::data_type OperandType(bool bf16) { return bf16 ? kBf16 : kF32; }

bool AnyShorter(absl::Span<const int64_t> lengths, int64_t first, int64_t n, int64_t full) {
  for (int64_t b = first; b < first + n; ++b) {
    if (lengths[b] < full) return true;
  }
  return false;
}

// The explicit mask's value for (sequence b, query i, key j), broadcasting.
float ExplicitValue(const ExplicitMask& mask, int64_t b, int64_t i, int64_t j) {
  const int64_t mb = mask.batch_dim == 1 ? 0 : b;
  const int64_t mi = mask.q_dim == 1 ? 0 : i;
  const int64_t mj = mask.kv_dim == 1 ? 0 : j;
  return mask.values[(mb * mask.q_dim + mi) * mask.kv_dim + mj];
}

// Whether the maps of a full selection are the chunk's probabilities as they
// are: per head, every head and every row in order.
bool MapsAreProbabilities(const MapSelection& maps, int64_t num_heads, int64_t q_len) {
  if (maps.mode != AttentionMapMode::kPerHead) return false;
  auto identity = [](const std::vector<int64_t>& selection, int64_t size) {
    if (selection.empty()) return true;
    if (static_cast<int64_t>(selection.size()) != size) return false;
    for (int64_t i = 0; i < size; ++i) {
      if (selection[i] != i) return false;
    }
    return true;
  };
  return identity(maps.heads, num_heads) && identity(maps.query_rows, q_len);
}

absl::Status Reserve(ScratchBuffer& buffer, std::initializer_list<int64_t> dims,
                     int64_t element_bytes) {
  const std::optional<int64_t> elements = CheckedProduct(dims);
  const std::optional<int64_t> bytes =
      elements ? CheckedMul(*elements, element_bytes) : std::nullopt;
  if (!bytes) return absl::ResourceExhaustedError("attention scratch memory overflows int64");
  return buffer.Reserve(*bytes);
}

// A spin-wait's pause.
inline void CpuRelax() {
#ifdef ATTNSERVE_X86_INTRINSICS
  _mm_pause();
#endif
}

// A work item of the blocked path: sequence c of the chunk, query head h,
// query rows [i0, i0 + mq). Items run c-major, then h, then query blocks.
struct BlockedItem {
  int64_t c, h, i0, mq;
};
BlockedItem DecodeItem(int64_t item, int64_t heads, int64_t q_blocks, int64_t block_queries,
                       int64_t q_len) {
  const int64_t i0 = item % q_blocks * block_queries;
  return {item / (heads * q_blocks), item / q_blocks % heads, i0,
          std::min(block_queries, q_len - i0)};
}

// Keys of key block [j0, j0 + mk) that query row i of sequence b sees before
// the explicit mask: those before the sequence's end and (causal) not after i.
int64_t VisibleKeys(const SdpaCall& call, int64_t b, int64_t i, int64_t j0, int64_t mk) {
  int64_t limit = std::clamp<int64_t>(call.kv_lengths[b] - j0, 0, mk);
  if (call.causal) limit = std::clamp<int64_t>(i + 1 - j0, 0, limit);
  return limit;
}

// Scales the scores x [limit] of row i against keys [j0, j0 + limit) and
// applies the explicit mask to them: x * scale + mask (additive) or -inf where
// the mask disallows.
void ApplyExplicitMask(const ExplicitMask& mask, int64_t b, int64_t i, int64_t j0, int64_t limit,
                       float scale, float* x) {
  for (int64_t j = 0; j < limit; ++j) {
    const float value = ExplicitValue(mask, b, i, j0 + j);
    if (mask.kind == ExplicitMask::Kind::kAllowed) {
      x[j] = value == 0.0f ? kMasked : x[j] * scale;
    } else {
      x[j] = x[j] * scale + value;
    }
  }
}

// The end of a blocked work item: rows [i0, i0 + mq) of head h of chunk
// sequence c (batch index b) of `context` = acc * head_mask[h] / l, FP32 or
// BF16; rows with l = 0, NaN or inf (every key masked, or overflowing scores):
// 0; rows past the query length: 0 or (!zero_rows_past_length) untouched.
// acc [mq, hd] is only read.
void WriteContextRows(const SdpaCall& call, int64_t b, int64_t c, int64_t h, int64_t i0, int64_t mq,
                      int64_t hd, const float* acc, const float* row_sum, const HeadRows& context,
                      bool context_bf16, bool zero_rows_past_length) {
  const float weight = call.head_mask.empty() ? 1.0f : call.head_mask[h];
  const int64_t context_bytes = context_bf16 ? 2 : 4;
  for (int64_t r = 0; r < mq; ++r) {
    const bool past_length = i0 + r >= call.q_lengths[b];
    if (past_length && !zero_rows_past_length) continue;
    char* const row = context.Row(c, i0 + r, h, context_bytes);
    const float l = row_sum[r];
    if (past_length || !(l > 0.0f) || !std::isfinite(l)) {
      std::memset(row, 0, static_cast<size_t>(hd * context_bytes));
      continue;
    }
    const float* const o = acc + r * hd;
    if (context_bf16) {
      ScaledFloatsToBf16(o, hd, weight / l, reinterpret_cast<Bf16*>(row));
    } else {
      ScaleInto(o, hd, weight / l, reinterpret_cast<float*>(row));
    }
  }
}

}  // namespace

void ConvertToBf16(const float* from, int64_t n, Bf16* to) {
  const int64_t pieces = (n + kParallelGrain - 1) / kParallelGrain;
#pragma omp parallel for schedule(static) if (pieces > 1)
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t begin = piece * kParallelGrain;
    FloatsToBf16(from + begin, std::min(kParallelGrain, n - begin), to + begin);
  }
}

AttentionKernels::AttentionKernels(const HeadConfig& config, dnnl::engine engine)
    : config_(config), engine_(std::move(engine)), stream_(engine_) {}

template <typename Primitive, typename MakeDesc>
AttentionKernels::Step AttentionKernels::GetStep(const Key& key, MakeDesc make) {
  auto it = steps_.find(key);
  if (it == steps_.end()) {
    if (steps_.size() >= kMaxCachedSteps) {
      steps_.erase(std::min_element(steps_.begin(), steps_.end(), [](const auto& a, const auto& b) {
        return a.second.last_use < b.second.last_use;
      }));
    }
    const typename Primitive::primitive_desc pd = make();
    it = steps_.emplace(key, CacheEntry{Step{Primitive(pd), pd.scratchpad_desc()}, 0}).first;
  }
  it->second.last_use = ++clock_;
  return it->second.step;
}

absl::Status AttentionKernels::Run(const Step& step, Args args) {
  if (const size_t bytes = step.scratchpad.get_size(); bytes != 0) {
    ATTNSERVE_RETURN_IF_ERROR(scratchpad_.Reserve(static_cast<int64_t>(bytes)));
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(step.scratchpad, engine_, scratchpad_.data()));
  }
  step.primitive.execute(stream_, args);
  return absl::OkStatus();
}

memory AttentionKernels::Memory(const memory::desc& desc, const void* data) const {
  // oneDNN takes non-const handles; inputs are only read.
  return memory(desc, engine_, const_cast<void*>(data));
}

absl::Status AttentionKernels::Linear(int64_t rows, int64_t in, int64_t out, int64_t w_stride,
                                      bool bf16, const void* x, const void* w, const float* b,
                                      void* y, bool y_bf16) {
  const memory::desc x_desc({rows, in}, OperandType(bf16), Tag::ab);
  const memory::desc w_desc({in, out}, OperandType(bf16), memory::dims{w_stride, 1});
  const memory::desc b_desc({1, out}, kF32, Tag::ab);
  const memory::desc y_desc({rows, out}, OperandType(y_bf16), Tag::ab);
  const Step step = GetStep<dnnl::matmul>({kLinear, rows, in, out, w_stride, bf16, y_bf16}, [&] {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_desc, w_desc, b_desc, y_desc),
                                        UserScratchpad(), engine_);
  });
  return Run(step, {{DNNL_ARG_SRC, Memory(x_desc, x)},
                    {DNNL_ARG_WEIGHTS, Memory(w_desc, w)},
                    {DNNL_ARG_BIAS, Memory(b_desc, b)},
                    {DNNL_ARG_DST, Memory(y_desc, y)}});
}

HeadRows DenseHeadRows(const void* data, int64_t n, int64_t heads, int64_t len, int64_t head_dim) {
  HeadRows rows;
  rows.data = const_cast<void*>(data);
  rows.row_stride = head_dim;
  rows.head_stride = len * head_dim;
  rows.first_rows.resize(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) rows.first_rows[c] = c * heads * len;
  return rows;
}

void MakeBlocked(const HeadConfig& config, int64_t block_queries, int64_t block_keys,
                 SdpaCall& call) {
  call.blocked = true;
  const char* const choice = std::getenv("ATTNSERVE_BLOCK_KERNELS");
  const bool onednn = choice != nullptr && std::string_view(choice) == "onednn";
  call.own_block_kernels = !onednn && OwnBlockKernelsAvailable(call.bf16, config.head_dim);
  call.block_queries =
      std::clamp<int64_t>(block_queries > 0 ? block_queries : kDefaultBlockQueries, 1, call.q_len);
  const int64_t default_keys = call.causal ? kDefaultBlockKeysCausal : kDefaultBlockKeys;
  call.block_keys = std::clamp<int64_t>(block_keys > 0 ? block_keys : default_keys, 1, call.kv_len);
}

int64_t ChunkFor(const HeadConfig& config, const SdpaCall& call) {
  // The blocked path's scratch is per thread, not per sequence.
  if (call.blocked) return call.batch;
  // One sequence at a time when its scores alone overflow (ForwardScratchBytes
  // then reports the overflow).
  const std::optional<int64_t> per_sequence =
      CheckedProduct({config.num_heads, call.q_len, call.kv_len});
  if (!per_sequence) return 1;
  return std::clamp<int64_t>(kScoresBudget / *per_sequence, 1, call.batch);
}

std::optional<int64_t> KernelScratchBytes(const HeadConfig& config, const SdpaCall& call,
                                          int64_t chunk, bool staging) {
  const int64_t operand_bytes = call.bf16 ? 2 : 4;
  const int64_t hd = config.head_dim;
  const int64_t heads = config.num_heads;
  std::optional<int64_t> total = 0;
  auto add = [&total](std::initializer_list<int64_t> dims, int64_t element_bytes) {
    const std::optional<int64_t> elements = CheckedProduct(dims);
    const std::optional<int64_t> bytes =
        elements ? CheckedMul(*elements, element_bytes) : std::nullopt;
    total = total && bytes ? CheckedAdd(*total, *bytes) : std::nullopt;
  };
  if (staging) {
    add({chunk, heads, call.q_len, hd}, operand_bytes);
    add({2, chunk, config.num_kv_heads, call.kv_len, hd}, operand_bytes);
  }
  if (call.blocked) {
    add({omp_get_max_threads(), BlockWorkspaceBytes(call, hd)}, 1);
    if (call.own_block_kernels) {
      add({chunk, config.num_kv_heads, KeyBlocks(call), PackedBlocksBytes(call, hd)}, 1);
    }
  } else {
    add({chunk, heads, call.q_len, call.kv_len}, call.bf16 ? 6 : 4);
    add({chunk, config.group_size(), call.q_len, call.kv_len}, 4);
  }
  return total;
}

int64_t AttentionKernels::ChunkSequences(const SdpaCall& call) const {
  return ChunkFor(config_, call);
}

absl::Status AttentionKernels::ReserveChunk(const SdpaCall& call, int64_t chunk, bool staging) {
  const int64_t operand_bytes = call.bf16 ? 2 : 4;
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t hd = config_.head_dim;
  if (staging) {
    ATTNSERVE_RETURN_IF_ERROR(Reserve(q_stage_, {chunk, config_.num_heads, s, hd}, operand_bytes));
    ATTNSERVE_RETURN_IF_ERROR(
        Reserve(k_stage_, {chunk, config_.num_kv_heads, t, hd}, operand_bytes));
    ATTNSERVE_RETURN_IF_ERROR(
        Reserve(v_stage_, {chunk, config_.num_kv_heads, t, hd}, operand_bytes));
  }
  if (call.blocked) {
    if (call.own_block_kernels) {
      ATTNSERVE_RETURN_IF_ERROR(
          Reserve(block_packs_,
                  {chunk, config_.num_kv_heads, KeyBlocks(call), PackedBlocksBytes(call, hd)}, 1));
    }
    return Reserve(block_workspace_, {omp_get_max_threads(), BlockWorkspaceBytes(call, hd)}, 1);
  }
  ATTNSERVE_RETURN_IF_ERROR(Reserve(scores_, {chunk, config_.num_heads, s, t}, 4));
  if (call.bf16) {
    ATTNSERVE_RETURN_IF_ERROR(Reserve(probs_bf16_, {chunk, config_.num_heads, s, t}, 2));
  }
  const bool may_mask = call.causal || call.mask.kind != ExplicitMask::Kind::kNone ||
                        AnyShorter(call.kv_lengths, 0, call.batch, t);
  if (may_mask) {
    ATTNSERVE_RETURN_IF_ERROR(Reserve(mask_, {chunk, config_.group_size(), s, t}, 4));
    dead_rows_.resize(static_cast<size_t>(chunk * s));
  }
  return absl::OkStatus();
}

bool AttentionKernels::BuildMask(const SdpaCall& call, int64_t first, int64_t n) {
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t g = config_.group_size();
  const ExplicitMask& explicit_mask = call.mask;
  float* const mask = mask_.floats();
  uint8_t* const dead = dead_rows_.data();
#pragma omp parallel for schedule(static) if (n * s * t * g > kParallelGrain)
  for (int64_t row = 0; row < n * s; ++row) {
    const int64_t c = row / s;
    const int64_t i = row % s;
    const int64_t b = first + c;
    const int64_t kv_length = call.kv_lengths[b];
    const int64_t visible = call.causal ? std::min(kv_length, i + 1) : kv_length;
    float* const out = mask + (c * g * s + i) * t;
    bool alive = false;
    for (int64_t j = 0; j < t; ++j) {
      float value = j < visible ? 0.0f : kMasked;
      if (j < visible) {
        switch (explicit_mask.kind) {
          case ExplicitMask::Kind::kNone:
            break;
          case ExplicitMask::Kind::kAllowed:
            if (ExplicitValue(explicit_mask, b, i, j) == 0.0f) value = kMasked;
            break;
          case ExplicitMask::Kind::kAdditive:
            value = ExplicitValue(explicit_mask, b, i, j);
            break;
        }
      }
      out[j] = value;
      alive = alive || value != kMasked;
    }
    // Rows past the query length are never read into a result.
    dead[row] = !alive && i < call.q_lengths[b];
    for (int64_t group = 1; group < g; ++group) {
      std::memcpy(out + group * s * t, out, static_cast<size_t>(t) * sizeof(float));
    }
  }
  return std::any_of(dead, dead + n * s, [](uint8_t d) { return d != 0; });
}

void AttentionKernels::FinishProbabilities(const SdpaCall& call, int64_t first, int64_t n,
                                           bool dead_rows, float* probs) {
  const int64_t heads = config_.num_heads;
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const uint8_t* const dead = dead_rows ? dead_rows_.data() : nullptr;
#pragma omp parallel for schedule(static) if (n * heads * s * t > kParallelGrain)
  for (int64_t item = 0; item < n * heads; ++item) {
    const int64_t c = item / heads;
    const int64_t h = item % heads;
    const int64_t b = first + c;
    const int64_t q_length = call.q_lengths[b];
    const int64_t kv_length = call.kv_lengths[b];
    const float weight = call.head_mask.empty() ? 1.0f : call.head_mask[h];
    double entropy_sum = 0.0;
    double max_sum = 0.0;
    for (int64_t i = 0; i < s; ++i) {
      float* const row = probs + (item * s + i) * t;
      if (i >= q_length || (dead != nullptr && dead[c * s + i] != 0)) {
        std::fill(row, row + t, 0.0f);  // a fully masked row counts 0 in the statistics
        continue;
      }
      if (weight != 1.0f) {
        for (int64_t j = 0; j < t; ++j) row[j] *= weight;
      }
      if (call.statistics) {
        double entropy = 0.0;
        float max_weight = 0.0f;
        for (int64_t j = 0; j < kv_length; ++j) {  // masked keys are 0
          const float p = row[j];
          if (p > 0.0f) entropy -= static_cast<double>(p) * std::log(static_cast<double>(p));
          max_weight = std::max(max_weight, p);
        }
        entropy_sum += entropy;
        max_sum += max_weight;
      }
    }
    if (call.statistics) {
      call.head_entropy[b * heads + h] = static_cast<float>(entropy_sum / q_length);
      call.head_max_weight[b * heads + h] = static_cast<float>(max_sum / q_length);
    }
  }
}

void AttentionKernels::GatherMaps(const SdpaCall& call, int64_t first, int64_t n,
                                  const float* probs) {
  const MapSelection& maps = *call.maps;
  const int64_t heads = config_.num_heads;
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t rows = maps.query_rows.empty() ? s : static_cast<int64_t>(maps.query_rows.size());
  auto query_row = [&maps](int64_t r) { return maps.query_rows.empty() ? r : maps.query_rows[r]; };
  float* const out = call.attention_maps.data();
  if (maps.mode == AttentionMapMode::kPerHead) {
    const int64_t selected = maps.heads.empty() ? heads : static_cast<int64_t>(maps.heads.size());
#pragma omp parallel for schedule(static) if (n * selected * rows * t > kParallelGrain)
    for (int64_t item = 0; item < n * selected * rows; ++item) {
      const int64_t c = item / (selected * rows);
      const int64_t sh = item / rows % selected;
      const int64_t r = item % rows;
      const int64_t h = maps.heads.empty() ? sh : maps.heads[sh];
      const float* const from = probs + ((c * heads + h) * s + query_row(r)) * t;
      std::memcpy(out + ((first + c) * selected * rows + sh * rows + r) * t, from,
                  static_cast<size_t>(t) * sizeof(float));
    }
  } else if (maps.mode == AttentionMapMode::kMeanOverHeads) {
    const float inverse_heads = static_cast<float>(1.0 / static_cast<double>(heads));
#pragma omp parallel for schedule(static) if (n * rows * heads * t > kParallelGrain)
    for (int64_t item = 0; item < n * rows; ++item) {
      const int64_t c = item / rows;
      const int64_t r = item % rows;
      float* const to = out + ((first + c) * rows + r) * t;
      std::fill(to, to + t, 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* const from = probs + ((c * heads + h) * s + query_row(r)) * t;
        for (int64_t j = 0; j < t; ++j) to[j] += from[j];
      }
      for (int64_t j = 0; j < t; ++j) to[j] *= inverse_heads;
    }
  }
}

AttentionKernels::Operands AttentionKernels::Dense(const SdpaCall& call, int64_t n, const void* q,
                                                   const void* k, const void* v) const {
  const int64_t hd = config_.head_dim;
  return {DenseHeadRows(q, n, config_.num_heads, call.q_len, hd),
          DenseHeadRows(k, n, config_.num_kv_heads, call.kv_len, hd),
          DenseHeadRows(v, n, config_.num_kv_heads, call.kv_len, hd)};
}

absl::Status AttentionKernels::Sdpa(const SdpaCall& call, int64_t first, int64_t n, const void* q,
                                    const void* k, const void* v, float* context) {
  const int64_t heads = config_.num_heads;
  const int64_t kv_heads = config_.num_kv_heads;
  const int64_t g = config_.group_size();
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t hd = config_.head_dim;
  if (call.blocked) {
    const Operands dense = Dense(call, n, q, k, v);
    return SdpaBlocked(call, first, n, dense.q, dense.k, dense.v,
                       DenseHeadRows(context, n, heads, s, hd), /*context_bf16=*/false,
                       /*zero_rows_past_length=*/true);
  }
  const memory::data_type operand = OperandType(call.bf16);

  const bool masked = call.causal || call.mask.kind != ExplicitMask::Kind::kNone ||
                      AnyShorter(call.kv_lengths, first, n, t);
  const bool dead_rows = masked && BuildMask(call, first, n);

  // With all per-head maps asked for, the probabilities go straight to the
  // caller's buffer.
  const bool direct_maps = MapsAreProbabilities(*call.maps, heads, s);
  float* const probs =
      direct_maps ? call.attention_maps.data() + first * heads * s * t : scores_.floats();

  // scores = Q K^T * scale (+ mask)
  const memory::desc q_desc({n, kv_heads, g * s, hd}, operand, Tag::abcd);
  const memory::desc k_t_desc({n, kv_heads, hd, t}, operand, Tag::abdc);
  const memory::desc scores_desc({n, kv_heads, g * s, t}, kF32, Tag::abcd);
  const memory::desc mask_desc({n, 1, g * s, t}, kF32, Tag::abcd);
  const Step scores = GetStep<dnnl::matmul>({kScores, n, s, t, call.bf16, masked}, [&] {
    dnnl::primitive_attr attr = UserScratchpad();
    attr.set_output_scales(0, {config_.scale});
    if (masked) {
      dnnl::post_ops post_ops;
      post_ops.append_binary(dnnl::algorithm::binary_add, mask_desc);
      attr.set_post_ops(post_ops);
    }
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(q_desc, k_t_desc, scores_desc), attr,
                                        engine_);
  });
  Args scores_args = {{DNNL_ARG_SRC, Memory(q_desc, q)},
                      {DNNL_ARG_WEIGHTS, Memory(k_t_desc, k)},
                      {DNNL_ARG_DST, Memory(scores_desc, probs)}};
  if (masked) {
    scores_args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1,
                        Memory(mask_desc, mask_.data()));
  }
  ATTNSERVE_RETURN_IF_ERROR(Run(scores, std::move(scores_args)));

  // P = softmax(scores), rows of [n * Hq * S, T], in place.
  const memory::desc rows_desc({n * heads * s, t}, kF32, Tag::ab);
  const Step softmax = GetStep<dnnl::softmax_v2_forward>({kSoftmax, n * heads * s, t}, [&] {
    return dnnl::softmax_v2_forward::primitive_desc(
        dnnl::softmax_v2_forward::desc(dnnl::prop_kind::forward_inference,
                                       dnnl::algorithm::softmax_accurate, rows_desc, rows_desc,
                                       /*softmax_axis=*/1),
        UserScratchpad(), engine_);
  });
  const memory probs_rows = Memory(rows_desc, probs);
  ATTNSERVE_RETURN_IF_ERROR(Run(softmax, {{DNNL_ARG_SRC, probs_rows}, {DNNL_ARG_DST, probs_rows}}));
  // A row whose scores overflowed (all -inf after an additive mask, or +inf
  // from huge inputs) leaves softmax as NaN in every entry (its sum is NaN):
  // it gets weights 0, like a fully masked row. One entry tells.
  const int64_t prob_rows = n * heads * s;
#pragma omp parallel for schedule(static) if (prob_rows > kParallelGrain / 64)
  for (int64_t r = 0; r < prob_rows; ++r) {
    float* const row = probs + r * t;
    if (std::isnan(row[0])) std::fill(row, row + t, 0.0f);
  }

  const bool reweighted =
      std::any_of(call.head_mask.begin(), call.head_mask.end(), [](float w) { return w != 1.0f; });
  if (dead_rows || reweighted || call.statistics || AnyShorter(call.q_lengths, first, n, s)) {
    FinishProbabilities(call, first, n, dead_rows, probs);
  }
  if (!direct_maps) GatherMaps(call, first, n, probs);

  // context = P V
  const void* p = probs;
  if (call.bf16) {
    const memory::desc bf16_rows_desc({n * heads * s, t}, kBf16, Tag::ab);
    const Step to_bf16 = GetStep<dnnl::reorder>({kToBf16, n * heads * s, t}, [&] {
      return dnnl::reorder::primitive_desc(engine_, rows_desc, engine_, bf16_rows_desc,
                                           UserScratchpad());
    });
    ATTNSERVE_RETURN_IF_ERROR(Run(
        to_bf16,
        {{DNNL_ARG_FROM, probs_rows}, {DNNL_ARG_TO, Memory(bf16_rows_desc, probs_bf16_.data())}}));
    p = probs_bf16_.data();
  }
  const memory::desc p_desc({n, kv_heads, g * s, t}, operand, Tag::abcd);
  const memory::desc v_desc({n, kv_heads, t, hd}, operand, Tag::abcd);
  const memory::desc context_desc({n, kv_heads, g * s, hd}, kF32, Tag::abcd);
  const Step context_mm = GetStep<dnnl::matmul>({kContext, n, s, t, call.bf16}, [&] {
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(p_desc, v_desc, context_desc),
                                        UserScratchpad(), engine_);
  });
  return Run(context_mm, {{DNNL_ARG_SRC, Memory(p_desc, p)},
                          {DNNL_ARG_WEIGHTS, Memory(v_desc, v)},
                          {DNNL_ARG_DST, Memory(context_desc, context)}});
}

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
absl::Status AttentionKernels::SdpaBlocked(const SdpaCall& call, int64_t first, int64_t n,
                                           const HeadRows& q, const HeadRows& k, const HeadRows& v,
                                           const HeadRows& context, bool context_bf16,
                                           bool zero_rows_past_length) {
  if (call.own_block_kernels) {
    return OwnBlocks(call, first, n, q, k, v, context, context_bf16, zero_rows_past_length);
  }
  const int64_t heads = config_.num_heads;
  const int64_t g = config_.group_size();
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t hd = config_.head_dim;
  const int64_t bq = call.block_queries;
  const int64_t bk = call.block_keys;
  const memory::data_type operand = OperandType(call.bf16);
  const int64_t operand_bytes = call.bf16 ? 2 : 4;
  const ExplicitMask& explicit_mask = call.mask;
  const bool has_mask = explicit_mask.kind != ExplicitMask::Kind::kNone;

  // The primitives, [last query block][last key block].
  struct BlockSteps {
    Step scores, values;
    memory::desc q_desc, k_t_desc, s_desc, p_desc, v_desc, pv_desc;
  };
  BlockSteps steps[2][2];
  size_t scratchpad_bytes = 0;
  for (int last_q = 0; last_q < 2; ++last_q) {
    for (int last_k = 0; last_k < 2; ++last_k) {
      const int64_t mq = last_q ? (s - 1) % bq + 1 : bq;
      const int64_t mk = last_k ? (t - 1) % bk + 1 : bk;
      BlockSteps& step = steps[last_q][last_k];
      step.q_desc = memory::desc({mq, hd}, operand, memory::dims{q.row_stride, 1});
      step.k_t_desc = memory::desc({hd, mk}, operand, memory::dims{1, k.row_stride});
      step.s_desc = memory::desc({mq, mk}, kF32, Tag::ab);
      step.p_desc = memory::desc({mq, mk}, operand, Tag::ab);
      step.v_desc = memory::desc({mk, hd}, operand, memory::dims{v.row_stride, 1});
      step.pv_desc = memory::desc({mq, hd}, kF32, Tag::ab);
      step.scores = GetStep<dnnl::matmul>(
          {kBlockScores, mq, mk, hd, call.bf16, q.row_stride, k.row_stride}, [&] {
            dnnl::primitive_attr attr = UserScratchpad();
            attr.set_output_scales(0, {config_.scale});
            return dnnl::matmul::primitive_desc(
                dnnl::matmul::desc(step.q_desc, step.k_t_desc, step.s_desc), attr, engine_);
          });
      step.values = GetStep<dnnl::matmul>({kBlockValues, mq, mk, hd, call.bf16, v.row_stride}, [&] {
        return dnnl::matmul::primitive_desc(
            dnnl::matmul::desc(step.p_desc, step.v_desc, step.pv_desc), UserScratchpad(),
            engine_);
      });
      scratchpad_bytes = std::max({scratchpad_bytes, step.scores.scratchpad.get_size(),
                                   step.values.scratchpad.get_size()});
    }
  }
  const int threads = omp_get_max_threads();
  const int64_t pad_stride = (static_cast<int64_t>(scratchpad_bytes) + 63) / 64 * 64;
  ATTNSERVE_RETURN_IF_ERROR(Reserve(block_scratchpads_, {threads, pad_stride}, 1));
  while (static_cast<int>(block_streams_.size()) < threads) block_streams_.emplace_back(engine_);
  const int64_t workspace_bytes = BlockWorkspaceBytes(call, hd);
  // ReserveChunk sized the workspace for omp_get_max_threads() of the same
  // thread; an embedder changing the thread count in between must not make
  // the threads run past it.
  if (block_workspace_.capacity() < threads * workspace_bytes) {
    return absl::InternalError("blocked attention: the workspace was reserved for fewer threads");
  }

  // Each thread's memory objects and argument arrays per block shape, kept
  // across calls of the same block shapes; the blocks only move their data
  // handles (oneDNN's execute then allocates only its own execution context).
  if (static_cast<int>(block_args_.size()) < threads) block_args_.resize(threads);
  const BlockArgsKey args_key = {bq,        bk,           (s - 1) % bq + 1, (t - 1) % bk + 1, hd,
                                 call.bf16, q.row_stride, k.row_stride,     v.row_stride};
  for (int thread = 0; thread < threads; ++thread) {
    BlockArgsSet& set = block_args_[thread];
    char* const workspace = static_cast<char*>(block_workspace_.data()) + thread * workspace_bytes;
    auto line = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
    void* const scores = workspace;
    void* const probs = call.bf16 ? workspace + line(bq * bk * 4) : scores;
    void* const values = workspace + line(bq * bk * 4) + (call.bf16 ? line(bq * bk * 2) : 0);
    void* const pad = static_cast<char*>(block_scratchpads_.data()) + thread * pad_stride;
    for (int last_q = 0; last_q < 2; ++last_q) {
      for (int last_k = 0; last_k < 2; ++last_k) {
        BlockArgs& a = set.args[last_q][last_k];
        const BlockSteps& step = steps[last_q][last_k];
        if (set.key != args_key) {
          a = BlockArgs();
          a.q = memory(step.q_desc, engine_, nullptr);
          a.k_t = memory(step.k_t_desc, engine_, nullptr);
          a.s = memory(step.s_desc, engine_, nullptr);
          a.p = memory(step.p_desc, engine_, nullptr);
          a.v = memory(step.v_desc, engine_, nullptr);
          a.pv = memory(step.pv_desc, engine_, nullptr);
          a.scores_args[0] = {DNNL_ARG_SRC, a.q.get()};
          a.scores_args[1] = {DNNL_ARG_WEIGHTS, a.k_t.get()};
          a.scores_args[2] = {DNNL_ARG_DST, a.s.get()};
          a.values_args[0] = {DNNL_ARG_SRC, a.p.get()};
          a.values_args[1] = {DNNL_ARG_WEIGHTS, a.v.get()};
          a.values_args[2] = {DNNL_ARG_DST, a.pv.get()};
          if (!step.scores.scratchpad.is_zero()) {
            a.scores_pad = memory(step.scores.scratchpad, engine_, nullptr);
            a.scores_args[a.scores_count++] = {DNNL_ARG_SCRATCHPAD, a.scores_pad.get()};
          }
          if (!step.values.scratchpad.is_zero()) {
            a.values_pad = memory(step.values.scratchpad, engine_, nullptr);
            a.values_args[a.values_count++] = {DNNL_ARG_SCRATCHPAD, a.values_pad.get()};
          }
        }
        // The buffers may have moved since (Reserve grows them).
        a.s.set_data_handle(scores);
        a.p.set_data_handle(probs);
        a.pv.set_data_handle(values);
        if (a.scores_pad) a.scores_pad.set_data_handle(pad);
        if (a.values_pad) a.values_pad.set_data_handle(pad);
      }
    }
    set.key = args_key;
  }

  const int64_t q_blocks = (s + bq - 1) / bq;
  const int64_t items = n * heads * q_blocks;
  bool failed = false;
  std::string failure;
#pragma omp parallel num_threads(threads)
  {
    const int thread = omp_get_thread_num();
    char* const workspace = static_cast<char*>(block_workspace_.data()) + thread * workspace_bytes;
    auto line = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
    float* const scores = reinterpret_cast<float*>(workspace);
    Bf16* const probs =
        call.bf16 ? reinterpret_cast<Bf16*>(workspace + line(bq * bk * 4)) : nullptr;
    float* const values = reinterpret_cast<float*>(workspace + line(bq * bk * 4) +
                                                   (call.bf16 ? line(bq * bk * 2) : 0));
    float* const acc = values + line(bq * hd * 4) / 4;  // [mq, hd]: sum of P V so far
    float* const row_max = acc + line(bq * hd * 4) / 4;
    float* const row_sum = row_max + bq;
    float* const row_alpha = row_sum + bq;
    dnnl::stream& stream = block_streams_[thread];
    BlockArgs (&block_args)[2][2] = block_args_[thread].args;
    auto execute = [&stream](const Step& step, const dnnl_exec_arg_t* args, int count) {
      dnnl::error::wrap_c_api(
          dnnl_primitive_execute(step.primitive.get(), stream.get(), count, args),
          "could not execute a primitive");
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const auto [c, h, i0, mq] = DecodeItem(item, heads, q_blocks, bq, s);
      const int64_t b = first + c;
      const int64_t kv_group = h / g;
      const char* const q_rows = q.Row(c, i0, h, operand_bytes);
      const char* const k_base = k.Row(c, 0, kv_group, operand_bytes);
      const char* const v_base = v.Row(c, 0, kv_group, operand_bytes);
      std::fill(row_max, row_max + mq, kMasked);
      std::fill(row_sum, row_sum + mq, 0.0f);
      const int64_t key_end =
          std::min(call.kv_lengths[b], call.causal ? std::min(t, i0 + mq) : t);
      try {
        for (int64_t j0 = 0; j0 < key_end; j0 += bk) {
          const int64_t mk = std::min(bk, t - j0);
          const BlockSteps& step = steps[mq != bq][mk != bk];
          BlockArgs& a = block_args[mq != bq][mk != bk];
          const char* const k_rows = k_base + j0 * k.row_stride * operand_bytes;
          const char* const v_rows = v_base + j0 * v.row_stride * operand_bytes;
          // oneDNN takes non-const handles; the operands are only read.
          a.q.set_data_handle(const_cast<char*>(q_rows));
          a.k_t.set_data_handle(const_cast<char*>(k_rows));
          a.v.set_data_handle(const_cast<char*>(v_rows));
          execute(step.scores, a.scores_args, a.scores_count);
          for (int64_t r = 0; r < mq; ++r) {
            float* const x = scores + r * mk;
            const int64_t limit = VisibleKeys(call, b, i0 + r, j0, mk);
            // (The scores matmul applied the scale.)
            if (has_mask) ApplyExplicitMask(explicit_mask, b, i0 + r, j0, limit, 1.0f, x);
            row_alpha[r] = OnlineSoftmaxRow(x, limit, mk, 1.0f, row_max[r], row_sum[r],
                                            probs != nullptr ? probs + r * mk : nullptr);
          }
          execute(step.values, a.values_args, a.values_count);
          for (int64_t r = 0; r < mq; ++r) {
            ScaleAndAdd(acc + r * hd, values + r * hd, hd, row_alpha[r], j0 == 0);
          }
        }
      } catch (const dnnl::error& e) {
#pragma omp critical(attnserve_blocked_failure)
        {
          failed = true;
          failure = StatusFromDnnlError(e, "running a blocked attention matmul").ToString();
        }
      }
      WriteContextRows(call, b, c, h, i0, mq, hd, acc, row_sum, context, context_bf16,
                       zero_rows_past_length);
    }
  }
  if (failed) return absl::InternalError(failure);
  return absl::OkStatus();
}

// SdpaBlocked on the own block kernels (core/block_kernels.h). The same work
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
absl::Status AttentionKernels::OwnBlocks(const SdpaCall& call, int64_t first, int64_t n,
                                         const HeadRows& q, const HeadRows& k, const HeadRows& v,
                                         const HeadRows& context, bool context_bf16,
                                         bool zero_rows_past_length) {
  const int64_t heads = config_.num_heads;
  const int64_t kv_heads = config_.num_kv_heads;
  const int64_t g = config_.group_size();
  const int64_t s = call.q_len;
  const int64_t t = call.kv_len;
  const int64_t hd = config_.head_dim;
  const int64_t bq = call.block_queries;
  const int64_t bk = call.block_keys;
  const bool bf16 = call.bf16;
  const int64_t operand_bytes = bf16 ? 2 : 4;
  const ExplicitMask& explicit_mask = call.mask;
  const bool has_mask = explicit_mask.kind != ExplicitMask::Kind::kNone;
  const float softmax_scale = has_mask ? 1.0f : config_.scale;
  const int64_t key_blocks = KeyBlocks(call);
  const int64_t packed_elements = PackedBlockElements(bk, hd);
  const int64_t packed_bytes = PackedBlocksBytes(call, hd);
  const int64_t strip_stride = StripStride(bk);
  const int threads = omp_get_max_threads();
  const int64_t workspace_bytes = BlockWorkspaceBytes(call, hd);
  // ReserveChunk sized these for omp_get_max_threads() and the chunk; an
  // embedder changing the thread count in between must not make the threads
  // run past them.
  if (block_workspace_.capacity() < threads * workspace_bytes ||
      block_packs_.capacity() < n * kv_heads * key_blocks * packed_bytes) {
    return absl::InternalError("blocked attention: the scratch was reserved for a smaller call");
  }
  char* const packs = static_cast<char*>(block_packs_.data());
  auto packed_block = [&](int64_t c, int64_t group, int64_t kb) {
    return packs + ((c * kv_heads + group) * key_blocks + kb) * packed_bytes;
  };

  // Each block is packed by the first item that needs it, right before its
  // use (hot in that thread's cache), while items needing it on the other
  // threads wait: 0 not packed, 1 being packed, 2 ready.
  const int64_t units = n * kv_heads * key_blocks;
  pack_states_.assign(static_cast<size_t>(units), 0);  // capacity kept: no allocation
  auto ensure_packed = [&](int64_t c, int64_t group, int64_t kb) {
    std::atomic_ref<int32_t> state(pack_states_[(c * kv_heads + group) * key_blocks + kb]);
    if (state.load(std::memory_order_acquire) == 2) return;
    int32_t unpacked = 0;
    if (!state.compare_exchange_strong(unpacked, 1, std::memory_order_acq_rel)) {
      while (state.load(std::memory_order_acquire) != 2) CpuRelax();
      return;
    }
    const int64_t j0 = kb * bk;
    const int64_t mk = std::min(bk, t - j0);
    const int64_t valid = std::clamp<int64_t>(call.kv_lengths[first + c] - j0, 0, mk);
    char* const to = packed_block(c, group, kb);
    PackKeyBlock(k.Row(c, j0, group, operand_bytes), k.row_stride, mk, valid, hd, bf16, to);
    if (bf16) {
      PackValueBlockBf16(reinterpret_cast<const Bf16*>(v.Row(c, j0, group, operand_bytes)),
                         v.row_stride, mk, valid, hd,
                         reinterpret_cast<Bf16*>(to) + packed_elements);
    }
    state.store(2, std::memory_order_release);
  };

  const int64_t q_blocks = (s + bq - 1) / bq;
  const int64_t items = n * heads * q_blocks;
#pragma omp parallel num_threads(threads)
  {

    char* const workspace =
        static_cast<char*>(block_workspace_.data()) + omp_get_thread_num() * workspace_bytes;
    float* const scores = reinterpret_cast<float*>(workspace);  // [kStripRows, strip_stride]
    const int64_t scores_bytes = Line(kStripRows * strip_stride * 4);
    Bf16* const probs = bf16 ? reinterpret_cast<Bf16*>(workspace + scores_bytes) : nullptr;
    float* const acc = reinterpret_cast<float*>(workspace + scores_bytes +
                                                (bf16 ? Line(kStripRows * strip_stride * 2) : 0));
    float* const row_max = acc + Line(bq * hd * 4) / 4;
    float* const row_sum = row_max + bq;
    float* const row_alpha = row_sum + bq;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const auto [c, h, i0, mq] = DecodeItem(item, heads, q_blocks, bq, s);
      const int64_t b = first + c;
      const int64_t group = h / g;
      const char* const q_rows = q.Row(c, i0, h, operand_bytes);
      // FP32 values are read in place.
      const float* const v_base =
          bf16 ? nullptr : reinterpret_cast<const float*>(v.Row(c, 0, group, operand_bytes));
      std::fill(row_max, row_max + mq, kMasked);
      std::fill(row_sum, row_sum + mq, 0.0f);
      // Rows past the query length are never read (they may lie in padding,
      // in the next sequence or past the end of the operand).
      const int64_t valid_rows = std::clamp<int64_t>(call.q_lengths[b] - i0, 0, mq);
      const int64_t key_end = std::min(call.kv_lengths[b], call.causal ? std::min(t, i0 + mq) : t);
      for (int64_t j0 = 0; valid_rows > 0 && j0 < key_end; j0 += bk) {
        const int64_t mk = std::min(bk, t - j0);
        ensure_packed(c, group, j0 / bk);
        const char* const block = packed_block(c, group, j0 / bk);
        for (int64_t r0 = 0; r0 < valid_rows; r0 += kStripRows) {
          const int64_t rows = std::min(kStripRows, valid_rows - r0);
          int64_t limits[kStripRows];
          int64_t strip_limit = 0;
          for (int64_t r = 0; r < rows; ++r) {
            limits[r] = VisibleKeys(call, b, i0 + r0 + r, j0, mk);
            strip_limit = std::max(strip_limit, limits[r]);
          }
          // Only past the first key block (causal): nothing to add, alpha 1.
          if (strip_limit == 0) continue;
          const int64_t tiles = (strip_limit + kKeyTile - 1) / kKeyTile;
          const int64_t width = tiles * kKeyTile;
          BlockScores(bf16, q_rows + r0 * q.row_stride * operand_bytes, q.row_stride, rows, block,
                      tiles, hd, scores, strip_stride);
          // The scale goes into the exponent, or, with a mask, before it.
          if (has_mask) {
            for (int64_t r = 0; r < rows; ++r) {
              ApplyExplicitMask(explicit_mask, b, i0 + r0 + r, j0, limits[r], config_.scale,
                                scores + r * strip_stride);
            }
          }
          OnlineSoftmaxStrip(scores, strip_stride, rows, limits, width, softmax_scale,
                             row_max + r0, row_sum + r0, row_alpha + r0, bf16 ? probs : nullptr);
          if (bf16) {
            BlockValuesBf16(probs, strip_stride, rows, (strip_limit + 1) / 2 * 2,
                            reinterpret_cast<const Bf16*>(block) + packed_elements, hd,
                            row_alpha + r0, j0 == 0, acc + r0 * hd, hd);
          } else {
            BlockValuesFp32(scores, strip_stride, rows, strip_limit, v_base + j0 * v.row_stride,
                            v.row_stride, hd, row_alpha + r0, j0 == 0, acc + r0 * hd, hd);
          }
        }
      }
      WriteContextRows(call, b, c, h, i0, mq, hd, acc, row_sum, context, context_bf16,
                       zero_rows_past_length);
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::core::internal
