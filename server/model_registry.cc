#include "server/model_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/status_util.h"

namespace attnserve::server {

absl::StatusOr<std::shared_ptr<const Model>> MakeBuiltinModel(uint64_t seed) {
  core::HeadConfig requested;
  requested.d_model = 768;
  requested.num_heads = 12;
  ATTNSERVE_ASSIGN_OR_RETURN(core::HeadConfig config, core::ResolveHeadConfig(requested));
  auto model = std::make_shared<Model>();
  model->name = std::string(kBuiltinModelName);
  model->description = absl::StrCat(
      "built-in: BERT-base attention shape with seeded weights (seed ", seed,
      "; recipe in docs/seeded_weights.md)");
  ATTNSERVE_ASSIGN_OR_RETURN(model->layer,
                             core::AttentionLayer::Create(config, core::SeededWeights(config, seed)));
  return model;
}

absl::Status ModelRegistry::Add(std::shared_ptr<const Model> model) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = models_.try_emplace(model->name, model);
  if (!inserted) {
    return absl::AlreadyExistsError(absl::StrCat("model '", model->name, "' is already loaded"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRegistry::Find(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no model named '", Abbreviate(name), "' is loaded (ListModels shows the loaded models)"));
  }
  return it->second;
}

std::vector<std::shared_ptr<const Model>> ModelRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Model>> models;
  models.reserve(models_.size());
  for (const auto& [name, model] : models_) models.push_back(model);
  return models;
}

}  // namespace attnserve::server
