#ifndef ATTNSERVE_TESTS_SERVER_MODELS_MODEL_TEST_REPOSITORY_H_
#define ATTNSERVE_TESTS_SERVER_MODELS_MODEL_TEST_REPOSITORY_H_

// A model repository in a fresh temporary folder, with model folders written
// from seeded weights in any layout (tests/core/checkpoint_writer.h).

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "core/attention_weights.h"
#include "core/head_config.h"
#include "server/models/model_repository.h"
#include "tests/core/checkpoint_writer.h"

namespace attnserve::testing {

class TestRepository {
 public:
  TestRepository() {
    std::string pattern = std::filesystem::temp_directory_path() / "attnserve_repo_XXXXXX";
    base_ = ::mkdtemp(pattern.data());
    std::filesystem::create_directories(root());
  }
  ~TestRepository() {
    std::error_code ignored;
    std::filesystem::remove_all(base_, ignored);
  }
  TestRepository(const TestRepository&) = delete;
  TestRepository& operator=(const TestRepository&) = delete;

  // The repository folder; base() holds it and room for "outside" files.
  std::string root() const { return base_ + "/repo"; }
  const std::string& base() const { return base_; }

  // Writes model `name`: `c`'s layout of SeededWeights(resolved c.head,
  // seed), and its config.json. Returns the weights written.
  core::AttentionWeights AddModel(const std::string& name, const LayoutCase& c, uint64_t seed) {
    const std::string folder = root() + "/" + name;
    std::filesystem::create_directories(folder);
    core::HeadConfig h = *core::ResolveHeadConfig(c.head);
    core::AttentionWeights w = core::SeededWeights(h, seed);
    WriteLayout(c, h, w).Write(folder + "/model.safetensors");
    WriteText(folder + "/config.json", ConfigJson(c));
    return w;
  }

  // Writes folder `name` holding `weights.size()` layers of one GPT-2 style
  // checkpoint (c.layout, c.head, c.dtype; layer i under "h.<i>.attn."), and
  // a config.json with `layers_json` as its "layers" (e.g.
  // {"count": 3, "prefix": "h.{layer}.attn."}). Returns the checkpoint's path.
  std::string AddLayers(const std::string& name, const LayoutCase& c,
                        const std::vector<core::AttentionWeights>& weights,
                        const std::string& layers_json) {
    const std::string folder = root() + "/" + name;
    std::filesystem::create_directories(folder);
    std::vector<std::string> prefixes;
    for (size_t i = 0; i < weights.size(); ++i) prefixes.push_back(absl::StrCat("h.", i, ".attn."));
    const core::HeadConfig h = *core::ResolveHeadConfig(c.head);
    WriteLayers(c, h, weights, prefixes).Write(folder + "/model.safetensors");
    std::string config = ConfigJson(c);  // {"layout":..,"prefix":"..",...}
    const std::string prefix_field = absl::StrCat("\"prefix\":\"", c.prefix, "\",");
    config.replace(config.find(prefix_field), prefix_field.size(),
                   absl::StrCat("\"layers\":", layers_json, ","));
    WriteText(folder + "/config.json", config);
    return folder + "/model.safetensors";
  }

  // A small BERT-layout model (d_model 16, 2 heads).
  core::AttentionWeights AddSmallModel(const std::string& name, uint64_t seed) {
    LayoutCase c{"bert", {}, "encoder.layer.0.attention.", "F32"};
    c.head.d_model = 16;
    c.head.num_heads = 2;
    return AddModel(name, c, seed);
  }

  static void WriteText(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  }

 private:
  std::string base_;
};

// The one model of folder `name` (ModelRepository::LoadFolder's errors);
// FAILED_PRECONDITION for a folder of layers.
inline absl::StatusOr<std::shared_ptr<const server::Model>> LoadOneModel(
    const server::ModelRepository& repository, absl::string_view name) {
  absl::StatusOr<server::FolderModels> read = repository.LoadFolder(name);
  if (!read.ok()) return read.status();
  if (read->layered || read->models.size() != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": a folder of ", read->models.size(), " layers"));
  }
  return read->models[0];
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_MODELS_MODEL_TEST_REPOSITORY_H_
