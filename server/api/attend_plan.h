#ifndef ATTNSERVE_SERVER_API_ATTEND_PLAN_H_
#define ATTNSERVE_SERVER_API_ATTEND_PLAN_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "core/attention_inputs.h"
#include "core/head_config.h"
#include "server/api/tensor_codec.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"

namespace attnserve::server {

// An ad-hoc layer a request carries (AttendRequest.layer).
struct AdHocLayer {
  core::HeadConfig config;  // resolved
  // Seeded weights, or the validated inline weight tensors (in the order of
  // core::AttentionWeights' fields); neither for projected requests.
  std::optional<uint64_t> seed;
  std::vector<TensorSpec> inline_weights;
};

// A validated explicit mask.
struct MaskPlan {
  core::ExplicitMask::Kind kind = core::ExplicitMask::Kind::kNone;
  TensorSpec values;  // [batch_dim, q_dim, kv_dim]
};

// An Attend request that passed validation: every size it implies is known,
// within int64 and within the limits. Points into the request it was made
// from (which must outlive it).
struct AttendPlan {
  // What runs: a loaded model, or an ad-hoc layer (exactly one).
  std::shared_ptr<const Model> model;
  std::optional<AdHocLayer> adhoc;
  core::HeadConfig config;  // of the model or the ad-hoc layer

  // The inputs: hidden states (and maybe context), or projected heads.
  bool projected = false;
  TensorSpec hidden_states;           // !projected
  std::optional<TensorSpec> context;  // cross-attention
  TensorSpec q, k, v;                 // projected
  core::SequenceLayout queries;
  core::SequenceLayout keys;  // the context's layout, or the queries' again

  bool causal = false;
  MaskPlan mask;
  std::vector<float> head_mask;           // [num_heads] or empty
  std::vector<int64_t> position_offsets;  // [batch] or empty
  core::MapSelection maps;
  bool head_statistics = false;
  core::Precision precision = core::Precision::kFp32;
  v1::DataType output_dtype = v1::DATA_TYPE_FP32;
  bool float_data_response = false;  // the request used float_data

  std::vector<int64_t> output_shape;
  std::vector<int64_t> map_shape;  // empty when no maps
  int64_t output_elements = 0;
  int64_t map_elements = 0;
  // Estimated bytes the request holds while it runs (inputs as FP32, compute
  // scratch, output and maps, serialized response): what it reserves from the
  // server's in-flight memory budget.
  int64_t memory_bytes = 0;
};

// How the response carries the maps: in the AttendResponse (Attend), or
// streamed in chunks after it (AttendStream), where the message limit applies
// to the response without the maps and to each chunk, and only
// --max_attention_map_bytes to the maps' total.
enum class MapDelivery { kInResponse, kStreamed };

// Validates `request` against the registry and the limits before anything is
// allocated from its sizes:
//   INVALID_ARGUMENT   a malformed field, or fields that do not fit together
//                      (the message names the field); or a request this
//                      server can never serve as configured: a size over
//                      `limits`, an estimated scratch over
//                      limits.max_scratch_bytes or memory_bytes over
//                      limits.max_request_bytes, a response over
//                      max_response_bytes (a message of the response, as
//                      `map_delivery` sends it; the message names the limit,
//                      its flag and what to ask for instead)
//   NOT_FOUND          the model is not loaded
//   UNAVAILABLE, FAILED_PRECONDITION  the model is loading, or its load
//                      failed (ModelRegistry::Find)
// Never RESOURCE_EXHAUSTED: that is for load (the scheduler's queue and
// in-flight budget), which may pass.
// `block_kernels`: the server's (they decide the route, and so its scratch).
absl::StatusOr<AttendPlan> PlanAttend(const v1::AttendRequest& request,
                                      const ModelRegistry& registry, const RequestLimits& limits,
                                      int64_t max_response_bytes,
                                      core::BlockKernels block_kernels,
                                      MapDelivery map_delivery = MapDelivery::kInResponse);

// A request's precision and output dtype (UNSPECIFIED: FP32), or
// INVALID_ARGUMENT naming "precision" / "output_dtype". Thread-safe.
absl::StatusOr<core::Precision> PrecisionFromWire(v1::Precision precision);
absl::StatusOr<v1::DataType> OutputDtypeFromWire(v1::DataType dtype);

// The core's options for a planned request (what the runner passes and the
// route that sized the request was made with), without should_stop.
core::ForwardOptions ForwardOptionsFor(const AttendPlan& plan, core::BlockKernels block_kernels);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_ATTEND_PLAN_H_
