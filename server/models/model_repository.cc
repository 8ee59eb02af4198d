#include "server/models/model_repository.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/attention_layer.h"
#include "core/checkpoint_layouts.h"
#include "core/safetensors.h"
#include "core/status_macros.h"

namespace attnserve::server {
namespace {

constexpr size_t kMaxModelNameBytes = 128;

// Closes a descriptor when it goes out of scope, unless released.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// FAILED_PRECONDITION with `status`'s message: something inside a model's
// folder is wrong (not the caller's request). RESOURCE_EXHAUSTED (memory ran
// out) stays: the same folder may load later.
absl::Status InModel(const absl::Status& status) {
  if (absl::IsResourceExhausted(status)) return status;
  return absl::FailedPreconditionError(status.message());
}

// openat2 with RESOLVE_BENEATH; -1 with errno ENOSYS where the kernel (or a
// seccomp filter) does not offer it.
int OpenAt2Beneath(int dir_fd, const char* path, int flags) {
  open_how how{};
  how.flags = static_cast<uint64_t>(flags);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  return static_cast<int>(::syscall(SYS_openat2, dir_fd, path, &how, sizeof(how)));
}

// Without openat2: every component opened with O_NOFOLLOW, so no symlink is
// followed at all (and "." or ".." components are refused).
int OpenNoFollow(int dir_fd, const std::string& relative, int flags) {
  std::vector<std::string> parts = absl::StrSplit(relative, '/');
  int current = dir_fd;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].empty() || parts[i] == "." || parts[i] == "..") {
      if (current != dir_fd) ::close(current);
      errno = EXDEV;
      return -1;
    }
    const bool last = i + 1 == parts.size();
    const int next = ::openat(current, parts[i].c_str(),
                              last ? (flags | O_NOFOLLOW) : (O_PATH | O_DIRECTORY | O_NOFOLLOW |
                                                             O_CLOEXEC));
    const int saved = errno;
    if (current != dir_fd) ::close(current);
    if (next < 0) {
      errno = saved;
      return -1;
    }
    current = next;
  }
  return current;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRepository>> ModelRepository::Create(
    const std::string& root, const ModelRepositoryOptions& options) {
  if (options.max_model_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_model_bytes: must be positive, got ",
                                                   options.max_model_bytes));
  }
  const int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--model_repository: cannot open '", root,
                                                   "' as a directory: ", std::strerror(errno)));
  }
  return std::unique_ptr<ModelRepository>(new ModelRepository(root, fd, options));
}

ModelRepository::~ModelRepository() { ::close(root_fd_); }

absl::Status ModelRepository::ValidateModelName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("name: required");
  if (name.size() > kMaxModelNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: longer than ", kMaxModelNameBytes, " bytes"));
  }
  auto alnum = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
  };
  if (!alnum(name[0])) {
    return absl::InvalidArgumentError(
        "name: must start with a letter or digit (one folder of the model repository: no "
        "absolute path, no '.' or '..')");
  }
  for (char c : name) {
    if (!alnum(c) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          "name: may hold only letters, digits, '.', '_' and '-' (one folder of the model "
          "repository: no '/')");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ModelRepository::OpenBeneath(const std::string& relative, int flags) const {
  flags |= O_CLOEXEC;
  int fd = OpenAt2Beneath(root_fd_, relative.c_str(), flags);
  if (fd < 0 && (errno == ENOSYS || errno == EPERM)) fd = OpenNoFollow(root_fd_, relative, flags);
  if (fd >= 0) return fd;
  const int error = errno;
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(absl::StrCat(relative, ": does not exist"));
    case EXDEV:
    case ELOOP:
      return absl::FailedPreconditionError(absl::StrCat(
          relative, ": resolves outside the model repository (a symlink or '..'); refused"));
    default:
      return absl::FailedPreconditionError(
          absl::StrCat(relative, ": cannot open: ", std::strerror(error)));
  }
}

