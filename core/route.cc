#include "core/route.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/kernels/block_kernels.h"
#include "core/checked_math.h"
#include "core/kernels/blocked_sdpa.h"
#include "core/status_macros.h"
#include "omp.h"

namespace attnserve::core {
namespace {

// At most this many scores (16 MiB) are materialized at once; a chunk holds as
// many sequences as fit, and at least one.
constexpr int64_t kScoresBudget = int64_t{1} << 22;

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

// The path `options` choose (validated): see AttentionPath.
bool UsesBlocked(const ForwardOptions& options) {
  switch (options.attention_path) {
    case AttentionPath::kBlocked:
      return true;
    case AttentionPath::kMaterialized:
      return false;
    case AttentionPath::kAuto:
      break;
  }
  return options.maps.mode == AttentionMapMode::kNone && !options.head_statistics;
}

// Whether the blocked path reads Q, K and V where they are instead of from
// staged dense copies.
//  - The layer (projections in token-major rows, written in the operand type
//    by the projection matmul): never with RoPE (staging applies it). The own
//    block kernels read any rows (Q by broadcasts, K and V once into their
//    packed blocks), only those within each sequence's length: always.
//    oneDNN's block matmuls leave brg:avx512_core* for gemm:jit on rows a whole
//    projection width apart (its brgemm matmul wants dense operands), and read
//    every row of a block, padding included: only BF16 up to four query blocks
//    (measured 4-8% faster than staging at B=8 S=128 and S=512, equal at
//    S=2048, 3% slower at S=4096; docs/measurements.md), uniform lengths only.
//  - AttentionCore (the caller's dense FP32 heads): staged to convert them to
//    BF16, and where padding (which may hold anything, NaN too) would
//    otherwise be read -- everywhere but in the own block kernels, which read
//    rows within the lengths only.
bool ReadsInPlace(const HeadConfig& config, const RouteRequest& request, const Route& route) {
  const bool uniform = request.queries.is_uniform() && request.keys.is_uniform();
  if (request.projected_inputs) {
    if (route.bf16()) return false;
    if (route.blocked && route.own_block_kernels) return true;
    return uniform;
  }
  if (!route.blocked || config.rotary.rotary_dim > 0) return false;
  if (route.own_block_kernels) return true;
  return route.bf16() && request.queries.max_length() <= 4 * route.block_queries && uniform;
}

// Sums element counts into per-buffer bytes, remembering an overflow.
class Sizer {
 public:
  explicit Sizer(Route& route) : route_(route) {}
  void Set(Scratch buffer, std::initializer_list<int64_t> dims, int64_t element_bytes) {
    const std::optional<int64_t> elements = CheckedProduct(dims);
    const std::optional<int64_t> bytes =
        elements ? CheckedMul(*elements, element_bytes) : std::nullopt;
    if (!bytes) {
      overflow_ = true;
      return;
    }
    const std::optional<int64_t> rounded = CheckedAdd(*bytes, kScratchAlignment - 1);
    if (!rounded) {
      overflow_ = true;
      return;
    }
    route_.bytes[static_cast<int>(buffer)] = *rounded / kScratchAlignment * kScratchAlignment;
  }
  void Overflow() { overflow_ = true; }
  bool overflow() const { return overflow_; }

