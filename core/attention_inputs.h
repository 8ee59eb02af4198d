#ifndef ATTNSERVE_CORE_ATTENTION_INPUTS_H_
#define ATTNSERVE_CORE_ATTENTION_INPUTS_H_

// What one attention call works on: where each sequence sits, which keys each
// query may see, which maps and statistics to return.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve::core {

// Where the sequences of a batch sit in a token-major matrix [rows, width].
// Padded: sequence b owns rows [b * padded_len, (b + 1) * padded_len) and uses
// the first length(b) of them (the rest is padding, never read into a result,
// zero in outputs). Packed: sequences back to back, no padding.
// Map, mask and statistic coordinates are per sequence: query position i in
// [0, max_length()) of sequence b. max_length() is padded_len for a Padded
// layout (even when every length is shorter) and the longest length for a
// Packed one. A default-constructed layout has no sequences (Forward rejects it).
class SequenceLayout {
 public:
  SequenceLayout() = default;
  // lengths empty: every sequence is padded_len long. INVALID_ARGUMENT (field
  // "lengths") unless 1 <= lengths[b] <= padded_len and batch, padded_len >= 1
  // (fields "batch", "padded_len"; also when batch * padded_len overflows).
  static absl::StatusOr<SequenceLayout> Padded(int64_t batch, int64_t padded_len,
                                               std::vector<int64_t> lengths = {});
  // INVALID_ARGUMENT unless there is at least one sequence and every length >= 1
  // (and the total fits int64).
  static absl::StatusOr<SequenceLayout> Packed(std::vector<int64_t> lengths);

  int64_t batch() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t rows() const { return rows_; }
  int64_t max_length() const { return max_length_; }
  int64_t length(int64_t b) const { return lengths_[b]; }
  int64_t row_offset(int64_t b) const { return offsets_[b]; }
  bool is_padded() const { return padded_; }
  // True when no sequence is shorter than max_length() (no padding at all).
  bool is_uniform() const;

 private:
  std::vector<int64_t> lengths_;
  std::vector<int64_t> offsets_;
  int64_t rows_ = 0;
  int64_t max_length_ = 0;
  bool padded_ = false;
};

// An explicit attention mask, broadcast over heads, combined with the causal
// and padding masks. values: [batch_dim, q_dim, kv_dim] row-major, where
// batch_dim is 1 or batch, q_dim 1 or the queries' max_length, kv_dim 1 or the
// keys' max_length (a dimension of 1 broadcasts). Entries past a sequence's
// lengths are ignored. NaN is INVALID_ARGUMENT, and so is +inf in an additive
// mask; with kNone, values must be empty.
struct ExplicitMask {
  enum class Kind {
    kNone,
    kAllowed,   // values nonzero: the query may attend to the key; zero: it may not
    kAdditive,  // values added to the scaled scores (-inf forbids)
  };
  Kind kind = Kind::kNone;
  absl::Span<const float> values;
  int64_t batch_dim = 1;
  int64_t q_dim = 1;
  int64_t kv_dim = 1;
};

// Rotary position embeddings, Llama convention ("rotate half"): for a token at
// position p and i < rotary_dim / 2, the pair (x[i], x[i + rotary_dim / 2]) of
// each query and key head is rotated by the angle p * theta^(-2i / rotary_dim).
// Dimensions past rotary_dim are left alone. Applied after the projections'
// biases, before the scores. rotary_dim 0: no RoPE.
struct RotaryConfig {
  int64_t rotary_dim = 0;
  float theta = 10000.0f;
};

enum class AttentionMapMode {
  kNone,
  kPerHead,        // [batch, selected heads, selected query rows, keys' max_length]
  kMeanOverHeads,  // [batch, selected query rows, keys' max_length], mean over all heads
};

// Which maps to return. Map entries outside a sequence's lengths are 0.
struct MapSelection {
  AttentionMapMode mode = AttentionMapMode::kNone;
  // kPerHead: these heads, in this order (each in [0, num_heads)); empty: all.
  // Must be empty for the other modes (kMeanOverHeads averages all heads).
  std::vector<int64_t> heads;
  // These query positions, in this order (each in [0, queries' max_length));
  // empty: all. A position past a sequence's length gives a row of zeros.
  // Must be empty with kNone.
  std::vector<int64_t> query_rows;
};

