#include "core/attention_layer.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/attention_weights.h"
#include "core/checked_math.h"
#include "core/head_config.h"
#include "core/onednn_util.h"
#include "core/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"

// The layer runs as four stages of oneDNN primitives (FP32). With
// N = (Hq + 2 Hkv) * head_dim, G = Hq / Hkv and T = batch * seq_len tokens:
//
//  1. qkv = X W_qkv + b_qkv                 matmul  X [T, d_model] -> qkv [T, N],
//     W_qkv = [W_q | W_k | W_v] fused at Create time ([d_model, N]).
//  2. split into head-major Q [B, Hq, S, hd], K, V [B, Hkv, S, hd]    3 reorders.
//     (brg matmul only takes dense batch dims: reading the heads out of the
//     token-major qkv through strides runs on the slow gemm:jit path.)
//  3. per chunk of sequences (the scores are materialized, so their size bounds
//     the chunk), viewing the heads as [n * Hkv, G, S, hd] so that one K/V head
//     broadcasts over its G query heads (no copy per query head):
//       scores = Q K^T * scale   matmul, K^T described by strides, scale as
//                                output scale -> [n * Hkv, G, S, S] = [n, Hq, S, S]
//       P = softmax(scores)      softmax_v2 over the last axis (in place)
//       mean map = (1/Hq) * sum_h P_h      matmul ones[1, Hq] x P[n, Hq, S*S]
//       context = P V            matmul -> [n, Hq, S, hd]
//       concat heads             reorder to token-major [n, S, Hq * hd]
//  4. out = context W_o + b_o                matmul straight into the output.
//
// Every primitive is built once per (batch, seq_len) and cached; all scratch
// memory (including oneDNN's scratchpads, in user mode) belongs to the layer.

