#ifndef ATTNSERVE_TESTS_SERVER_MODELS_MODEL_TEST_REPOSITORY_H_
#define ATTNSERVE_TESTS_SERVER_MODELS_MODEL_TEST_REPOSITORY_H_

// A model repository in a fresh temporary folder, with model folders written
// from seeded weights in any layout (tests/core/checkpoint_writer.h).

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/attention_weights.h"
#include "core/head_config.h"
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

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_SERVER_MODELS_MODEL_TEST_REPOSITORY_H_
