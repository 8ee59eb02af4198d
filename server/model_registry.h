#ifndef ATTNSERVE_SERVER_MODEL_REGISTRY_H_
#define ATTNSERVE_SERVER_MODEL_REGISTRY_H_

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
// requests hold a shared_ptr, so a model outlives the calls that use it.
struct Model {
  std::string name;
  std::string description;
  std::unique_ptr<core::AttentionLayer> layer;
};

// The name of the built-in model, served when nothing else is configured.
inline constexpr absl::string_view kBuiltinModelName = "default";

// The built-in model: the BERT-base attention shape (d_model 768, 12 heads,
// head_dim 64) with weights from core::SeededWeights(seed).
absl::StatusOr<std::shared_ptr<const Model>> MakeBuiltinModel(uint64_t seed);

// The models this server serves, by name. Thread-safe.
class ModelRegistry {
 public:
  ModelRegistry() = default;
  ModelRegistry(const ModelRegistry&) = delete;
  ModelRegistry& operator=(const ModelRegistry&) = delete;

  // ALREADY_EXISTS when a model of that name is registered.
  absl::Status Add(std::shared_ptr<const Model> model);
  // The model, or NOT_FOUND naming it.
  absl::StatusOr<std::shared_ptr<const Model>> Find(absl::string_view name) const;
  // Every model, ordered by name.
  std::vector<std::shared_ptr<const Model>> List() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Model>, std::less<>> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_MODEL_REGISTRY_H_