 private:
  Route& route_;
  bool overflow_ = false;
};

void SizeAttention(const HeadConfig& config, const RouteRequest& request, Route& route,
                   Sizer& size) {
  const int64_t chunk = route.chunk;
  const int64_t s = request.queries.max_length();
  const int64_t t = request.keys.max_length();
  const int64_t hd = config.head_dim;
  const int64_t operand = route.bf16() ? 2 : 4;
  if (route.staged) {
    size.Set(Scratch::kQStage, {chunk, config.num_heads, s, hd}, operand);
    size.Set(Scratch::kKStage, {chunk, config.num_kv_heads, t, hd}, operand);
    size.Set(Scratch::kVStage, {chunk, config.num_kv_heads, t, hd}, operand);
  }
  if (route.blocked) {
    size.Set(Scratch::kBlockWorkspace,
             {route.threads, internal::BlockWorkspaceBytes(route.own_block_kernels, route.bf16(),
                                                           route.block_queries, route.block_keys,
                                                           hd)},
             1);
    if (route.own_block_kernels) {
      const int64_t key_blocks = internal::KeyBlocks(t, route.block_keys);
      size.Set(Scratch::kBlockPacks,
               {chunk, config.num_kv_heads, key_blocks,
                internal::PackedBlocksBytes(route.bf16(), route.block_keys, hd)},
               1);
      size.Set(Scratch::kPackStates, {chunk, config.num_kv_heads, key_blocks}, 4);
    }
    return;
  }
  size.Set(Scratch::kScores, {chunk, config.num_heads, s, t}, 4);
  if (route.bf16()) size.Set(Scratch::kProbsBf16, {chunk, config.num_heads, s, t}, 2);
  const bool may_mask =
      request.causal || request.mask != ExplicitMask::Kind::kNone || !request.keys.is_uniform();
  if (may_mask) {
    size.Set(Scratch::kMask, {chunk, config.group_size(), s, t}, 4);
    size.Set(Scratch::kDeadRows, {chunk, s}, 1);
  }
}

void SizeLayer(const HeadConfig& config, const RouteRequest& request, Route& route,
               Sizer& size) {
  const int64_t rows = request.queries.rows();
  const int64_t kv_rows = request.keys.rows();
  const int64_t q_width = config.q_width();
  const int64_t kv_width = 2 * config.kv_width();
  const int64_t operand = route.bf16() ? 2 : 4;
  if (route.bf16()) {
    size.Set(Scratch::kInputsBf16, {rows, config.d_model}, 2);
    if (request.cross_attention) size.Set(Scratch::kContextBf16, {kv_rows, config.context_dim}, 2);
  }
  const int64_t projected = route.projections_bf16 ? 2 : 4;
  if (request.cross_attention) {
    const std::optional<int64_t> q =
        CheckedProduct({rows, ProjectionRowStride(q_width, projected)});
    const std::optional<int64_t> kv =
        CheckedProduct({kv_rows, ProjectionRowStride(kv_width, projected)});
    const std::optional<int64_t> sum = q && kv ? CheckedAdd(*q, *kv) : std::nullopt;
    if (sum) {
      size.Set(Scratch::kProjections, {*sum}, projected);
    } else {
      size.Overflow();
    }
  } else {
    size.Set(Scratch::kProjections, {rows, ProjectionRowStride(q_width + kv_width, projected)},
             projected);
  }
  if (config.rotary.rotary_dim > 0) {
    // cos and sin of the queries' rows, and in cross-attention of the
    // context's (self-attention's keys share the queries' tables).
    const int64_t tables = request.cross_attention ? rows + kv_rows : rows;
    size.Set(Scratch::kRotary, {2, tables, config.rotary.rotary_dim / 2}, 4);
  }
  if (!route.blocked && !route.paged) {
    size.Set(Scratch::kContextHeads,
             {route.chunk, config.num_heads, request.queries.max_length(), config.head_dim}, 4);
  }
  size.Set(Scratch::kContextTokens, {rows, q_width}, operand);
}

// The decode route's own buffers, beyond the layer's (SizeLayer): the rows of
// the R new tokens, token-major.
void SizePaged(const HeadConfig& config, int64_t rows, const Route& route, Sizer& size) {
  const int64_t hd = config.head_dim;
  if (!route.bf16()) size.Set(Scratch::kInputs, {rows, config.d_model}, 4);
  size.Set(Scratch::kQStage, {rows, config.num_heads, hd}, 4);
  size.Set(Scratch::kKStage, {rows, config.num_kv_heads, hd}, 4);
  size.Set(Scratch::kVStage, {rows, config.num_kv_heads, hd}, 4);
  // The attention writes FP32 heads; BF16 context rows are converted from them.
  if (route.bf16()) size.Set(Scratch::kContextHeads, {rows, config.num_heads, hd}, 4);
  size.Set(Scratch::kOutputs, {rows, config.d_model}, 4);
}

// OK when no size overflowed and the buffers' sum fits int64.
absl::Status CheckSizes(const Route& route, const Sizer& size, absl::string_view field) {
  std::optional<int64_t> total = 0;
  for (int64_t b : route.bytes) total = total ? CheckedAdd(*total, b) : std::nullopt;
  if (size.overflow() || !total) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the attention's scratch memory for these lengths overflows int64"));
  }
  return absl::OkStatus();
}

Precision RunPrecision(Precision asked) {
  return asked == Precision::kBf16 && Bf16Supported() ? Precision::kBf16 : Precision::kFp32;
}

}  // namespace