absl::StatusOr<std::vector<std::string>> ModelRepository::ListModelNames() const {
  const int fd = ::openat(root_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--model_repository '", root_, "': cannot list: ", std::strerror(errno)));
  }
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("--model_repository '", root_, "': cannot list: ", std::strerror(errno)));
  }
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) {
    const bool folder_like =
        entry->d_type == DT_DIR || entry->d_type == DT_LNK || entry->d_type == DT_UNKNOWN;
    if (folder_like && ValidateModelName(entry->d_name).ok()) names.emplace_back(entry->d_name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<std::string> ModelRepository::ReadSmallFile(const std::string& relative,
                                                           int64_t max_bytes) const {
  absl::StatusOr<int> fd = OpenBeneath(relative, O_RDONLY | O_NONBLOCK);
  if (!fd.ok()) return fd.status();
  FdCloser closer(*fd);
  struct stat st;
  if (::fstat(closer.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(relative, ": not a regular file"));
  }
  // Sized by the file, so bounded before the buffer is: a file that grows
  // meanwhile is read only up to this size.
  if (st.st_size > max_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(relative, ": ", st.st_size, " bytes, over the limit ", max_bytes));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(closer.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  text.resize(done);
  return text;
}

std::string ModelRepository::LayerModelName(absl::string_view folder, int64_t layer) {
  return absl::StrCat(folder, ".", layer);
}

absl::Status ModelRepository::FindFolder(absl::string_view name) const {
  ATTNSERVE_RETURN_IF_ERROR(ValidateModelName(name));
  const std::string folder(name);
  absl::StatusOr<int> dir = OpenBeneath(folder, O_RDONLY | O_DIRECTORY);
  if (dir.ok()) {
    ::close(*dir);
    return absl::OkStatus();
  }
  if (!absl::IsNotFound(dir.status())) return dir.status();
  // "gpt2.3" may be meant as a layer of folder "gpt2": say how those load.
  const size_t dot = folder.rfind('.');
  const bool layer_like = dot != std::string::npos && dot > 0 && dot + 1 < folder.size() &&
                          std::all_of(folder.begin() + dot + 1, folder.end(),
                                      [](char c) { return c >= '0' && c <= '9'; });
  return absl::NotFoundError(absl::StrCat(
      "the model repository has no folder '", folder, "'",
      layer_like ? absl::StrCat(" (the layers of a folder of layers load with their folder: load '",
                                folder.substr(0, dot), "')")
                 : ""));
}

absl::StatusOr<FolderModels> ModelRepository::LoadFolder(absl::string_view name) const {
  ATTNSERVE_RETURN_IF_ERROR(ValidateModelName(name));
  const std::string folder(name);
  // Every size is checked before it is allocated; this is the last line for
  // what no check can see (the machine's memory running out).
  auto out_of_memory = [&](const char* what) {
    return absl::ResourceExhaustedError(
        absl::StrCat(folder, ": out of memory while loading (", what,
                     "); a later attempt, with more memory free, may pass"));
  };
  try {
    return LoadFolderOrThrow(folder);
  } catch (const std::bad_alloc&) {
    return out_of_memory("std::bad_alloc");
  } catch (const std::length_error&) {
    return out_of_memory("std::length_error");
  }
}

absl::StatusOr<FolderModels> ModelRepository::LoadFolderOrThrow(
    const std::string& folder) const {
  // The folder itself: NOT_FOUND when absent (nothing to load), refused
  // when it leaves the repository.
  ATTNSERVE_RETURN_IF_ERROR(FindFolder(folder));

  const std::string config_path = absl::StrCat(folder, "/config.json");
  absl::StatusOr<std::string> config_text =
      ReadSmallFile(config_path, core::kMaxCheckpointConfigBytes);
  if (!config_text.ok()) return InModel(config_text.status());
  absl::StatusOr<core::CheckpointConfig> config =
      core::ParseCheckpointConfig(*config_text, config_path);
  if (!config.ok()) return InModel(config.status());
  // Every model's name first: a layer's over the limit fails before any
  // file is read.
  const size_t layers = config->layer_prefixes.size();
  std::vector<std::string> names;
  if (layers == 0) names.push_back(folder);
  for (size_t i = 0; i < layers; ++i) {
    names.push_back(LayerModelName(folder, static_cast<int64_t>(i)));
    if (!ValidateModelName(names.back()).ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          config_path, ": layers: layer ", i, "'s model name '", names.back(),
          "' is longer than ", kMaxModelNameBytes,
          " bytes (a layer's model is named <folder>.<layer>); shorten the folder's name"));
    }
  }

  const std::string weights_path = absl::StrCat(folder, "/", config->weights);
  absl::StatusOr<int> weights_fd = OpenBeneath(weights_path, O_RDONLY | O_NONBLOCK);
  if (!weights_fd.ok()) return InModel(weights_fd.status());
  absl::StatusOr<core::SafetensorsFile> file =
      core::SafetensorsFile::FromFd(*weights_fd, weights_path);  // owns the fd
  if (!file.ok()) return InModel(file.status());

  // A layer's reason says which layer (its model and prefix) before the
  // file's and tensor's names.
  auto of_layer = [&](size_t i, const absl::Status& status) {
    if (layers == 0) return status;
    return absl::Status(status.code(),
                        absl::StrCat("layer ", i, " of ", layers, " (model '", names[i],
                                     "', prefix '", config->layer_prefixes[i],
                                     "'): ", status.message()));
  };
  const core::CheckpointLoadOptions budget = {.max_weight_bytes = options_.max_model_bytes,
                                              .budget_name = "--max_model_bytes"};
  // Every layer's tensors (presence, shapes, dtypes) and bytes against the
  // budget, from the header, before any tensor of any layer is read.
  for (size_t i = 0; layers > 0 && i < layers; ++i) {
    absl::StatusOr<core::CheckpointConfig> one = core::LayerOfCheckpoint(*config, i);
    if (!one.ok()) return InModel(of_layer(i, one.status()));
    absl::StatusOr<int64_t> bytes = core::CheckCheckpointBudget(*file, *one, budget);
    if (!bytes.ok()) return InModel(of_layer(i, bytes.status()));
  }

  FolderModels read;
  read.layered = layers > 0;
  std::vector<std::shared_ptr<const Model>>& models = read.models;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StatusOr<core::CheckpointConfig> layer_config =
        layers == 0 ? absl::StatusOr<core::CheckpointConfig>(*config)
                    : core::LayerOfCheckpoint(*config, i);
    if (!layer_config.ok()) return InModel(of_layer(i, layer_config.status()));
    const core::CheckpointConfig& one = *layer_config;
    auto of_layer_i = [&](const absl::Status& status) { return of_layer(i, status); };
    // The budget is checked from the header before any tensor is read (for
    // each layer on its own).
    absl::StatusOr<core::AttentionWeights> weights =
        core::LoadCheckpointWeights(*file, one, budget);
    if (!weights.ok()) return InModel(of_layer_i(weights.status()));

    auto model = std::make_shared<Model>();
    model->name = names[i];
    model->causal = one.causal;
    const std::string which =
        layers == 0 ? "" : absl::StrCat("layer ", i, " of ", layers, " of ");
    model->description =
        one.description.empty()
            ? absl::StrCat(which, core::WeightLayoutName(one.layout), " checkpoint ", one.weights,
                           one.prefix.empty() ? "" : absl::StrCat(" (", one.prefix, "*)"))
            : (layers == 0 ? one.description
                           : absl::StrCat(one.description, " (layer ", i, " of ", layers, ", ",
                                          one.prefix, "*)"));
    absl::StatusOr<std::unique_ptr<core::AttentionLayer>> layer =
        core::AttentionLayer::Create(one.head_config, *std::move(weights));
    if (!layer.ok()) {
      return InModel(of_layer_i(absl::Status(
          layer.status().code(), absl::StrCat(weights_path, ": ", layer.status().message()))));
    }
    model->layer = *std::move(layer);
    models.push_back(std::move(model));
  }
  return read;
}

}  // namespace attnserve::server
