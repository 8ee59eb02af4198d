#ifndef ATTNSERVE_SERVER_MODELS_MODEL_REPOSITORY_H_
#define ATTNSERVE_SERVER_MODELS_MODEL_REPOSITORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/common/server_options.h"
#include "server/models/model_registry.h"

namespace attnserve::server {

struct ModelRepositoryOptions {
  // Most bytes one model's weights may take as FP32, as its checkpoint's
  // header declares them (--max_model_bytes). Must be positive.
  int64_t max_model_bytes = ServerOptions().max_model_bytes;
};

// A --model_repository folder: one subfolder per model, holding config.json
// (core/checkpoint_layouts.h, README "Model repository") and the safetensors
// weights it names.
//
// Nothing outside the repository is opened: a model name must be one plain
// path component ([A-Za-z0-9][A-Za-z0-9._-]{0,127}: no '/', no "..", not
// absolute), and every file is opened relative to the repository's directory
// with openat2(RESOLVE_BENEATH), so a symlink (or "..") that would leave the
// repository fails the open before anything outside is touched. Symlinks that
// stay inside are followed. Where the kernel has no openat2 (before Linux
// 5.6, or a seccomp profile that refuses it), every path component is opened
// with O_NOFOLLOW instead: no symlink at all is followed. Files are opened
// O_NONBLOCK and must be regular files (a FIFO or device is refused, never
// read).
//
// A folder whose config.json has "layers" holds several layers of one
// checkpoint: it loads as one model per layer, named "<folder>.<i>"
// (LayerModelName), all read from one open of the weights file.
//
// A model's weights are sized from its checkpoint's header before any tensor
// is read (core::CheckpointWeightBytes); a model over max_model_bytes fails
// with that reason (for a folder of layers, the limit holds for each layer),
// and running out of memory while loading fails the one folder
// (std::bad_alloc is caught), never the process.
//
// Thread-safe (the directory descriptor is only read).
class ModelRepository {
 public:
  // Opens the directory `root`. INVALID_ARGUMENT naming --model_repository
  // when it is not a readable directory, naming --max_model_bytes when that
  // is not positive.
  static absl::StatusOr<std::unique_ptr<ModelRepository>> Create(
      const std::string& root, const ModelRepositoryOptions& options = {});
  ~ModelRepository();
  ModelRepository(const ModelRepository&) = delete;
  ModelRepository& operator=(const ModelRepository&) = delete;

  // OK for a valid model name; INVALID_ARGUMENT saying why otherwise.
  static absl::Status ValidateModelName(absl::string_view name);

  // The model name of layer `layer` of a folder of layers: "<folder>.<layer>"
  // (e.g. "gpt2.3"), a valid model name when it is at most 128 bytes.
  static std::string LayerModelName(absl::string_view folder, int64_t layer);

  // The names of the repository's subfolders (and symlinks) with valid model
  // names, sorted. Hidden entries and other names are skipped.
  absl::StatusOr<std::vector<std::string>> ListModelNames() const;

  // OK when the repository has a folder `name` (one open beneath the root,
  // nothing read). INVALID_ARGUMENT for an invalid name; NOT_FOUND when it
  // has none (for a name like "gpt2.3", the message says a folder's layers
  // load with their folder: load 'gpt2'); FAILED_PRECONDITION when the path
  // leaves the repository or cannot be opened.
  absl::Status FindFolder(absl::string_view name) const;

  // Reads folder `name`: config.json, then the tensors from its weights file:
  // one model named `name`, or for a config.json with "layers", one model per
  // layer in order, named LayerModelName(name, i) (FolderModels::layered
  // then). The weights file is opened and its header parsed once, each tensor
  // read once; every layer's tensors and bytes (--max_model_bytes holds for
  // each layer) are checked from the header before any tensor is read.
  // INVALID_ARGUMENT for an invalid name, NOT_FOUND when the repository has
  // no such folder (FindFolder), FAILED_PRECONDITION with the reason (naming
  // the file and, where it applies, the tensor) for anything wrong inside it:
  // a path leaving the repository, a missing, malformed or mis-shaped file or
  // tensor, weights over max_model_bytes (the message names
  // --max_model_bytes, the bytes needed and the limit; nothing is read from
  // the tensors); RESOURCE_EXHAUSTED when memory runs out while loading (a
  // later attempt may pass). A
  // layer's reason names the layer, its model and its prefix ("layer 3 of 12
  // (model 'gpt2.3', prefix 'h.3.attn.'): ..."), and a layer model name over
  // 128 bytes is FAILED_PRECONDITION naming config.json's layers before any
  // tensor is read.
  absl::StatusOr<FolderModels> LoadFolder(absl::string_view name) const;

  const std::string& root() const { return root_; }
  const ModelRepositoryOptions& options() const { return options_; }

 private:
  ModelRepository(std::string root, int root_fd, const ModelRepositoryOptions& options)
      : root_(std::move(root)), root_fd_(root_fd), options_(options) {}
  // LoadFolder without its catch of std::bad_alloc.
  absl::StatusOr<FolderModels> LoadFolderOrThrow(const std::string& folder) const;
  // Opens `relative` (below the root) read-only with `flags` added; the fd, or
  // an errno-derived status naming the path.
  absl::StatusOr<int> OpenBeneath(const std::string& relative, int flags) const;
  // The text of `relative`, a regular file of at most `max_bytes`.
  absl::StatusOr<std::string> ReadSmallFile(const std::string& relative, int64_t max_bytes) const;

  const std::string root_;
  const int root_fd_;
  const ModelRepositoryOptions options_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_MODELS_MODEL_REPOSITORY_H_
