// libFuzzer target: an AttendRequest's bytes through parsing, validation and
// memory planning (PlanAttend), then decoding of the inputs when the plan is
// small. The layer never runs: this exercises the code that sees untrusted
// bytes before anything is allocated from their sizes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/api/attend_plan.h"
#include "server/api/tensor_codec.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"

namespace attnserve::server {
namespace {

// Decoding allocates as much as the inputs hold; keep each run's footprint
// small so the fuzzer stays fast (PlanAttend itself is fuzzed at any size).
constexpr int64_t kMaxDecodedElements = int64_t{1} << 18;  // 1 MiB of FP32

const ModelRegistry& Registry() {
  static const ModelRegistry* registry = [] {
    auto* r = new ModelRegistry();
    auto model = MakeBuiltinModel(/*seed=*/0);
    if (!model.ok() || !r->Add(*std::move(model)).ok()) __builtin_trap();
    return r;
  }();
  return *registry;
}

// Sums the decoded values so that the reads cannot be optimised away.
float Touch(const v1::Tensor& tensor, const TensorSpec& spec) {
  const FloatValues values(tensor, spec);
  if (static_cast<int64_t>(values.values().size()) != spec.elements) __builtin_trap();
  float sum = 0;
  for (float x : values.values()) sum += x;
  return sum;
}

// What the last input came to (for the corpus replay's check of each seed's
// intent): 0 not an AttendRequest, 1 refused by PlanAttend, 2 planned.
int last_outcome = 0;

void FuzzOne(const uint8_t* data, size_t size) {
  // Protobuf logs every string field with invalid UTF-8 it parses; fuzzing
  // makes many, and printing them would be most of the time spent.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  last_outcome = 0;
  v1::AttendRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return;
  const RequestLimits limits;
  const ServerOptions options;
  const auto plan =
      PlanAttend(request, Registry(), limits, options.max_send_message_bytes, options.block_kernels);
  // ATTNSERVE_FUZZ_PRINT_STATUS=1: say what each input came to (to check
  // that the seed corpus reaches the parts it is meant to).
  static const bool print_status = std::getenv("ATTNSERVE_FUZZ_PRINT_STATUS") != nullptr;
  if (print_status) std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
  last_outcome = plan.ok() ? 2 : 1;
  if (!plan.ok()) return;

  // The input tensors the plan validated, each with its spec.
  std::vector<std::pair<const v1::Tensor*, const TensorSpec*>> inputs;
  if (plan->projected) {
    inputs.push_back({&request.projected().q(), &plan->q});
    inputs.push_back({&request.projected().k(), &plan->k});
    inputs.push_back({&request.projected().v(), &plan->v});
  } else {
    inputs.push_back({&request.hidden_states(), &plan->hidden_states});
    if (plan->context) inputs.push_back({&request.context(), &*plan->context});
  }
  if (plan->mask.kind != core::ExplicitMask::Kind::kNone) {
    inputs.push_back({&request.mask().values(), &plan->mask.values});
  }
  if (plan->adhoc && !plan->adhoc->inline_weights.empty()) {
    const v1::LayerWeights& w = request.layer().inline_weights();
    const v1::Tensor* tensors[] = {&w.w_q(), &w.b_q(), &w.w_k(), &w.b_k(),
                                   &w.w_v(), &w.b_v(), &w.w_o(), &w.b_o()};
    const auto& specs = plan->adhoc->inline_weights;
    for (size_t i = 0; i < specs.size() && i < 8; ++i) inputs.push_back({tensors[i], &specs[i]});
  }
  int64_t decoded = plan->output_elements + plan->map_elements;
  for (const auto& [tensor, spec] : inputs) decoded += spec->elements;
  if (decoded > kMaxDecodedElements) return;

  volatile float sink = 0;
  for (const auto& [tensor, spec] : inputs) sink = sink + Touch(*tensor, *spec);
  // The shapes the plan promises must agree with its element counts.
  int64_t out = 1;
  for (int64_t d : plan->output_shape) out *= d;
  if (out != plan->output_elements) __builtin_trap();
  if (!plan->map_shape.empty()) {
    int64_t maps = 1;
    for (int64_t d : plan->map_shape) maps *= d;
    if (maps != plan->map_elements) __builtin_trap();
  }
}

}  // namespace
}  // namespace attnserve::server

extern "C" int AttnserveFuzzLastOutcome() { return attnserve::server::last_outcome; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::server::FuzzOne(data, size);
  return 0;
}
