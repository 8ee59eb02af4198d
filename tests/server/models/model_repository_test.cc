// The model repository: names and symlinks that would leave it are refused
// before anything outside is opened; each defect in a model folder fails that
// model with its reason.
#include "server/models/model_repository.h"

#include <fcntl.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_weights.h"
#include "core/head_config.h"
#include "tests/core/reference_attention.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/safetensors_writer.h"
#include "tests/core/status_matchers.h"
#include "tests/server/models/model_test_repository.h"

namespace attnserve::server {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::LayoutCase;
using ::attnserve::testing::SafetensorsWriter;
using ::attnserve::testing::StatusIs;
using ::attnserve::testing::TestRepository;

// Watches a folder for any open or read of the files in it.
class OpenWatch {
 public:
  explicit OpenWatch(const std::string& folder) {
    fd_ = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    inotify_add_watch(fd_, folder.c_str(), IN_OPEN | IN_ACCESS);
  }
  ~OpenWatch() { close(fd_); }
  // The number of events since the last call.
  int Events() {
    char buffer[4096];
    int events = 0;
    while (true) {
      const ssize_t n = read(fd_, buffer, sizeof(buffer));
      if (n <= 0) break;
      for (ssize_t off = 0; off < n;) {
        const auto* e = reinterpret_cast<const inotify_event*>(buffer + off);
        ++events;
        off += sizeof(inotify_event) + e->len;
      }
    }
    return events;
  }