absl::string_view ScratchName(Scratch buffer) {
  switch (buffer) {
    case Scratch::kInputs: return "inputs";
    case Scratch::kInputsBf16: return "inputs_bf16";
    case Scratch::kContextBf16: return "context_bf16";
    case Scratch::kProjections: return "projections";
    case Scratch::kRotary: return "rotary";
    case Scratch::kQStage: return "q_stage";
    case Scratch::kKStage: return "k_stage";
    case Scratch::kVStage: return "v_stage";
    case Scratch::kScores: return "scores";
    case Scratch::kProbsBf16: return "probs_bf16";
    case Scratch::kMask: return "mask";
    case Scratch::kDeadRows: return "dead_rows";
    case Scratch::kBlockWorkspace: return "block_workspace";
    case Scratch::kBlockPacks: return "block_packs";
    case Scratch::kPackStates: return "pack_states";
    case Scratch::kContextHeads: return "context_heads";
    case Scratch::kContextTokens: return "context_tokens";
    case Scratch::kOutputs: return "outputs";
    case Scratch::kCount: break;
  }
  return "unknown";
}

int64_t Route::scratch_bytes() const {
  int64_t total = 0;
  for (int64_t b : bytes) total += b;  // MakeRoute checked the sum
  return total;
}

std::string Route::kernel_path() const {
  return absl::StrCat(PrecisionName(precision), "/",
                      paged ? "paged" : blocked ? "blocked" : "materialized");
}

int64_t ProjectionRowStride(int64_t width, int64_t element_bytes) {
  constexpr int64_t kLine = 64;
  int64_t lines = (width * element_bytes + kLine - 1) / kLine;
  if (lines % 2 == 0) ++lines;
  return lines * kLine / element_bytes;
}

std::vector<std::string> KernelPathNames() {
  std::vector<std::string> names;
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    if (precision == Precision::kBf16 && !Bf16Supported()) continue;
    for (bool blocked : {false, true}) {
      Route route;
      route.precision = precision;
      route.blocked = blocked;
      names.push_back(route.kernel_path());
    }
    Route paged;
    paged.precision = precision;
    paged.paged = true;
    names.push_back(paged.kernel_path());
  }
  return names;
}

absl::StatusOr<Route> MakeRoute(const HeadConfig& config, const RouteRequest& request,
                                const ForwardOptions& options) {
  Route route;
  route.precision = RunPrecision(options.precision);
  const int64_t batch = request.queries.batch();
  const int64_t s = request.queries.max_length();
  const int64_t t = request.keys.max_length();
  route.blocked = UsesBlocked(options);
  if (route.blocked) {
    route.own_block_kernels = options.block_kernels != BlockKernels::kOneDnn &&
                              internal::OwnBlockKernelsAvailable(route.bf16(), config.head_dim);
    const int64_t default_keys = request.causal ? kDefaultBlockKeysCausal : kDefaultBlockKeys;
    route.block_queries = std::clamp<int64_t>(
        options.block_queries > 0 ? options.block_queries : kDefaultBlockQueries, 1,
        std::max<int64_t>(s, 1));
    route.block_keys = std::clamp<int64_t>(options.block_keys > 0 ? options.block_keys : default_keys,
                                           1, std::max<int64_t>(t, 1));
    route.threads = omp_get_max_threads();
    // The blocked path's scratch is per thread, not per sequence.
    route.chunk = batch;
  } else {
    // One sequence at a time when its scores alone overflow (sizing then
    // reports the overflow).
    const std::optional<int64_t> per_sequence = CheckedProduct({config.num_heads, s, t});
    route.chunk = per_sequence && *per_sequence > 0
                      ? std::clamp<int64_t>(kScoresBudget / *per_sequence, 1, batch)
                      : 1;
  }
  route.staged = !ReadsInPlace(config, request, route);
  route.projections_bf16 = !request.projected_inputs && !route.staged && route.bf16();

  Sizer size(route);
  if (batch > 0) {
    SizeAttention(config, request, route, size);
    if (!request.projected_inputs) SizeLayer(config, request, route, size);
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckSizes(route, size, "layout"));
  return route;
}

absl::StatusOr<Route> MakeExtendRoute(const HeadConfig& config, int64_t new_tokens,
                                      Precision precision) {
  Route route;
  route.precision = RunPrecision(precision);
  route.paged = true;
  // The new tokens' rows, as one packed "sequence": the layer's buffers
  // (SizeLayer) are sized by rows, which is all the decode route asks of them.
  route.chunk = 1;
  route.staged = true;
  Sizer size(route);
  if (new_tokens > 0) {
    ATTNSERVE_ASSIGN_OR_RETURN(const SequenceLayout rows, SequenceLayout::Packed({new_tokens}));
    SizeLayer(config, RouteRequest{.queries = rows, .keys = rows, .causal = true}, route, size);
    SizePaged(config, new_tokens, route, size);
  }
  ATTNSERVE_RETURN_IF_ERROR(CheckSizes(route, size, "items"));
  return route;
}

}  // namespace attnserve::core