namespace attnserve::core {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using Args = std::unordered_map<int, memory>;

constexpr memory::data_type kF32 = memory::data_type::f32;
constexpr char kKernelPath[] = "fp32/materialized";

// At most this many scores (16 MiB) are materialized at once; the attention
// stage runs over as many sequences as fit, and at least one.
constexpr int64_t kScoresBudget = int64_t{1} << 22;

// Plans kept for distinct (batch, seq_len); the least recently used goes.
constexpr size_t kMaxCachedPlans = 32;

memory::desc Dense(const memory::dims& dims, Tag tag) { return memory::desc(dims, kF32, tag); }

memory::desc Strided(const memory::dims& dims, const memory::dims& strides) {
  return memory::desc(dims, kF32, strides);
}

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// One primitive and the scratchpad it needs.
struct Step {
  dnnl::primitive primitive;
  memory::desc scratchpad;
};

template <typename Primitive>
Step MakeStep(const typename Primitive::primitive_desc& pd, int64_t* max_scratchpad_bytes) {
  Step step{Primitive(pd), pd.scratchpad_desc()};
  *max_scratchpad_bytes =
      std::max(*max_scratchpad_bytes, static_cast<int64_t>(step.scratchpad.get_size()));
  return step;
}

// The sizes (in floats) of one forward shape; all products overflow-checked.
struct Sizes {
  int64_t tokens = 0;         // batch * seq_len
  int64_t qkv = 0;            // tokens * N
  int64_t chunk = 0;          // sequences per attention chunk
  int64_t scores = 0;         // chunk * Hq * seq_len * seq_len
  int64_t context_heads = 0;  // chunk * Hq * seq_len * head_dim
};

absl::StatusOr<Sizes> ComputeSizes(const HeadConfig& c, AttentionShape shape) {
  const int64_t qkv_width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  Sizes sizes;
  const std::optional<int64_t> tokens = CheckedMul(shape.batch, shape.seq_len);
  const std::optional<int64_t> qkv = CheckedProduct({shape.batch, shape.seq_len, qkv_width});
  const std::optional<int64_t> per_sequence =
      CheckedProduct({c.num_heads, shape.seq_len, shape.seq_len});
  if (!tokens || !qkv || !per_sequence || *qkv > INT64_MAX / 4 || *per_sequence > INT64_MAX / 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape: batch ", shape.batch, ", seq_len ", shape.seq_len, " is too large"));
  }
  sizes.tokens = *tokens;
  sizes.qkv = *qkv;
  sizes.chunk = std::clamp<int64_t>(kScoresBudget / *per_sequence, 1, shape.batch);
  sizes.scores = sizes.chunk * *per_sequence;  // at most max(budget, per_sequence)
  sizes.context_heads = sizes.chunk * shape.seq_len * c.q_width();  // <= qkv
  return sizes;
}

// The primitives of the attention stage for a chunk of `sequences`.
struct ChunkPlan {
  int64_t sequences = 0;
  memory::desc q, k_t, scores, v, context_heads, context_tokens;  // matmul operands
  memory::desc probs_2d;                                          // softmax
  memory::desc ones, probs_by_head, mean;                         // mean map
  Step scores_mm, softmax, mean_mm, context_mm, to_tokens;
};

// Everything one (batch, seq_len) needs.
struct Plan {
  Sizes sizes;
  memory::desc x, w_qkv, b_qkv, qkv;
  Step qkv_mm;
  // Q, K and V: where in qkv and in heads_ they start, the layouts, the copy.
  struct Split {
    int64_t qkv_offset = 0;
    int64_t heads_offset = 0;
    memory::desc from, to;
    Step reorder;
  };
  Split splits[3];
  ChunkPlan full;                 // `sizes.chunk` sequences
  std::optional<ChunkPlan> tail;  // batch % chunk sequences, if any
  memory::desc context, w_o, b_o, out;
  Step out_mm;
  int64_t scratchpad_bytes = 0;
  uint64_t last_use = 0;
};

ChunkPlan BuildChunkPlan(const dnnl::engine& engine, const HeadConfig& c, int64_t sequences,
                         int64_t seq_len, int64_t* scratchpad_bytes) {
  const int64_t s = seq_len;
  const int64_t hd = c.head_dim;
  const int64_t g = c.group_size();
  const int64_t kv_batch = sequences * c.num_kv_heads;
  const dnnl::primitive_attr plain = UserScratchpad();

  ChunkPlan p;
  p.sequences = sequences;

  // scores [n*Hkv, G, S, S] = Q [n*Hkv, G, S, hd] x K^T [n*Hkv, 1, hd, S] * scale
  p.q = Dense({kv_batch, g, s, hd}, Tag::abcd);
  p.k_t = Dense({kv_batch, 1, hd, s}, Tag::abdc);  // K [.., S, hd] read transposed
  p.scores = Dense({kv_batch, g, s, s}, Tag::abcd);
  dnnl::primitive_attr scaled = UserScratchpad();
  scaled.set_output_scales(0, {c.scale});
  p.scores_mm = MakeStep<dnnl::matmul>(
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.q, p.k_t, p.scores), scaled, engine),
      scratchpad_bytes);

  // P = softmax over the keys, rows of [n*Hq*S, S].
  p.probs_2d = Dense({sequences * c.num_heads * s, s}, Tag::ab);
  p.softmax = MakeStep<dnnl::softmax_v2_forward>(
      dnnl::softmax_v2_forward::primitive_desc(
          dnnl::softmax_v2_forward::desc(dnnl::prop_kind::forward_inference,
                                         dnnl::algorithm::softmax_accurate, p.probs_2d, p.probs_2d,
                                         /*softmax_axis=*/1),
          plain, engine),
      scratchpad_bytes);

  // mean [n, 1, S*S] = (ones [1, 1, Hq] x P [n, Hq, S*S]) * (1/Hq)
  p.ones = Dense({1, 1, c.num_heads}, Tag::abc);
  p.probs_by_head = Dense({sequences, c.num_heads, s * s}, Tag::abc);
  p.mean = Dense({sequences, 1, s * s}, Tag::abc);
  dnnl::primitive_attr averaged = UserScratchpad();
  averaged.set_output_scales(0, {static_cast<float>(1.0 / static_cast<double>(c.num_heads))});
  p.mean_mm = MakeStep<dnnl::matmul>(
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.ones, p.probs_by_head, p.mean), averaged,
                                   engine),
      scratchpad_bytes);

  // context [n*Hkv, G, S, hd] = P [n*Hkv, G, S, S] x V [n*Hkv, 1, S, hd]
  p.v = Dense({kv_batch, 1, s, hd}, Tag::abcd);
  p.context_heads = Dense({kv_batch, g, s, hd}, Tag::abcd);
  p.context_mm =
      MakeStep<dnnl::matmul>(dnnl::matmul::primitive_desc(
                                 dnnl::matmul::desc(p.scores, p.v, p.context_heads), plain, engine),
                             scratchpad_bytes);

  // [n, Hq, S, hd] -> token-major [n, S, Hq, hd] (the concatenation of the heads).
  const memory::desc heads_view = Dense({sequences, c.num_heads, s, hd}, Tag::abcd);
  p.context_tokens =
      Strided({sequences, c.num_heads, s, hd}, {s * c.q_width(), hd, c.q_width(), 1});
  p.to_tokens = MakeStep<dnnl::reorder>(
      dnnl::reorder::primitive_desc(engine, heads_view, engine, p.context_tokens, plain),
      scratchpad_bytes);
  return p;
}