 private:
  int fd_ = -1;
};

TEST(ModelRepository, NamesThatAreNotOnePlainFolderAreRefused) {
  TestRepository repo;
  repo.AddSmallModel("good", 1);
  auto repository = ModelRepository::Create(repo.root());
  ASSERT_THAT(repository, IsOk());
  for (const std::string& name : std::vector<std::string>{"", "a/b", "..", ".", "../repo/good", "/etc", "/tmp/x", ".hidden",
                                 "good/", "bad name", std::string(200, 'a')}) {
    SCOPED_TRACE(name);
    EXPECT_THAT(testing::LoadOneModel(**repository, name), StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  }
  EXPECT_THAT(testing::LoadOneModel(**repository, "absent"),
              StatusIs(absl::StatusCode::kNotFound, "no folder 'absent'"));
  absl::StatusOr<std::shared_ptr<const Model>> good = testing::LoadOneModel(**repository, "good");
  ASSERT_THAT(good, IsOk());
  EXPECT_EQ((*good)->layer->config().d_model, 16);
  EXPECT_FALSE((*good)->causal);
}

TEST(ModelRepository, SymlinksLeavingTheRepositoryAreRefusedBeforeAnythingOutsideIsOpened) {
  TestRepository repo;
  repo.AddSmallModel("good", 1);
  // Outside the repository: a complete model folder, and a FIFO (opening it
  // for reading without O_NONBLOCK would block).
  const std::string outside = repo.base() + "/outside";
  std::filesystem::create_directories(outside);
  std::filesystem::copy(repo.root() + "/good/config.json", outside + "/config.json");
  std::filesystem::copy(repo.root() + "/good/model.safetensors", outside + "/model.safetensors");
  ASSERT_EQ(mkfifo((outside + "/fifo").c_str(), 0600), 0);
  chmod((outside + "/model.safetensors").c_str(), 0);

  // A model folder that is a symlink out; a model whose weights are a
  // symlink to the FIFO outside; one whose weights are an absolute symlink
  // to a file outside; one that climbs out with "..".
  std::filesystem::create_directory_symlink(outside, repo.root() + "/escape");
  std::filesystem::create_directories(repo.root() + "/fifo_model");
  std::filesystem::copy(repo.root() + "/good/config.json", repo.root() + "/fifo_model/config.json");
  std::filesystem::create_symlink("../../outside/fifo",
                                  repo.root() + "/fifo_model/model.safetensors");
  std::filesystem::create_directories(repo.root() + "/absolute");
  std::filesystem::copy(repo.root() + "/good/config.json", repo.root() + "/absolute/config.json");
  std::filesystem::create_symlink(outside + "/model.safetensors",
                                  repo.root() + "/absolute/model.safetensors");
  // A symlink that stays inside is followed.
  std::filesystem::create_directory_symlink("good", repo.root() + "/alias");

  auto repository = ModelRepository::Create(repo.root());
  ASSERT_THAT(repository, IsOk());
  OpenWatch watch(outside);
  for (const char* name : {"escape", "fifo_model", "absolute"}) {
    SCOPED_TRACE(name);
    EXPECT_THAT(testing::LoadOneModel(**repository, name),
                StatusIs(absl::StatusCode::kFailedPrecondition, "resolves outside the model repository"));
  }
  EXPECT_EQ(watch.Events(), 0) << "a file outside the repository was opened";
  EXPECT_THAT(testing::LoadOneModel(**repository, "alias"), IsOk());

  // The watch sees an open when there is one (the check above can fail).
  const int fd = open((outside + "/config.json").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  close(fd);
  EXPECT_GT(watch.Events(), 0);

  absl::StatusOr<std::vector<std::string>> names = (*repository)->ListModelNames();
  ASSERT_THAT(names, IsOk());
  EXPECT_THAT(*names, ::testing::ElementsAre("absolute", "alias", "escape", "fifo_model", "good"));
}

TEST(ModelRepository, EachDefectFailsTheModelWithItsReason) {
  TestRepository repo;
  repo.AddSmallModel("good", 1);
  const std::string good = repo.root() + "/good/model.safetensors";
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string config = repo.root() + "/good/config.json";
  struct Case {
    std::string name;
    std::string weights;  // bytes of model.safetensors
    std::string config;   // empty: the good config
    std::string reason;
  };
  SafetensorsWriter i32;
  i32.AddRaw("encoder.layer.0.attention.self.query.weight", "I32", "[16,16]",
             std::string(16 * 16 * 4, '\0'));
  const std::vector<Case> cases = {
      {"truncated", bytes.substr(0, bytes.size() - 100), "", "out of range, or the file is truncated"},
      {"not_json", SafetensorsWriter::Assemble("{oops", ""), "", "header is not valid JSON"},
      {"header_past_eof", bytes.substr(0, 8), "", "passes the end of the file"},
      {"wrong_dtype", i32.Bytes(), "", "has dtype I32; weights must be F32, BF16 or F16"},
      {"mis_shaped", bytes,
       "{\"layout\":\"bert\",\"prefix\":\"encoder.layer.0.attention.\",\"d_model\":32,\"num_heads\":2}",
       "has shape [16, 16]; the head configuration needs [32, 32]"},
      {"other_layer", bytes,
       "{\"layout\":\"bert\",\"prefix\":\"encoder.layer.5.attention.\",\"d_model\":16,\"num_heads\":2}",
       "no tensor named 'encoder.layer.5.attention.self.query.weight'"},
      {"bad_config", bytes, "{\"layout\":\"bert\"", "config.json: not valid JSON"},
      {"no_weights", "", "", "model.safetensors: does not exist"},
  };
  for (const Case& c : cases) {
    const std::string folder = repo.root() + "/" + c.name;
    std::filesystem::create_directories(folder);
    if (c.name != "no_weights") TestRepository::WriteText(folder + "/model.safetensors", c.weights);
    if (c.config.empty()) {
      std::filesystem::copy(config, folder + "/config.json");
    } else {
      TestRepository::WriteText(folder + "/config.json", c.config);
    }
  }
  auto repository = ModelRepository::Create(repo.root());
  ASSERT_THAT(repository, IsOk());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT(testing::LoadOneModel(**repository, c.name),
                StatusIs(absl::StatusCode::kFailedPrecondition, c.reason));
    // The reason names the file.
    EXPECT_THAT(testing::LoadOneModel(**repository, c.name),
                StatusIs(absl::StatusCode::kFailedPrecondition, c.name + "/"));
  }
  EXPECT_THAT(testing::LoadOneModel(**repository, "good"), IsOk());
}

// The output of `model` on `x` [1, tokens, d_model] (not causal).
std::vector<float> OutputOf(const Model& model, const std::vector<float>& x) {
  const int64_t d = model.layer->config().d_model;
  core::LayerInputs inputs;
  inputs.hidden_states = x;
  inputs.layout = *core::SequenceLayout::Padded(1, static_cast<int64_t>(x.size()) / d);
  std::vector<float> output(x.size());
  core::ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  EXPECT_THAT(model.layer->Forward(inputs, {}, outputs), IsOk());
  return output;
}

// A folder whose config.json has "layers" loads one model per layer, named
// <folder>.<i>, from one checkpoint holding different weights per layer:
// each is the model a one-layer folder with that layer's prefix loads (the
// same output bits), and each computes its own weights' layer (the double
// reference, 1e-5).
TEST(ModelRepository, AFolderOfLayersLoadsEachLayerAsItsOwnModel) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  TestRepository repo;
  LayoutCase c{"gpt2", {}, "unused.", "BF16"};
  c.head.d_model = 16;
  c.head.num_heads = 4;
  const core::HeadConfig h = *core::ResolveHeadConfig(c.head);
  std::vector<core::AttentionWeights> weights;
  for (uint64_t i = 0; i < 3; ++i) weights.push_back(core::SeededWeights(h, seed + i));
  const std::string checkpoint =
      repo.AddLayers("net", c, weights, R"({"count": 3, "prefix": "h.{layer}.attn."})");
  // One-layer folders over the same file.
  for (int i = 0; i < 3; ++i) {
    const std::string folder = absl::StrCat(repo.root(), "/single", i);
    std::filesystem::create_directories(folder);
    std::filesystem::copy(checkpoint, folder + "/model.safetensors");
    LayoutCase one = c;
    one.prefix = absl::StrCat("h.", i, ".attn.");
    TestRepository::WriteText(folder + "/config.json", testing::ConfigJson(one));
  }
  auto repository = ModelRepository::Create(repo.root());
  ASSERT_THAT(repository, IsOk());
  EXPECT_EQ(*(*repository)->ListModelNames(),
            (std::vector<std::string>{"net", "single0", "single1", "single2"}));
  absl::StatusOr<FolderModels> folder = (*repository)->LoadFolder("net");
  ASSERT_THAT(folder, IsOk());
  EXPECT_TRUE(folder->layered);
  const std::vector<std::shared_ptr<const Model>>* layers = &folder->models;
  ASSERT_EQ(layers->size(), 3u);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(5 * 16);
  for (float& v : x) v = normal(rng);
  std::vector<std::vector<float>> outputs;
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(absl::StrCat("layer ", i));
    const Model& layer = *(*layers)[static_cast<size_t>(i)];
    EXPECT_EQ(layer.name, absl::StrCat("net.", i));
    EXPECT_THAT(ModelRepository::ValidateModelName(layer.name), IsOk());
    EXPECT_TRUE(layer.causal);
    EXPECT_THAT(layer.description, ::testing::HasSubstr(absl::StrCat("layer ", i, " of 3")));
    EXPECT_THAT(layer.description, ::testing::HasSubstr(absl::StrCat("h.", i, ".attn.")));
    absl::StatusOr<std::shared_ptr<const Model>> single =
        testing::LoadOneModel(**repository, absl::StrCat("single", i));
    ASSERT_THAT(single, IsOk());
    outputs.push_back(OutputOf(layer, x));
    EXPECT_EQ(outputs.back(), OutputOf(**single, x));
    // The weights as stored (BF16) are the reference's.
    core::AttentionWeights stored = weights[static_cast<size_t>(i)];
    for (std::vector<float>* w : {&stored.w_q, &stored.w_k, &stored.w_v, &stored.w_o, &stored.b_q,
                                  &stored.b_k, &stored.b_v, &stored.b_o}) {
      for (float& v : *w) v = static_cast<float>(testing::RoundToBf16(v));
    }
    core::LayerInputs inputs;
    inputs.hidden_states = x;
    inputs.layout = *core::SequenceLayout::Padded(1, 5);
    EXPECT_LE(testing::RelativeFrobeniusError(outputs.back(),
                                              testing::ReferenceLayer(h, stored, inputs).output),
              1e-5);
  }
  EXPECT_NE(outputs[0], outputs[1]);
  EXPECT_NE(outputs[1], outputs[2]);
  // A layer alone is no folder; the message says how it loads.
  EXPECT_THAT((*repository)->LoadFolder("net.1"),
              StatusIs(absl::StatusCode::kNotFound, "load 'net'"));
  // An explicit list of prefixes, in its own order.
  TestRepository::WriteText(repo.root() + "/net/config.json",
                            R"({"layout":"gpt2","d_model":16,"num_heads":4,)"
                            R"("layers":{"prefixes":["h.2.attn.","h.0.attn."]}})");
  absl::StatusOr<FolderModels> listed = (*repository)->LoadFolder("net");
  ASSERT_THAT(listed, IsOk());
  ASSERT_EQ(listed->models.size(), 2u);
  EXPECT_EQ(listed->models[0]->name, "net.0");
  EXPECT_EQ(OutputOf(*listed->models[0], x), outputs[2]);
  EXPECT_EQ(OutputOf(*listed->models[1], x), outputs[0]);
}

