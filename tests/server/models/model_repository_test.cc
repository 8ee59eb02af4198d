// The model repository: names and symlinks that would leave it are refused
// before anything outside is opened; each defect in a model folder fails that
// model with its reason.
#include "server/models/model_repository.h"

#include <fcntl.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/safetensors_writer.h"
#include "tests/core/status_matchers.h"
#include "tests/server/models/model_test_repository.h"

namespace attnserve::server {
namespace {

using ::attnserve::testing::IsOk;
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
    EXPECT_THAT((*repository)->LoadModel(name), StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  }
  EXPECT_THAT((*repository)->LoadModel("absent"),
              StatusIs(absl::StatusCode::kNotFound, "no folder 'absent'"));
  absl::StatusOr<std::shared_ptr<const Model>> good = (*repository)->LoadModel("good");
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
    EXPECT_THAT((*repository)->LoadModel(name),
                StatusIs(absl::StatusCode::kFailedPrecondition, "resolves outside the model repository"));
  }
  EXPECT_EQ(watch.Events(), 0) << "a file outside the repository was opened";
  EXPECT_THAT((*repository)->LoadModel("alias"), IsOk());

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
    EXPECT_THAT((*repository)->LoadModel(c.name),
                StatusIs(absl::StatusCode::kFailedPrecondition, c.reason));
    // The reason names the file.
    EXPECT_THAT((*repository)->LoadModel(c.name),
                StatusIs(absl::StatusCode::kFailedPrecondition, c.name + "/"));
  }
  EXPECT_THAT((*repository)->LoadModel("good"), IsOk());
}

TEST(ModelRepository, ARepositoryThatIsNotADirectoryIsRefusedNamingTheFlag) {
  EXPECT_THAT(ModelRepository::Create("/nonexistent/attnserve"),
              StatusIs(absl::StatusCode::kInvalidArgument, "--model_repository"));
}

}  // namespace
}  // namespace attnserve::server
