#ifndef ATTNSERVE_CORE_CHECKPOINT_LAYOUTS_H_
#define ATTNSERVE_CORE_CHECKPOINT_LAYOUTS_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/attention_weights.h"
#include "core/head_config.h"
#include "core/safetensors.h"

namespace attnserve::core {

// How a checkpoint names and shapes one attention layer's tensors. Names are
// relative to CheckpointConfig::prefix; "W [a, b]" is the stored shape.
enum class WeightLayout {
  // torch.nn.MultiheadAttention: in_proj_weight [3E, E] (rows: q, k, v),
  // in_proj_bias [3E], out_proj.weight [E, E], out_proj.bias [E] (Linear: [out, in]).
  kTorchMha,
  // BERT self-attention (Hugging Face BertAttention): self.query/key/value.weight
  // [out, in] and .bias, output.dense.weight [E, E] and .bias.
  kBert,
  // GPT-2 (Hugging Face GPT2Attention): c_attn.weight [E, 3E] (Conv1D: [in, out];
  // columns q, k, v), c_attn.bias [3E], c_proj.weight [E, E] ([in, out]), c_proj.bias.
  kGpt2,
  // Llama (Hugging Face LlamaAttention): q_proj.weight [Hq*D, E],
  // k_proj.weight / v_proj.weight [Hkv*D, E], o_proj.weight [E, Hq*D]; no biases
  // (q/k/v/o_proj.bias are used when present); RoPE from the config.
  kLlama,
};

// "torch_mha", "bert", "gpt2", "llama".
absl::string_view WeightLayoutName(WeightLayout layout);

// A model folder's config.json (README.md, "Model repository", has the schema
// and an example per layout).
struct CheckpointConfig {
  WeightLayout layout = WeightLayout::kTorchMha;
  // The weights file, a plain file name in the model's folder.
  std::string weights = "model.safetensors";
  // Prepended to every tensor name: selects one layer of a whole checkpoint,
  // e.g. "encoder.layer.3.attention.".
  std::string prefix;
  // config.json's "layers": the folder describes several layers of one
  // checkpoint, layer i's tensors under layer_prefixes[i] (every other field
  // is shared). Empty: the folder is one layer, under `prefix`.
  //   "layers": {"count": 12, "prefix": "h.{layer}.attn."}  ({layer} -> 0..11)
  //   "layers": {"prefixes": ["encoder.0.attn.", "decoder.0.attn."]}
  std::vector<std::string> layer_prefixes;
  HeadConfig head_config;  // resolved by ParseCheckpointConfig
  // The model's attention is causal (decoder) for every request. Default:
  // true for gpt2 and llama, false otherwise.
  bool causal = false;
  std::string description;
};

// The largest config.json accepted.
inline constexpr int64_t kMaxCheckpointConfigBytes = 64 << 10;
// The most layers one config.json's "layers" describes.
inline constexpr int64_t kMaxCheckpointLayers = 1024;
// The longest tensor-name prefix (prefix, and each layer's).
inline constexpr size_t kMaxTensorPrefixBytes = 1024;
// Where each layer's index (0, 1, ...) goes in layers.prefix.
inline constexpr absl::string_view kLayerPlaceholder = "{layer}";

// Parses config.json's text. Fields: layout (required), d_model and num_heads
// (required), num_kv_heads, head_dim, scale, rotary {dim, theta}, causal,
// weights, prefix or layers ({count, prefix} with kLayerPlaceholder in the
// prefix, or {prefixes}), description; an unknown field is an error (it
// catches typos). INVALID_ARGUMENT naming `display_name` and the field
// ("layers.count", "layers.prefixes[3]", ...).
absl::StatusOr<CheckpointConfig> ParseCheckpointConfig(absl::string_view json,
                                                       absl::string_view display_name);

// Layer `layer` of a config with layer_prefixes: the same config with that
// layer's prefix and no layer_prefixes (what CheckpointWeightBytes and
// LoadCheckpointWeights read). INVALID_ARGUMENT for a layer past them (or
// any layer of a config without layer_prefixes: it describes one layer,
// itself). Thread-safe.
absl::StatusOr<CheckpointConfig> LayerOfCheckpoint(const CheckpointConfig& config, size_t layer);

// The bytes the layer `config` describes takes once loaded: every tensor its
// layout reads from `file` as FP32 (what LoadCheckpointWeights allocates for
// the weights, whatever the stored dtype), an absent optional bias as the
// zeros it becomes. From the header alone: nothing is read or allocated from
// the tensors' sizes. NOT_FOUND naming the file and tensor when one is
// missing; INVALID_ARGUMENT naming it when its shape does not match the head
// configuration or its dtype is not F32, BF16 or F16.
absl::StatusOr<int64_t> CheckpointWeightBytes(const SafetensorsFile& file,
                                              const CheckpointConfig& config);

struct CheckpointLoadOptions {
  // The most bytes the layer's weights may take (CheckpointWeightBytes),
  // checked before any tensor is read. Loading needs up to about twice this
  // for a moment (a tensor as read beside its converted copy).
  int64_t max_weight_bytes = std::numeric_limits<int64_t>::max();
  // What messages call that budget: the caller's option or flag.
  std::string budget_name = "max_weight_bytes";
};

// CheckpointWeightBytes of the layer `config` describes, held against
// options.max_weight_bytes: the bytes when they fit; INVALID_ARGUMENT naming
// the file, options.budget_name, the bytes needed and the budget when they do
// not (such a checkpoint never will); CheckpointWeightBytes' errors
// otherwise. From the header alone. Thread-safe.
absl::StatusOr<int64_t> CheckCheckpointBudget(const SafetensorsFile& file,
                                              const CheckpointConfig& config,
                                              const CheckpointLoadOptions& options);

// Reads the layer `config` describes from `file` and converts it to
// AttentionWeights (x W + b convention: Linear weights are transposed,
// Conv1D's are not). Every tensor's presence and shape is checked from the
// header, and the total against options.max_weight_bytes, before any tensor
// is read. NOT_FOUND naming the file and tensor when one is missing;
// INVALID_ARGUMENT naming it when its shape does not match the head
// configuration, its dtype is not F32/BF16/F16, or a value is not finite, and
// naming options.budget_name, the bytes needed and the budget when the
// weights do not fit it (such a checkpoint never will); RESOURCE_EXHAUSTED
// when memory runs out while reading (std::bad_alloc is caught here: a later
// attempt, with more memory free, may pass).
absl::StatusOr<AttentionWeights> LoadCheckpointWeights(const SafetensorsFile& file,
                                                       const CheckpointConfig& config,
                                                       const CheckpointLoadOptions& options = {});

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_CHECKPOINT_LAYOUTS_H_