// What is wrong with one layer names the layer, its model and prefix, and
// the tensor or the field; --max_model_bytes holds for each layer; a layer's
// model name over 128 bytes is refused naming config.json's layers.
TEST(ModelRepository, ALayersDefectNamesTheLayerAndTheField) {
  TestRepository repo;
  LayoutCase c{"gpt2", {}, "unused.", "F32"};
  c.head.d_model = 16;
  c.head.num_heads = 2;
  const core::HeadConfig h = *core::ResolveHeadConfig(c.head);
  const std::vector<core::AttentionWeights> two = {core::SeededWeights(h, 1),
                                                   core::SeededWeights(h, 2)};
  // Three layers asked of a checkpoint of two.
  repo.AddLayers("short", c, two, R"({"count": 3, "prefix": "h.{layer}.attn."})");
  // A config mistake inside layers.
  repo.AddLayers("typo", c, two, R"({"count": 2, "prefix": "h.attn."})");
  // The longest folder name whose layer names fit, and one byte more.
  const std::string fits(126, 'f');
  const std::string over(127, 'o');
  repo.AddLayers(fits, c, two, R"({"count": 2, "prefix": "h.{layer}.attn."})");
  repo.AddLayers(over, c, two, R"({"count": 2, "prefix": "h.{layer}.attn."})");
  // One layer's weights (FP32: 4 x (16 x 48 + 48 + 16 x 16 + 16) = 4352 bytes)
  // fit a limit that all of them together would not.
  auto repository = ModelRepository::Create(repo.root(), {.max_model_bytes = 4352});
  ASSERT_THAT(repository, IsOk());
  EXPECT_THAT((*repository)->LoadFolder("short"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "layer 2 of 3 (model 'short.2', prefix 'h.2.attn.'): "
                       "short/model.safetensors: no tensor named 'h.2.attn.c_attn.weight'"));
  EXPECT_THAT((*repository)->LoadFolder("typo"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "typo/config.json: layers.prefix: 'h.attn.' does not hold {layer}"));
  absl::StatusOr<FolderModels> fitting = (*repository)->LoadFolder(fits);
  ASSERT_THAT(fitting, IsOk());
  EXPECT_EQ(fitting->models[1]->name.size(), 128u);
  EXPECT_THAT((*repository)->LoadFolder(over),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "/config.json: layers: layer 0's model name"));
  EXPECT_THAT((*repository)->LoadFolder(over),
              StatusIs(absl::StatusCode::kFailedPrecondition, "longer than 128 bytes"));
  auto tight = ModelRepository::Create(repo.root(), {.max_model_bytes = 4351});
  ASSERT_THAT(tight, IsOk());
  EXPECT_THAT((*tight)->LoadFolder(fits),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("layer 0 of 2 (model '", fits, ".0', prefix 'h.0.attn.'): ")));
  EXPECT_THAT((*tight)->LoadFolder(fits),
              StatusIs(absl::StatusCode::kFailedPrecondition, "over --max_model_bytes (4351 bytes"));
}

TEST(ModelRepository, ARepositoryThatIsNotADirectoryIsRefusedNamingTheFlag) {
  EXPECT_THAT(ModelRepository::Create("/nonexistent/attnserve"),
              StatusIs(absl::StatusCode::kInvalidArgument, "--model_repository"));
}

}  // namespace
}  // namespace attnserve::server
