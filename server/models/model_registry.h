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

// What one repository folder holds once read: one model named as the folder,
// or (`layered`: its config.json has "layers") its layers' models, in order.
struct FolderModels {
  std::vector<std::shared_ptr<const Model>> models;
  bool layered = false;
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
// A repository folder whose config.json has "layers" loads as one model per
// layer, named "<folder>.<i>" (ModelRepository::LayerModelName): the folder
// is LOADING (or FAILED) under its own name until its layers are READY
// together under theirs; then the folder's name stands for the list of its
// layers (FindLayers), which unload together (Remove of the folder).
//
// Thread-safe.
class ModelRegistry {
 public:
  ModelRegistry() = default;
  ModelRegistry(const ModelRegistry&) = delete;
  ModelRegistry& operator=(const ModelRegistry&) = delete;

  // Registers a ready model. ALREADY_EXISTS when the name is registered (a
  // model's or a folder of layers').
  absl::Status Add(std::shared_ptr<const Model> model);

  // Marks `name` LOADING and returns its ticket. ALREADY_EXISTS when it is
  // loading or ready, or a folder whose layers are loaded; FAILED_PRECONDITION
  // naming the folder when it is a loaded layer of a folder; a FAILED entry
  // is replaced (a retry).
  absl::StatusOr<uint64_t> BeginLoading(absl::string_view name);
  // FAILED_PRECONDITION naming the folder (load or unload it) when `name` is
  // a loaded layer of a folder of layers; OK otherwise.
  absl::Status CheckNotALayer(absl::string_view name) const;
  // Settles the load of `ticket`: `result` OK makes the entry READY, an error
  // makes it FAILED with that reason, except NOT_FOUND (nothing to load),
  // which removes the entry. ABORTED when the entry was unloaded (or replaced)
  // since BeginLoading; the registry is then left as it is.
  absl::Status FinishLoading(absl::string_view name, uint64_t ticket,
                             absl::StatusOr<std::shared_ptr<const Model>> result);
  // FinishLoading with what folder `name` held: one model named `name` (as
  // above), or (layered) its layers' models, in order, named "<name>.<i>": these turn
  // READY together and `name` becomes their folder (its LOADING entry goes).
  // ALREADY_EXISTS naming the layer when a layer's name is taken by another
  // entry (a folder of that name, say): `name` is then FAILED with that
  // reason and no layer is added. ABORTED as above.
  absl::Status FinishLoadingFolder(absl::string_view name, uint64_t ticket,
                                   absl::StatusOr<FolderModels> result);

  // Removes `name` in any state (calls in flight keep their model); a folder
  // of layers removes all its layers. Sets *removed (when given) to the model
  // names removed. NOT_FOUND when it is not registered; FAILED_PRECONDITION
  // for one layer of a folder (its layers unload together: naming the
  // folder).
  absl::Status Remove(absl::string_view name, std::vector<std::string>* removed = nullptr);

  // The ready model. NOT_FOUND naming it when unknown (for a folder of
  // layers: naming its layers' models), UNAVAILABLE while it loads,
  // FAILED_PRECONDITION with the reason when its load failed.
  absl::StatusOr<std::shared_ptr<const Model>> Find(absl::string_view name) const;
  // The models `name` stands for, in order: a folder of layers' layer models,
  // or the one model Find(name) gives (and its errors).
  absl::StatusOr<std::vector<std::shared_ptr<const Model>>> FindLayers(
      absl::string_view name) const;
  // The entry of `name`, or NOT_FOUND (for a folder of layers: naming its
  // layers' models).
  absl::StatusOr<ModelStatus> Get(absl::string_view name) const;
  // Every entry, ordered by name.
  std::vector<ModelStatus> List() const;

 private:
  struct Entry {
    ModelStatus status;
    uint64_t ticket = 0;
    std::string folder;  // a layer of that folder; empty otherwise
  };
  // CheckNotALayer's answer for the entry of `name`.
  static absl::Status LayerRefusal(absl::string_view name, const Entry& entry);
  // NOT_FOUND for `name`, naming its layers when it is a folder of them.
  absl::Status NotFound(absl::string_view name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Entry, std::less<>> models_ ABSL_GUARDED_BY(mu_);
  // Folders loaded as layers: the folder's name -> its layers' model names,
  // in order (each READY in models_).
  std::map<std::string, std::vector<std::string>, std::less<>> folders_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_REGISTRY_H_