std::unique_ptr<Plan> BuildPlan(const dnnl::engine& engine, const HeadConfig& c,
                                AttentionShape shape, const Sizes& sizes) {
  const int64_t b = shape.batch;
  const int64_t s = shape.seq_len;
  const int64_t hd = c.head_dim;
  const int64_t n = (c.num_heads + 2 * c.num_kv_heads) * hd;
  const dnnl::primitive_attr plain = UserScratchpad();

  auto plan = std::make_unique<Plan>();
  plan->sizes = sizes;

  // qkv [T, N] = X [T, d_model] x W_qkv [d_model, N] + b_qkv [1, N]
  plan->x = Dense({sizes.tokens, c.d_model}, Tag::ab);
  plan->w_qkv = Dense({c.d_model, n}, Tag::ab);
  plan->b_qkv = Dense({1, n}, Tag::ab);
  plan->qkv = Dense({sizes.tokens, n}, Tag::ab);
  plan->qkv_mm = MakeStep<dnnl::matmul>(
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(plan->x, plan->w_qkv, plan->b_qkv, plan->qkv),
                                   plain, engine),
      &plan->scratchpad_bytes);

  // qkv viewed as [B, heads, S, hd] (strides of the token-major layout) ->
  // dense head-major Q | K | V, one after the other.
  const int64_t heads[3] = {c.num_heads, c.num_kv_heads, c.num_kv_heads};
  int64_t column = 0;
  int64_t heads_offset = 0;
  for (int i = 0; i < 3; ++i) {
    Plan::Split& split = plan->splits[i];
    split.qkv_offset = column;
    split.heads_offset = heads_offset;
    split.from = Strided({b, heads[i], s, hd}, {s * n, hd, n, 1});
    split.to = Dense({b, heads[i], s, hd}, Tag::abcd);
    split.reorder = MakeStep<dnnl::reorder>(
        dnnl::reorder::primitive_desc(engine, split.from, engine, split.to, plain),
        &plan->scratchpad_bytes);
    column += heads[i] * hd;
    heads_offset += b * heads[i] * s * hd;
  }

  plan->full = BuildChunkPlan(engine, c, sizes.chunk, s, &plan->scratchpad_bytes);
  if (const int64_t rest = b % sizes.chunk; rest != 0) {
    plan->tail = BuildChunkPlan(engine, c, rest, s, &plan->scratchpad_bytes);
  }

  // out [T, d_model] = context [T, Hq*hd] x W_o [Hq*hd, d_model] + b_o [1, d_model]
  plan->context = Dense({sizes.tokens, c.q_width()}, Tag::ab);
  plan->w_o = Dense({c.q_width(), c.d_model}, Tag::ab);
  plan->b_o = Dense({1, c.d_model}, Tag::ab);
  plan->out = Dense({sizes.tokens, c.d_model}, Tag::ab);
  plan->out_mm = MakeStep<dnnl::matmul>(
      dnnl::matmul::primitive_desc(
          dnnl::matmul::desc(plan->context, plan->w_o, plan->b_o, plan->out), plain, engine),
      &plan->scratchpad_bytes);
  return plan;
}

