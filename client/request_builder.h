#ifndef ATTNSERVE_CLIENT_REQUEST_BUILDER_H_
#define ATTNSERVE_CLIENT_REQUEST_BUILDER_H_

// attnctl's `attend` options and the AttendRequest they describe. Kept apart
// from the command line so the mapping is testable without a server.

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"

namespace attnserve::client {

// Comma-separated lists for flags ("3,5,8"; "" is the empty list). Abseil
// flags parse them through AbslParseFlag, which rejects anything that is not
// a number, so a flag's error names the flag.
struct Int64List {
  std::vector<int64_t> values;
};
struct FloatList {
  std::vector<float> values;
};
bool AbslParseFlag(absl::string_view text, Int64List* list, std::string* error);
std::string AbslUnparseFlag(const Int64List& list);
bool AbslParseFlag(absl::string_view text, FloatList* list, std::string* error);
std::string AbslUnparseFlag(const FloatList& list);

// Everything `attnctl attend` can ask for; each field is the flag of the same
// name. Zero/empty means "not given" unless said otherwise.
struct AttendOptions {
  // What runs: a loaded model, or (when layer_seed is set) an ad-hoc layer
  // with seeded weights and this head configuration.
  std::string model = "default";
  std::optional<uint64_t> layer_seed;
  int32_t d_model = 0;       // required with layer_seed
  int32_t num_heads = 0;     // required with layer_seed
  int32_t num_kv_heads = 0;  // 0: num_heads
  int32_t head_dim = 0;      // 0: d_model / num_heads
  int32_t rotary_dim = 0;    // 0: no RoPE
  float rope_theta = 0;      // 0: the server's default (10000)

  // The queries. Random (normal, std 1, from `seed`) unless `input` names a
  // .npy file of hidden states ([batch, seq, d_model], or packed
  // [tokens, d_model] with `lengths`).
  int64_t batch = 0;  // 0: from input or lengths, else 1
  int64_t seq = 0;    // 0: from input, else max(lengths), else 16
  uint64_t seed = 1;
  std::string input;
  bool packed = false;           // send [total tokens, d_model] (needs lengths)
  std::vector<int64_t> lengths;  // sequence_lengths, one per sequence

  // Cross-attention with random context states of context_seq tokens (or
  // context_lengths, one per sequence; packed like the queries).
  int64_t context_seq = 0;
  std::vector<int64_t> context_lengths;

  bool causal = false;
  std::string mask;       // .npy: [batch or 1, seq_q or 1, seq_kv or 1]
  std::string mask_kind;  // "allowed" (default) or "additive"
  std::vector<float> head_mask;
  std::vector<int64_t> position_offsets;
  std::string precision = "fp32";     // fp32 or bf16
  std::string output_dtype = "fp32";  // fp32 or bf16
  // fp32 or bf16: the hidden and context states as sent (bf16: rounded to
  // nearest even, half the bytes; --input's values too).
  std::string input_dtype = "fp32";

  // Random already-projected q/k/v for the attention core alone.
  bool projected = false;

  std::string maps = "none";   // none, per-head or mean
  std::vector<int64_t> heads;  // per-head maps of these heads only
  std::vector<int64_t> rows;   // maps of these query positions only
  bool stats = false;          // head statistics

  // What to do with the response (checked here, used by the caller).
  std::string save_output;  // .npy
  std::string save_maps;    // .npy
  std::string maps_png;     // .png
  int64_t png_sequence = 0;
};

// A request ready to send, with what the caller needs to read the response.
struct AttendCall {
  v1::AttendRequest request;
  // The head configuration that runs, defaults resolved (num_kv_heads,
  // head_dim, scale).
  v1::HeadConfig config;
  int64_t batch = 0;
  bool packed = false;
  bool cross_attention = false;
  // Every sequence's query and key lengths (keys: the context's, or the
  // queries' again).
  std::vector<int64_t> query_lengths;
  std::vector<int64_t> key_lengths;
  // Where the queries came from, e.g. "random (seed 1)" or "x.npy".
  std::string input_source;
};

// Checks what can be checked without a head configuration: known words for
// maps, mask_kind, precision and output_dtype; ad-hoc layer flags only with
// layer_seed; flags that need another flag. INVALID_ARGUMENT naming the flag.
absl::Status ValidateAttendOptions(const AttendOptions& options);

// Builds the request. `model_config` is the model's head configuration (from
// GetModel); it is not read when options.layer_seed is set (may be null).
// Reads options.input and options.mask. INVALID_ARGUMENT naming the flag for
// options that are malformed or do not fit together or with the head
// configuration (e.g. --packed without --lengths, --heads with --maps=mean,
// a length over --seq, a file of the wrong shape); the file's read or parse
// error (naming the file) for a bad --input or --mask. The values of
// --head_mask, --position_offsets, --heads and --rows are passed on for the
// server to check (only --heads and --rows must fit the request's int32).
absl::StatusOr<AttendCall> BuildAttendRequest(const AttendOptions& options,
                                              const v1::HeadConfig* model_config);

// "fp32", "bf16" or "unspecified".
std::string PrecisionText(v1::Precision precision);

// `n` tokens of standard-normal hidden states drawn from `rng`, as an FP32
// tensor [n, d_model] (a decode session's new tokens).
v1::Tensor RandomStateRows(int64_t n, int64_t d_model, std::mt19937_64& rng);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_REQUEST_BUILDER_H_
