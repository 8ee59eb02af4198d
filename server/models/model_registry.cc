#include "server/models/model_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/message_text.h"

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

absl::string_view ModelStateName(ModelState state) {
  switch (state) {
    case ModelState::kLoading:
      return "LOADING";
    case ModelState::kReady:
      return "READY";
    case ModelState::kFailed:
      return "FAILED";
  }
  return "?";
}

absl::Status ModelRegistry::Add(std::shared_ptr<const Model> model) {
  absl::MutexLock lock(&mu_);
  Entry entry;
  entry.status.name = model->name;
  entry.status.state = ModelState::kReady;
  entry.status.model = model;
  entry.ticket = next_ticket_++;
  auto [it, inserted] = models_.try_emplace(model->name, std::move(entry));
  if (!inserted) {
    return absl::AlreadyExistsError(absl::StrCat("model '", model->name, "' is already loaded"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ModelRegistry::BeginLoading(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it != models_.end() && it->second.status.state != ModelState::kFailed) {
    return absl::AlreadyExistsError(
        absl::StrCat("model '", Abbreviate(name), "' is already ",
                     it->second.status.state == ModelState::kLoading ? "loading" : "loaded",
                     " (UnloadModel it first to reload it)"));
  }
  if (it == models_.end()) it = models_.try_emplace(std::string(name)).first;
  Entry& entry = it->second;
  entry.status = ModelStatus();
  entry.status.name = std::string(name);
  entry.ticket = next_ticket_++;
  return entry.ticket;
}

absl::Status ModelRegistry::FinishLoading(absl::string_view name, uint64_t ticket,
                                          absl::StatusOr<std::shared_ptr<const Model>> result) {
  std::shared_ptr<const Model> dropped;  // freed after the lock is released
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end() || it->second.ticket != ticket) {
    if (result.ok()) dropped = *std::move(result);
    return absl::AbortedError(
        absl::StrCat("model '", Abbreviate(name), "' was unloaded while it was loading"));
  }
  ModelStatus& status = it->second.status;
  if (result.ok()) {
    status.state = ModelState::kReady;
    status.model = *std::move(result);
  } else if (absl::IsNotFound(result.status())) {
    models_.erase(it);
  } else {
    status.state = ModelState::kFailed;
    status.failure = result.status();
  }
  return absl::OkStatus();
}

absl::Status ModelRegistry::Remove(absl::string_view name) {
  std::shared_ptr<const Model> removed;  // freed (if no call holds it) after the lock
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(absl::StrCat("no model named '", Abbreviate(name), "' is loaded"));
  }
  removed = std::move(it->second.status.model);
  models_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRegistry::Find(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no model named '", Abbreviate(name), "' is loaded (ListModels shows the loaded models)"));
  }
  const ModelStatus& status = it->second.status;
  switch (status.state) {
    case ModelState::kReady:
      return status.model;
    case ModelState::kLoading:
      return absl::UnavailableError(
          absl::StrCat("model '", Abbreviate(name), "' is LOADING; retry when it is READY"));
    case ModelState::kFailed:
      return absl::FailedPreconditionError(absl::StrCat(
          "model '", Abbreviate(name), "' is FAILED: ", status.failure.message()));
  }
  return absl::InternalError("unknown model state");
}

absl::StatusOr<ModelStatus> ModelRegistry::Get(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no model named '", Abbreviate(name), "' is loaded (ListModels shows the loaded models)"));
  }
  return it->second.status;
}

std::vector<ModelStatus> ModelRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<ModelStatus> models;
  models.reserve(models_.size());
  for (const auto& [name, entry] : models_) models.push_back(entry.status);
  return models;
}

}  // namespace attnserve::server