absl::Status CheckSize(const char* field, size_t actual, int64_t expected,
                       const std::string& layout) {
  if (static_cast<int64_t>(actual) == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": size ", actual, " does not match ", layout, " = ", expected));
}

absl::Status Cancelled() {
  return absl::CancelledError("attention forward stopped: should_stop returned true");
}

}  // namespace

std::optional<int64_t> AttentionMapElements(const HeadConfig& config, AttentionShape shape,
                                            AttentionMapMode mode) {
  switch (mode) {
    case AttentionMapMode::kNone:
      if (shape.batch < 0 || shape.seq_len < 0) return std::nullopt;
      return 0;
    case AttentionMapMode::kPerHead:
      return CheckedProduct({shape.batch, config.num_heads, shape.seq_len, shape.seq_len});
    case AttentionMapMode::kMeanOverHeads:
      return CheckedProduct({shape.batch, shape.seq_len, shape.seq_len});
  }
  return std::nullopt;
}

// The layer's state. Thread-safe: Forward holds mu_ for the whole call, since
// the stream, the plans and the scratch buffers are shared.
class AttentionLayer::Impl {
 public:
  Impl(const HeadConfig& config, dnnl::engine engine, dnnl::stream stream, std::vector<float> w_qkv,
       std::vector<float> b_qkv, AttentionWeights weights)
      : config_(config),
        engine_(std::move(engine)),
        w_qkv_(std::move(w_qkv)),
        b_qkv_(std::move(b_qkv)),
        w_o_(std::move(weights.w_o)),
        b_o_(std::move(weights.b_o)),
        ones_(static_cast<size_t>(config.num_heads), 1.0f),
        stream_(std::move(stream)) {}

  const HeadConfig& config() const { return config_; }

  absl::StatusOr<ForwardInfo> Forward(absl::Span<const float> hidden_states, AttentionShape shape,
                                      const ForwardOptions& options, ForwardOutputs outputs);

