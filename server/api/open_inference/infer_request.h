#ifndef ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_REQUEST_H_
#define ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_REQUEST_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.pb.h"
#include "inference/open_inference.pb.h"

namespace attnserve::server::open_inference {

// The Open Inference Protocol's names for what attnserve's models take and
// give (docs/open_inference.md has the table).
inline constexpr char kHiddenStates[] = "hidden_states";
inline constexpr char kSequenceLengths[] = "sequence_lengths";
inline constexpr char kContext[] = "context";
inline constexpr char kContextLengths[] = "context_lengths";
inline constexpr char kMask[] = "mask";
inline constexpr char kHeadMask[] = "head_mask";
inline constexpr char kPositionOffsets[] = "position_offsets";
inline constexpr char kAttentionMapHeads[] = "attention_map_heads";
inline constexpr char kAttentionMapRows[] = "attention_map_rows";

// The one per-tensor parameter accepted (and ignored): clients' codecs set it.
inline constexpr char kContentType[] = "content_type";
// The longest request id, in bytes: the response echoes it.
inline constexpr size_t kMaxInferIdBytes = 256;

inline constexpr char kOutput[] = "output";
inline constexpr char kAttentionMaps[] = "attention_maps";
inline constexpr char kHeadEntropy[] = "head_entropy";
inline constexpr char kHeadMaxWeight[] = "head_max_weight";
inline constexpr char kHeadContribution[] = "head_contribution";

// How the response to a ModelInferRequest is laid out: which outputs, in
// which order, and whether their values travel in raw_output_contents.
struct InferReplyForm {
  std::string id;  // echoed
  // Output names in response order: those the request named in `outputs`,
  // in its order, or {"output"} when it named none.
  std::vector<std::string> outputs;
  // raw_output_contents iff the request used raw_input_contents; typed
  // contents otherwise (BF16 values, which have no typed field, then travel
  // raw: every output of the response goes raw).
  bool raw = false;
};

// NOT_FOUND naming `field` (and `model`) unless `version` is unset (null),
// The one version of every attnserve model, as the protocol names versions.
inline constexpr char kModelVersion[] = "1";

// "" or kModelVersion: attnserve's models have one version. Thread-safe.
absl::Status CheckModelVersion(absl::string_view field, absl::string_view model,
                               const std::string* version);

// Translates an Open Inference Protocol request into the attnserve.v1 request
// it stands for (`request`, cleared first; its model is set to model_name
// before anything is checked, so it names the model even on failure) and the
// layout of its reply (`form`). The raw contents of hidden_states, context
// and a mask are moved, not copied, out of `infer` (left in an unspecified
// state).
//
// Checks only what the protocol's form adds: the id's length (INVALID_ARGUMENT
// "id: ..." over kMaxInferIdBytes), tensor names, datatypes, ranks,
// element counts against shapes, raw vs typed contents, parameters, output
// names. Sizes against the model and the server's limits are PlanAttend's, as
// for Attend. Codes: INVALID_ARGUMENT naming the protocol's field (e.g.
// "inputs[0] (hidden_states).shape: ..."); NOT_FOUND for a model_version
// other than "" or "1". Thread-safe.
absl::Status AttendRequestFromInfer(inference::ModelInferRequest* infer, v1::AttendRequest* request,
                                    InferReplyForm* form);

}  // namespace attnserve::server::open_inference

#endif  // ATTNSERVE_SERVER_API_OPEN_INFERENCE_INFER_REQUEST_H_
