#include "server/models/model_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

namespace {

// "a.0, a.1, ... a.11" (the first two and the last of long lists).
std::string LayerList(const std::vector<std::string>& names) {
  if (names.size() <= 3) return absl::StrJoin(names, ", ");
  return absl::StrCat(names[0], ", ", names[1], ", ... ", names.back());
}

}  // namespace

absl::Status ModelRegistry::NotFound(absl::string_view name) const {
  if (auto folder = folders_.find(name); folder != folders_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "'", Abbreviate(name), "' is a model folder of ", folder->second.size(),
        " layers, each its own model: ", LayerList(folder->second),
        " (OpenSession takes the folder's name for all of them, in order)"));
  }
  return absl::NotFoundError(absl::StrCat("no model named '", Abbreviate(name),
                                          "' is loaded (ListModels shows the loaded models)"));
}

absl::Status ModelRegistry::Add(std::shared_ptr<const Model> model) {
  absl::MutexLock lock(&mu_);
  if (folders_.contains(model->name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("'", Abbreviate(model->name), "' is a loaded folder of layers"));
  }
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
  if (auto folder = folders_.find(name); folder != folders_.end()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "model folder '", Abbreviate(name), "' is already loaded as its ",
        folder->second.size(), " layers ", LayerList(folder->second),
        " (UnloadModel it first to reload it)"));
  }
  auto it = models_.find(name);
  if (it != models_.end() && !it->second.folder.empty()) return LayerRefusal(name, it->second);
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

absl::Status ModelRegistry::LayerRefusal(absl::string_view name, const Entry& entry) {
  if (entry.folder.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "model '", Abbreviate(name), "' is a layer of model folder '", Abbreviate(entry.folder),
      "', whose layers load and unload together: load or unload '", Abbreviate(entry.folder),
      "'"));
}

absl::Status ModelRegistry::CheckNotALayer(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  return it == models_.end() ? absl::OkStatus() : LayerRefusal(name, it->second);
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

absl::Status ModelRegistry::FinishLoadingFolder(
    absl::string_view name, uint64_t ticket,
    absl::StatusOr<FolderModels> result) {
  if (!result.ok()) return FinishLoading(name, ticket, result.status());
  if (!result->layered) {
    if (result->models.size() != 1) {
      return FinishLoading(name, ticket,
                           absl::InternalError(absl::StrCat("a folder of one model read as ",
                                                            result->models.size(), " models")));
    }
    return FinishLoading(name, ticket, std::move(result->models[0]));
  }
  std::vector<std::shared_ptr<const Model>> dropped;  // freed after the lock is released
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end() || it->second.ticket != ticket) {
    dropped = std::move(result->models);
    return absl::AbortedError(
        absl::StrCat("model '", Abbreviate(name), "' was unloaded while it was loading"));
  }
  for (const std::shared_ptr<const Model>& layer : result->models) {
    if (!models_.contains(layer->name) && !folders_.contains(layer->name)) continue;
    const absl::Status taken = absl::AlreadyExistsError(absl::StrCat(
        "layer model name '", Abbreviate(layer->name),
        "' is taken by another model (a folder of that name?); rename one of them"));
    it->second.status.state = ModelState::kFailed;
    it->second.status.failure = taken;
    dropped = std::move(result->models);
    return taken;
  }
  models_.erase(it);
  std::vector<std::string>& names = folders_[std::string(name)];
  for (std::shared_ptr<const Model>& layer : result->models) {
    Entry entry;
    entry.status.name = layer->name;
    entry.status.state = ModelState::kReady;
    entry.status.model = std::move(layer);
    entry.ticket = next_ticket_++;
    entry.folder = std::string(name);
    names.push_back(entry.status.name);
    models_.emplace(entry.status.name, std::move(entry));
  }
  return absl::OkStatus();
}

absl::Status ModelRegistry::Remove(absl::string_view name, std::vector<std::string>* removed) {
  std::vector<std::shared_ptr<const Model>> freed;  // freed (if no call holds them) after the lock
  absl::MutexLock lock(&mu_);
  if (removed != nullptr) removed->clear();
  if (auto folder = folders_.find(name); folder != folders_.end()) {
    for (const std::string& layer : folder->second) {
      auto entry = models_.find(layer);
      if (entry == models_.end()) continue;
      freed.push_back(std::move(entry->second.status.model));
      models_.erase(entry);
      if (removed != nullptr) removed->push_back(layer);
    }
    folders_.erase(folder);
    return absl::OkStatus();
  }
  auto it = models_.find(name);
  if (it == models_.end()) {
    return absl::NotFoundError(absl::StrCat("no model named '", Abbreviate(name), "' is loaded"));
  }
  if (!it->second.folder.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", Abbreviate(name), "' is a layer of model folder '",
        Abbreviate(it->second.folder),
        "', whose layers load and unload together: unload '", Abbreviate(it->second.folder),
        "'"));
  }
  freed.push_back(std::move(it->second.status.model));
  models_.erase(it);
  if (removed != nullptr) removed->push_back(std::string(name));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::shared_ptr<const Model>>> ModelRegistry::FindLayers(
    absl::string_view name) const {
  {
    absl::MutexLock lock(&mu_);
    if (auto folder = folders_.find(name); folder != folders_.end()) {
      std::vector<std::shared_ptr<const Model>> layers;
      for (const std::string& layer : folder->second) {
        auto it = models_.find(layer);
        if (it == models_.end() || it->second.status.model == nullptr) {
          return absl::InternalError(absl::StrCat("layer '", Abbreviate(layer), "' of folder '",
                                                  Abbreviate(name), "' is not READY"));
        }
        layers.push_back(it->second.status.model);
      }
      return layers;
    }
  }
  absl::StatusOr<std::shared_ptr<const Model>> model = Find(name);
  if (!model.ok()) return model.status();
  return std::vector<std::shared_ptr<const Model>>{*std::move(model)};
}

absl::StatusOr<std::shared_ptr<const Model>> ModelRegistry::Find(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(name);
  if (it == models_.end()) return NotFound(name);
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
  if (it == models_.end()) return NotFound(name);
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