 private:
  absl::StatusOr<ForwardInfo> ForwardLocked(absl::Span<const float> hidden_states,
                                            AttentionShape shape, const ForwardOptions& options,
                                            ForwardOutputs outputs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Plan*> GetPlan(AttentionShape shape, const Sizes& sizes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReserveScratch(const Plan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(const Step& step, Args args) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls options.should_stop once the work queued so far is done.
  bool ShouldStop(const ForwardOptions& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options.should_stop) return false;
    stream_.wait();
    return options.should_stop();
  }
  memory Memory(const memory::desc& desc, const float* data) const {
    // oneDNN takes non-const handles; inputs are only read.
    return memory(desc, engine_, const_cast<float*>(data));
  }

  // Constant after construction.
  const HeadConfig config_;  // resolved
  const dnnl::engine engine_;
  const std::vector<float> w_qkv_;  // [d_model, N] = [w_q | w_k | w_v]
  const std::vector<float> b_qkv_;  // [N] = [b_q | b_k | b_v]
  const std::vector<float> w_o_;    // [Hq * hd, d_model]
  const std::vector<float> b_o_;    // [d_model]
  const std::vector<float> ones_;   // [Hq], the mean map's left operand

  absl::Mutex mu_;
  dnnl::stream stream_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Plan>> plans_ ABSL_GUARDED_BY(mu_);
  uint64_t use_counter_ ABSL_GUARDED_BY(mu_) = 0;
  // qkv [T, N]; after the split it holds the token-major context [T, Hq*hd].
  internal::ScratchBuffer qkv_ ABSL_GUARDED_BY(mu_);
  // Head-major Q [B, Hq, S, hd] | K [B, Hkv, S, hd] | V [B, Hkv, S, hd].
  internal::ScratchBuffer heads_ ABSL_GUARDED_BY(mu_);
  internal::ScratchBuffer scores_ ABSL_GUARDED_BY(mu_);         // [chunk, Hq, S, S]
  internal::ScratchBuffer context_heads_ ABSL_GUARDED_BY(mu_);  // [chunk, Hq, S, hd]
  internal::ScratchBuffer scratchpad_ ABSL_GUARDED_BY(mu_);     // oneDNN's
};

absl::StatusOr<ForwardInfo> AttentionLayer::Impl::Forward(absl::Span<const float> hidden_states,
                                                          AttentionShape shape,
                                                          const ForwardOptions& options,
                                                          ForwardOutputs outputs) {
  if (shape.batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.batch: must be at least 1, got ", shape.batch));
  }
  if (shape.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.seq_len: must be at least 1, got ", shape.seq_len));
  }
  const std::optional<int64_t> tokens_size =
      CheckedProduct({shape.batch, shape.seq_len, config_.d_model});
  if (!tokens_size) {
    return absl::InvalidArgumentError(absl::StrCat("shape: batch ", shape.batch, " * seq_len ",
                                                   shape.seq_len, " * d_model ", config_.d_model,
                                                   " overflows int64"));
  }
  const std::string tokens_layout = absl::StrCat("[batch ", shape.batch, ", seq_len ",
                                                 shape.seq_len, ", d_model ", config_.d_model, "]");
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize("hidden_states", hidden_states.size(), *tokens_size, tokens_layout));
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize("output", outputs.output.size(), *tokens_size, tokens_layout));

  std::string maps_layout;
  switch (options.attention_maps) {
    case AttentionMapMode::kNone:
      maps_layout = "nothing (no attention maps asked for)";
      break;
    case AttentionMapMode::kPerHead:
      maps_layout = absl::StrCat("[batch ", shape.batch, ", num_heads ", config_.num_heads,
                                 ", seq_len ", shape.seq_len, ", seq_len ", shape.seq_len, "]");
      break;
    case AttentionMapMode::kMeanOverHeads:
      maps_layout = absl::StrCat("[batch ", shape.batch, ", seq_len ", shape.seq_len, ", seq_len ",
                                 shape.seq_len, "]");
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("attention_maps: unknown mode ", static_cast<int>(options.attention_maps)));
  }
  const std::optional<int64_t> maps_size =
      AttentionMapElements(config_, shape, options.attention_maps);
  if (!maps_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention_maps: ", maps_layout, " overflows int64"));
  }
  ATTNSERVE_RETURN_IF_ERROR(
      CheckSize("attention_maps", outputs.attention_maps.size(), *maps_size, maps_layout));

  absl::MutexLock lock(&mu_);
  try {
    return ForwardLocked(hidden_states, shape, options, outputs);
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "running the attention layer");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory running the attention layer");
  }
}

