#include "server/models/model_loader.h"

#include <new>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve::server {

ModelLoader::ModelLoader(const ModelRepository* repository, ModelRegistry* registry,
                         ModelLoaderOptions options)
    : repository_(repository), registry_(registry), options_(std::move(options)) {
  thread_ = std::thread([this] { Run(); });
}

ModelLoader::~ModelLoader() { Shutdown(); }

absl::Status ModelLoader::Load(absl::string_view name, Done done) {
  if (absl::Status valid = ModelRepository::ValidateModelName(name); !valid.ok()) return valid;
  // No entry for a name the repository has no folder of: a layer's name
  // ("gpt2.3") asked for while its folder loads must not take the name the
  // folder's layer is about to have.
  if (absl::Status found = repository_->FindFolder(name); absl::IsNotFound(found)) {
    // A loaded layer's name: the more specific answer names its folder.
    if (absl::Status layer = registry_->CheckNotALayer(name); !layer.ok()) return layer;
    return found;
  }
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(jobs_.size()) >= options_.max_pending) {
    return absl::ResourceExhaustedError(
        absl::StrCat(jobs_.size(), " model loads are waiting already; retry later"));
  }
  absl::StatusOr<uint64_t> ticket = registry_->BeginLoading(name);
  if (!ticket.ok()) return ticket.status();
  jobs_.push_back(Job{std::string(name), *ticket, std::move(done)});
  return absl::OkStatus();
}

absl::Status ModelLoader::Unload(absl::string_view name) {
  std::vector<std::string> names;
  if (absl::Status removed = registry_->Remove(name, &names); !removed.ok()) return removed;
  if (options_.on_unloaded) {
    for (const std::string& removed_name : names) options_.on_unloaded(removed_name);
  }
  return absl::OkStatus();
}

void ModelLoader::Shutdown() {
  std::deque<Job> abandoned;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    abandoned.swap(jobs_);
  }
  if (thread_.joinable()) thread_.join();
  for (Job& job : abandoned) {
    const absl::Status stopped = absl::UnavailableError(
        absl::StrCat("model '", job.name, "' was not loaded: the server is shutting down"));
    // The entry is no use LOADING forever: it ends FAILED (unless unloaded).
    registry_->FinishLoading(job.name, job.ticket, stopped).IgnoreError();
    if (job.done) job.done(stopped);
  }
}

absl::StatusOr<FolderModels> ModelLoader::LoadAndWarmUp(
    const std::string& name) const {
  // The repository catches running out of memory while reading; this catch
  // covers the warm-up and anything else of this one model's load, so the
  // loader thread (and the process) never ends on it.
  auto out_of_memory = [&](const char* what) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory while loading or warming up (", what,
                     "); a later attempt, with more memory free, may pass"));
  };
  try {
    absl::StatusOr<FolderModels> models = repository_->LoadFolder(name);
    if (models.ok() && options_.warm_up) {
      const size_t count = models->models.size();
      for (size_t i = 0; i < count; ++i) {
        const Model& model = *models->models[i];
        if (absl::Status warm = options_.warm_up(model); !warm.ok()) {
          // A layer's says which (the reading's reasons name its prefix too).
          return absl::FailedPreconditionError(absl::StrCat(
              models->layered ? absl::StrCat("layer ", i, " of ", count, " (model '", model.name,
                                             "'): ")
                              : "",
              "warm-up failed: ", warm.message()));
        }
      }
    }
    return models;
  } catch (const std::bad_alloc&) {
    return out_of_memory("std::bad_alloc");
  } catch (const std::length_error&) {
    return out_of_memory("std::length_error");
  }
}

void ModelLoader::Run() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !jobs_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (jobs_.empty()) return;  // stopping
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    absl::StatusOr<FolderModels> models = LoadAndWarmUp(job.name);
    const std::vector<std::shared_ptr<const Model>> loaded =
        models.ok() ? models->models : std::vector<std::shared_ptr<const Model>>{};
    const bool layered = models.ok() && models->layered;
    const absl::Status loaded_status = models.status();
    absl::Status settled = registry_->FinishLoadingFolder(job.name, job.ticket, std::move(models));
    if (settled.ok() && options_.on_ready) {
      for (const std::shared_ptr<const Model>& model : loaded) options_.on_ready(*model, job.name);
    }
    if (!job.done) continue;
    if (!settled.ok()) {
      job.done(settled);
    } else if (absl::IsNotFound(loaded_status)) {
      job.done(loaded_status);
    } else if (!loaded_status.ok()) {
      // Out of memory keeps its code (a retry may pass); every other reason
      // is the folder's, FAILED_PRECONDITION until it is fixed.
      job.done(absl::Status(absl::IsResourceExhausted(loaded_status)
                                ? absl::StatusCode::kResourceExhausted
                                : absl::StatusCode::kFailedPrecondition,
                            absl::StrCat("model '", job.name,
                                         "' failed to load: ", loaded_status.message())));
    } else {
      // The status as it was settled (an Unload may already have removed it).
      Loaded ready;
      ready.layered = layered;
      for (const std::shared_ptr<const Model>& model : loaded) {
        ModelStatus status;
        status.name = model->name;
        status.state = ModelState::kReady;
        status.model = model;
        ready.models.push_back(std::move(status));
      }
      job.done(std::move(ready));
    }
  }
}

}  // namespace attnserve::server