enum class Precision {
  kFp32,
  kBf16,  // BF16 matmuls with FP32 accumulation and FP32 softmax
};

// "fp32" or "bf16".
std::string PrecisionName(Precision precision);

// Whether BF16 requests run in BF16: true exactly when the CPU has
// AVX512-BF16 (with AVX-512 F/BW/DQ/VL; CPUs with AMX-BF16 have it too) and
// oneDNN's ISA is not capped below avx512_core_bf16 (ONEDNN_MAX_CPU_ISA=AVX2
// simulates a CPU without BF16). Elsewhere BF16 requests run in FP32 and say
// so (ForwardInfo::precision). Checked once; thread-safe.
bool Bf16Supported();

// How the attention runs (see README "Attention paths").
enum class AttentionPath {
  // Blocked when neither maps nor head statistics are asked for, else
  // materialized.
  kAuto,
  // The scores of a chunk of sequences are materialized ([chunk, heads, S, T]);
  // needed for maps and statistics.
  kMaterialized,
  // Flash-style: key blocks in turn with an online softmax, O(S * block)
  // memory; causal blocks above the diagonal are skipped. No maps, no
  // statistics (INVALID_ARGUMENT when they are asked for with it).
  kBlocked,
};

// Which kernels run the blocked path's blocks.
enum class BlockKernels {
  // attnserve's own AVX-512 block kernels where the CPU and head_dim allow
  // them (core/kernels/block_kernels.h), oneDNN's block matmuls elsewhere.
  kAuto,
  // oneDNN's block matmuls always (for comparison, and the fallback's tests).
  kOneDnn,
};

// "auto" or "onednn".
std::string BlockKernelsName(BlockKernels kernels);
// The value named "auto" or "onednn" (the server's ATTNSERVE_BLOCK_KERNELS);
// INVALID_ARGUMENT for any other name.
absl::StatusOr<BlockKernels> ParseBlockKernels(absl::string_view name);

struct ForwardOptions {
  MapSelection maps;
  // Fill ForwardOutputs' head statistics.
  bool head_statistics = false;
  // kBf16 on a CPU without BF16 runs FP32 (ForwardInfo says so).
  Precision precision = Precision::kFp32;
  // Polled before each stage; when it returns true the call stops with
  // CANCELLED. Empty: never stops early.
  std::function<bool()> should_stop;
  AttentionPath attention_path = AttentionPath::kAuto;
  // Query rows and key rows per block of the blocked path; 0: the core's
  // choice (measured: see docs/measurements.md). Each >= 0.
  int64_t block_queries = 0;
  int64_t block_keys = 0;
  BlockKernels block_kernels = BlockKernels::kAuto;
};

// Buffers the caller owns and the layer fills. Spans not asked for must be
// empty; spans asked for must have exactly the sizes below (INVALID_ARGUMENT
// naming the field otherwise).
struct ForwardOutputs {
  // AttentionLayer: [queries' rows, d_model] in the queries' layout (padding
  // rows 0). AttentionCore: [batch, num_heads, q max_length, head_dim] (rows
  // past q_lengths 0).
  absl::Span<float> output;
  absl::Span<float> attention_maps;  // see AttentionMapMode
  // Per-head statistics, [batch, num_heads] each, over each sequence's valid
  // query rows, computed from the attention weights after the head mask:
  //   entropy: mean over rows of -sum_j p_ij ln p_ij (nats; a fully masked row counts 0)
  //   max_weight: mean over rows of max_j p_ij ("confidence")
  //   contribution (AttentionLayer only; AttentionCore wants it empty):
  //     ||head_h W^O_h||_F over the sequence's rows: how much the sequence's
  //     output changes when head h is removed.
  absl::Span<float> head_entropy;
  absl::Span<float> head_max_weight;
  absl::Span<float> head_contribution;
};

struct ForwardInfo {
  // The precision it ran in (kFp32 when kBf16 was asked on a CPU without BF16).
  Precision precision = Precision::kFp32;
  // How it ran, "<precision>/<attention path>": "fp32/materialized",
  // "bf16/materialized" (the scores are materialized, a chunk of sequences at
  // a time), "fp32/blocked" or "bf16/blocked" (see AttentionPath).
  std::string kernel_path;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_ATTENTION_INPUTS_H_
