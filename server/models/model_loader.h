#ifndef ATTNSERVE_SERVER_MODELS_MODEL_LOADER_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_LOADER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/models/model_registry.h"
#include "server/models/model_repository.h"

namespace attnserve::server {

struct ModelLoaderOptions {
  // Runs a new model once before it turns READY (the server runs a small
  // forward pass on the compute executor); each layer of a folder of layers.
  // Empty: no warm-up.
  std::function<absl::Status(const Model&)> warm_up;
  // Called once a model turns READY, with the folder it was loaded from (its
  // own name for one model), and when one is unloaded (metrics); for a folder
  // of layers, once per layer model.
  std::function<void(const Model&, absl::string_view folder)> on_ready;
  std::function<void(absl::string_view)> on_unloaded;
  // Loads waiting for the loader thread; more are refused (RESOURCE_EXHAUSTED).
  int64_t max_pending = 64;
};

// Loads models from a repository into a registry on a thread of its own, so
// no gRPC thread reads a file and serving other models never waits for a load.
//
// Thread-safe. `repository` and `registry` must outlive the loader.
class ModelLoader {
 public:
  // A load's answer: the READY status of the folder's model, or (layered: a
  // config.json with "layers") of each of its layers' models in order.
  struct Loaded {
    std::vector<ModelStatus> models;
    bool layered = false;
  };
  using Done = std::function<void(absl::StatusOr<Loaded>)>;

  ModelLoader(const ModelRepository* repository, ModelRegistry* registry,
              ModelLoaderOptions options);
  ~ModelLoader();  // Shutdown()
  ModelLoader(const ModelLoader&) = delete;
  ModelLoader& operator=(const ModelLoader&) = delete;

  // Marks `name` LOADING and queues its load. When the load is over, `done`
  // runs on the loader thread with the model's READY status (a folder of
  // layers: its layers', READY together; ALREADY_EXISTS when a layer's name
  // is another model's), or: NOT_FOUND
  // (no such folder; the name is forgotten), FAILED_PRECONDITION with the
  // reason (the model stays FAILED; among the reasons, weights over
  // --max_model_bytes), RESOURCE_EXHAUSTED (memory ran out while loading: the
  // model stays FAILED, a later retry may pass), ABORTED
  // (unloaded meanwhile), UNAVAILABLE (the loader shut down first). No load
  // ends the process: std::bad_alloc is caught and fails that model alone.
  // Returns without calling `done`:
  // INVALID_ARGUMENT for an invalid name, NOT_FOUND when the repository has
  // no such folder (for a layer's name "gpt2.3": saying to load 'gpt2'),
  // ALREADY_EXISTS when it is loading or ready, FAILED_PRECONDITION for a
  // loaded layer of a folder (naming the folder), RESOURCE_EXHAUSTED when max_pending loads wait, UNAVAILABLE after
  // Shutdown.
  absl::Status Load(absl::string_view name, Done done);

  // Removes `name` from the registry (calls in flight finish on it; a load in
  // progress is dropped when it ends); a folder of layers, all its layers.
  // NOT_FOUND when unknown; FAILED_PRECONDITION for one layer of a folder.
  absl::Status Unload(absl::string_view name);

  // Finishes the load in progress, answers the queued ones UNAVAILABLE and
  // stops the thread. Idempotent.
  void Shutdown();

 private:
  struct Job {
    std::string name;
    uint64_t ticket;
    Done done;
  };
  void Run();
  // Loads and warms up folder `name`'s model(s); RESOURCE_EXHAUSTED when
  // memory runs out.
  absl::StatusOr<FolderModels> LoadAndWarmUp(
      const std::string& name) const;

  // Constant after construction.
  const ModelRepository* const repository_;
  ModelRegistry* const registry_;
  const ModelLoaderOptions options_;

  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_LOADER_H_