absl::StatusOr<ForwardInfo> AttentionLayer::Impl::ForwardLocked(
    absl::Span<const float> hidden_states, AttentionShape shape, const ForwardOptions& options,
    ForwardOutputs outputs) {
  if (ShouldStop(options)) return Cancelled();
  ATTNSERVE_ASSIGN_OR_RETURN(const Sizes sizes, ComputeSizes(config_, shape));
  ATTNSERVE_ASSIGN_OR_RETURN(const Plan* plan, GetPlan(shape, sizes));
  ATTNSERVE_RETURN_IF_ERROR(ReserveScratch(*plan));

  const int64_t s = shape.seq_len;
  const int64_t hd = config_.head_dim;
  float* const qkv = qkv_.floats();
  float* const heads = heads_.floats();

  // Stage 1: the fused Q/K/V projection over all tokens.
  Run(plan->qkv_mm, {{DNNL_ARG_SRC, Memory(plan->x, hidden_states.data())},
                     {DNNL_ARG_WEIGHTS, Memory(plan->w_qkv, w_qkv_.data())},
                     {DNNL_ARG_BIAS, Memory(plan->b_qkv, b_qkv_.data())},
                     {DNNL_ARG_DST, Memory(plan->qkv, qkv)}});
  // Stage 2: head-major Q, K, V.
  for (const Plan::Split& split : plan->splits) {
    Run(split.reorder, {{DNNL_ARG_FROM, Memory(split.from, qkv + split.qkv_offset)},
                        {DNNL_ARG_TO, Memory(split.to, heads + split.heads_offset)}});
  }
  const float* const q = heads + plan->splits[0].heads_offset;
  const float* const k = heads + plan->splits[1].heads_offset;
  const float* const v = heads + plan->splits[2].heads_offset;
  float* const context = qkv;  // qkv is consumed; the context takes its place

  // Stage 3: attention, a chunk of sequences at a time.
  const AttentionMapMode mode = options.attention_maps;
  for (int64_t first = 0; first < shape.batch;) {
    if (ShouldStop(options)) return Cancelled();
    const ChunkPlan& chunk = shape.batch - first >= plan->full.sequences ? plan->full : *plan->tail;
    // With per-head maps the probabilities go straight to the caller's buffer.
    float* const probs = mode == AttentionMapMode::kPerHead
                             ? outputs.attention_maps.data() + first * config_.num_heads * s * s
                             : scores_.floats();
    const memory probs_memory = Memory(chunk.scores, probs);
    Run(chunk.scores_mm,
        {{DNNL_ARG_SRC, Memory(chunk.q, q + first * config_.num_heads * s * hd)},
         {DNNL_ARG_WEIGHTS, Memory(chunk.k_t, k + first * config_.num_kv_heads * s * hd)},
         {DNNL_ARG_DST, probs_memory}});
    const memory probs_rows = Memory(chunk.probs_2d, probs);
    Run(chunk.softmax, {{DNNL_ARG_SRC, probs_rows}, {DNNL_ARG_DST, probs_rows}});
    if (mode == AttentionMapMode::kMeanOverHeads) {
      Run(chunk.mean_mm,
          {{DNNL_ARG_SRC, Memory(chunk.ones, ones_.data())},
           {DNNL_ARG_WEIGHTS, Memory(chunk.probs_by_head, probs)},
           {DNNL_ARG_DST, Memory(chunk.mean, outputs.attention_maps.data() + first * s * s)}});
    }
    const memory context_heads = Memory(chunk.context_heads, context_heads_.floats());
    Run(chunk.context_mm,
        {{DNNL_ARG_SRC, probs_memory},
         {DNNL_ARG_WEIGHTS, Memory(chunk.v, v + first * config_.num_kv_heads * s * hd)},
         {DNNL_ARG_DST, context_heads}});
    Run(chunk.to_tokens,
        {{DNNL_ARG_FROM, context_heads},
         {DNNL_ARG_TO, Memory(chunk.context_tokens, context + first * s * config_.q_width())}});
    first += chunk.sequences;
  }

  // Stage 4: the output projection.
  if (ShouldStop(options)) return Cancelled();
  Run(plan->out_mm, {{DNNL_ARG_SRC, Memory(plan->context, context)},
                     {DNNL_ARG_WEIGHTS, Memory(plan->w_o, w_o_.data())},
                     {DNNL_ARG_BIAS, Memory(plan->b_o, b_o_.data())},
                     {DNNL_ARG_DST, Memory(plan->out, outputs.output.data())}});
  stream_.wait();
  return ForwardInfo{kKernelPath};
}

absl::StatusOr<Plan*> AttentionLayer::Impl::GetPlan(AttentionShape shape, const Sizes& sizes) {
  const std::pair<int64_t, int64_t> key(shape.batch, shape.seq_len);
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    if (plans_.size() >= kMaxCachedPlans) {
      auto oldest = std::min_element(
          plans_.begin(), plans_.end(),
          [](const auto& a, const auto& b) { return a.second->last_use < b.second->last_use; });
      plans_.erase(oldest);
    }
    it = plans_.emplace(key, BuildPlan(engine_, config_, shape, sizes)).first;
  }
  it->second->last_use = ++use_counter_;
  return it->second.get();
}

