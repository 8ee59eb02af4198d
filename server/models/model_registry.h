#ifndef ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/attention_layer.h"

namespace attnserve::server {

// A loaded model: a name and its attention layer. Immutable once registered;
// requests hold a shared_ptr, so a model outlives the calls that use it (an
// unloaded model is freed when its last call finishes).
struct Model {
  std::string name;
  std::string description;
  std::unique_ptr<core::AttentionLayer> layer;
  // Every request on this model is causal (decoder layers, e.g. GPT-2, Llama).
  bool causal = false;
};

// Where a model is in its life.
enum class ModelState { kLoading, kReady, kFailed };
// "LOADING", "READY", "FAILED".
absl::string_view ModelStateName(ModelState state);

// A snapshot of one registry entry.
struct ModelStatus {
  std::string name;
  ModelState state = ModelState::kLoading;
  // kFailed: why (names the file and tensor); OK otherwise.
  absl::Status failure;
  // kReady: the model; null otherwise.
  std::shared_ptr<const Model> model;
};

// The name of the built-in model, served when nothing else is configured.
inline constexpr absl::string_view kBuiltinModelName = "default";

// The built-in model: the BERT-base attention shape (d_model 768, 12 heads,
// head_dim 64) with weights from core::SeededWeights(seed).
absl::StatusOr<std::shared_ptr<const Model>> MakeBuiltinModel(uint64_t seed);

// The models this server knows, by name, each loading, ready or failed.
// Loading is a ticketed transaction: BeginLoading marks a name LOADING and
// returns a ticket; FinishLoading settles it only if the entry is still the
// one that ticket opened (an Unload in between wins, and the loaded model is
// dropped).
//
// Thread-safe.
class ModelRegistry {
 public:
  ModelRegistry() = default;
  ModelRegistry(const ModelRegistry&) = delete;
  ModelRegistry& operator=(const ModelRegistry&) = delete;

  // Registers a ready model. ALREADY_EXISTS when the name is registered.
  absl::Status Add(std::shared_ptr<const Model> model);

  // Marks `name` LOADING and returns its ticket. ALREADY_EXISTS when it is
  // loading or ready; a FAILED entry is replaced (a retry).
  absl::StatusOr<uint64_t> BeginLoading(absl::string_view name);
  // Settles the load of `ticket`: `result` OK makes the entry READY, an error
  // makes it FAILED with that reason, except NOT_FOUND (nothing to load),
  // which removes the entry. ABORTED when the entry was unloaded (or replaced)
  // since BeginLoading; the registry is then left as it is.
  absl::Status FinishLoading(absl::string_view name, uint64_t ticket,
                             absl::StatusOr<std::shared_ptr<const Model>> result);

  // Removes `name` in any state (calls in flight keep their model). NOT_FOUND
  // when it is not registered.
  absl::Status Remove(absl::string_view name);

  // The ready model. NOT_FOUND naming it when unknown, UNAVAILABLE while it
  // loads, FAILED_PRECONDITION with the reason when its load failed.
  absl::StatusOr<std::shared_ptr<const Model>> Find(absl::string_view name) const;
  // The entry of `name`, or NOT_FOUND.
  absl::StatusOr<ModelStatus> Get(absl::string_view name) const;
  // Every entry, ordered by name.
  std::vector<ModelStatus> List() const;

 private:
  struct Entry {
    ModelStatus status;
    uint64_t ticket = 0;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Entry, std::less<>> models_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_