absl::Status AttentionLayer::Impl::ReserveScratch(const Plan& plan) {
  constexpr int64_t kFloat = sizeof(float);
  // Sizes bounded by ComputeSizes: none of these products overflow.
  ATTNSERVE_RETURN_IF_ERROR(qkv_.Reserve(plan.sizes.qkv * kFloat));
  ATTNSERVE_RETURN_IF_ERROR(heads_.Reserve(plan.sizes.qkv * kFloat));
  ATTNSERVE_RETURN_IF_ERROR(scores_.Reserve(plan.sizes.scores * kFloat));
  ATTNSERVE_RETURN_IF_ERROR(context_heads_.Reserve(plan.sizes.context_heads * kFloat));
  ATTNSERVE_RETURN_IF_ERROR(scratchpad_.Reserve(plan.scratchpad_bytes));
  return absl::OkStatus();
}

void AttentionLayer::Impl::Run(const Step& step, Args args) {
  if (step.scratchpad.get_size() != 0) {
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(step.scratchpad, engine_, scratchpad_.data()));
  }
  step.primitive.execute(stream_, args);
}

absl::StatusOr<std::unique_ptr<AttentionLayer>> AttentionLayer::Create(const HeadConfig& config,
                                                                       AttentionWeights weights) {
  ATTNSERVE_ASSIGN_OR_RETURN(const HeadConfig resolved, ResolveHeadConfig(config));
  ATTNSERVE_RETURN_IF_ERROR(ValidateWeights(resolved, weights));
  ATTNSERVE_ASSIGN_OR_RETURN(dnnl::engine engine, internal::CpuEngine());

  try {
    // Fuse the three input projections: row r of W_qkv is
    // [w_q row r | w_k row r | w_v row r].
    const size_t d = static_cast<size_t>(resolved.d_model);
    const size_t q_width = static_cast<size_t>(resolved.q_width());
    const size_t kv_width = static_cast<size_t>(resolved.kv_width());
    const size_t n = q_width + 2 * kv_width;
    std::vector<float> w_qkv(d * n);
    for (size_t r = 0; r < d; ++r) {
      float* row = w_qkv.data() + r * n;
      row = std::copy_n(weights.w_q.data() + r * q_width, q_width, row);
      row = std::copy_n(weights.w_k.data() + r * kv_width, kv_width, row);
      std::copy_n(weights.w_v.data() + r * kv_width, kv_width, row);
    }
    std::vector<float> b_qkv;
    b_qkv.reserve(n);
    b_qkv.insert(b_qkv.end(), weights.b_q.begin(), weights.b_q.end());
    b_qkv.insert(b_qkv.end(), weights.b_k.begin(), weights.b_k.end());
    b_qkv.insert(b_qkv.end(), weights.b_v.begin(), weights.b_v.end());

    dnnl::stream stream(engine);
    return std::unique_ptr<AttentionLayer>(new AttentionLayer(
        std::make_unique<Impl>(resolved, std::move(engine), std::move(stream), std::move(w_qkv),
                               std::move(b_qkv), std::move(weights))));
  } catch (const dnnl::error& e) {
    return internal::StatusFromDnnlError(e, "creating an attention layer");
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory creating an attention layer");
  }
}

AttentionLayer::AttentionLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AttentionLayer::~AttentionLayer() = default;

const HeadConfig& AttentionLayer::config() const { return impl_->config(); }

absl::StatusOr<ForwardInfo> AttentionLayer::Forward(absl::Span<const float> hidden_states,
                                                    AttentionShape shape,
                                                    const ForwardOptions& options,
                                                    ForwardOutputs outputs) {
  return impl_->Forward(hidden_states, shape, options, outputs);
}

}  // namespace attnserve::core
