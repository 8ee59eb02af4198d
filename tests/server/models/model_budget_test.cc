// Checkpoints cannot crash the server: a model whose header declares more
// weights than --max_model_bytes fails with the bytes it needs and the limit
// while the others load, and memory running out while loading fails that one
// model (RESOURCE_EXHAUSTED), never the process.
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/models/model_loader.h"
#include "server/models/model_registry.h"
#include "server/models/model_repository.h"
#include "tests/core/sparse_checkpoint.h"
#include "tests/core/status_matchers.h"
#include "tests/server/models/model_test_repository.h"

namespace attnserve::server {
namespace {

using ::attnserve::testing::HugeLlamaConfigJson;
using ::attnserve::testing::HugeLlamaTensors;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kHugeLlamaWeightBytes;
using ::attnserve::testing::StatusIs;
using ::attnserve::testing::TestRepository;
using ::attnserve::testing::WriteSparseCheckpoint;
using ::testing::HasSubstr;

// AddSmallModel's weights as FP32: 4 x [16, 16] and 4 x [16].
constexpr int64_t kSmallModelBytes = (4 * 16 * 16 + 4 * 16) * 4;

// Model `name`: a Llama layer of a plausible configuration whose header
// declares 208 GiB of weights (q_proj.weight alone 96 GiB as FP32), in a
// sparse file.
void AddHugeModel(const TestRepository& repo, const std::string& name, const std::string& dtype) {
  const std::string folder = repo.root() + "/" + name;
  std::filesystem::create_directories(folder);
  TestRepository::WriteText(folder + "/config.json", HugeLlamaConfigJson());
  WriteSparseCheckpoint(folder + "/model.safetensors", HugeLlamaTensors(dtype));
}

TEST(ModelBudget, AModelOverMaxModelBytesFailsNamingItWhileTheOthersLoad) {
  TestRepository repo;
  repo.AddSmallModel("good", 1);
  AddHugeModel(repo, "huge", "BF16");
  auto repository = ModelRepository::Create(repo.root());  // --max_model_bytes' default
  ASSERT_THAT(repository, IsOk());
  const int64_t budget = ServerOptions().max_model_bytes;
  EXPECT_EQ((*repository)->options().max_model_bytes, budget);
  ASSERT_LT(budget, kHugeLlamaWeightBytes);
  absl::StatusOr<std::shared_ptr<const Model>> huge = testing::LoadOneModel(**repository, "huge");
  EXPECT_THAT(huge, StatusIs(absl::StatusCode::kFailedPrecondition, "huge/model.safetensors"));
  EXPECT_THAT(huge.status().message(),
              HasSubstr(absl::StrCat("take ", kHugeLlamaWeightBytes, " bytes as FP32")));
  EXPECT_THAT(huge.status().message(),
              HasSubstr(absl::StrCat("over --max_model_bytes (", budget, " bytes")));
  absl::StatusOr<std::shared_ptr<const Model>> good = testing::LoadOneModel(**repository, "good");
  ASSERT_THAT(good, IsOk());
  EXPECT_EQ((*good)->layer->config().d_model, 16);
}

TEST(ModelBudget, TheBudgetIsTheOneConfiguredAndExact) {
  TestRepository repo;
  repo.AddSmallModel("small", 1);
  auto tight = ModelRepository::Create(repo.root(), {.max_model_bytes = kSmallModelBytes - 1});
  ASSERT_THAT(tight, IsOk());
  absl::StatusOr<std::shared_ptr<const Model>> refused = testing::LoadOneModel(**tight, "small");
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition, "--max_model_bytes"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("take ", kSmallModelBytes, " bytes as FP32")));
  EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("(", kSmallModelBytes - 1, " bytes")));
  auto exact = ModelRepository::Create(repo.root(), {.max_model_bytes = kSmallModelBytes});
  ASSERT_THAT(exact, IsOk());
  EXPECT_THAT(testing::LoadOneModel(**exact, "small"), IsOk());

  for (int64_t bad : {int64_t{0}, int64_t{-1}}) {
    EXPECT_THAT(ModelRepository::Create(repo.root(), {.max_model_bytes = bad}),
                StatusIs(absl::StatusCode::kInvalidArgument, "--max_model_bytes: must be positive"));
  }
}

// The process' virtual memory size now (VmSize of /proc/self/status).
int64_t VirtualMemoryBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmSize:") {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// In a child process: loads model "huge" of `root` with no budget, its
// address space limited to 1 GiB more than it uses, prints the status and
// exits 0 when it is RESOURCE_EXHAUSTED (1 otherwise).
[[noreturn]] void LoadHugeModelWithLimitedAddressSpace(const std::string& root) {
  auto repository =
      ModelRepository::Create(root, {.max_model_bytes = std::numeric_limits<int64_t>::max()});
  if (!repository.ok()) std::_Exit(2);
  const int64_t limit = VirtualMemoryBytes() + (int64_t{1} << 30);
  const rlimit address_space{static_cast<rlim_t>(limit), static_cast<rlim_t>(limit)};
  if (setrlimit(RLIMIT_AS, &address_space) != 0) std::_Exit(3);
  absl::StatusOr<std::shared_ptr<const Model>> model = testing::LoadOneModel(**repository, "huge");
  std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
  std::_Exit(absl::IsResourceExhausted(model.status()) ? 0 : 1);
}

TEST(ModelBudgetDeathTest, RunningOutOfMemoryWhileLoadingFailsTheModelNotTheProcess) {
  if (kSanitized) {
    GTEST_SKIP() << "sanitizers reserve terabytes of address space; an address-space limit "
                    "cannot make this allocation fail under them";
  }
  TestRepository repo;
  AddHugeModel(repo, "huge", "F32");
  // With no budget, the only bound left is the machine. In a child process
  // whose address space is limited, reading q_proj.weight (96 GiB) runs out
  // of memory whatever the machine has: the load must fail with
  // RESOURCE_EXHAUSTED and the child live to say so; an uncaught
  // std::bad_alloc would abort it.
  EXPECT_EXIT(LoadHugeModelWithLimitedAddressSpace(repo.root()), ::testing::ExitedWithCode(0),
              "RESOURCE_EXHAUSTED: huge/model.safetensors: out of memory reading tensor "
              "'model.layers.0.self_attn.q_proj.weight' \\(103079215104 bytes as FP32\\)");
}

TEST(ModelBudget, TheLoaderTurnsBadAllocIntoThatModelsFailureAndKeepsLoading) {
  // Whatever of a model's load runs out of memory (here its warm-up), the
  // model fails RESOURCE_EXHAUSTED and the loader thread lives on.
  TestRepository repo;
  repo.AddSmallModel("a", 1);
  repo.AddSmallModel("b", 2);
  AddHugeModel(repo, "huge", "F32");
  auto repository = ModelRepository::Create(repo.root());
  ASSERT_THAT(repository, IsOk());
  ModelRegistry registry;
  ModelLoaderOptions options;
  options.warm_up = [](const Model& model) -> absl::Status {
    if (model.name == "a") throw std::bad_alloc();
    return absl::OkStatus();
  };
  ModelLoader loader(repository->get(), &registry, options);
  auto load = [&](const std::string& name) {
    absl::Notification done;
    absl::Status result;
    absl::Status queued = loader.Load(name, [&](absl::StatusOr<ModelLoader::Loaded> s) {
      result = s.status();
      done.Notify();
    });
    if (!queued.ok()) return queued;
    done.WaitForNotification();
    return result;
  };
  EXPECT_THAT(load("a"), StatusIs(absl::StatusCode::kResourceExhausted,
                                  "model 'a' failed to load: out of memory"));
  EXPECT_THAT(load("huge"), StatusIs(absl::StatusCode::kFailedPrecondition, "--max_model_bytes"));
  EXPECT_THAT(load("b"), IsOk());
  EXPECT_EQ(registry.Get("a")->state, ModelState::kFailed);
  EXPECT_THAT(registry.Get("a")->failure, StatusIs(absl::StatusCode::kResourceExhausted, "std::bad_alloc"));
  EXPECT_EQ(registry.Get("huge")->state, ModelState::kFailed);
  EXPECT_THAT(registry.Get("huge")->failure,
              StatusIs(absl::StatusCode::kFailedPrecondition, "--max_model_bytes"));
  EXPECT_EQ(registry.Get("b")->state, ModelState::kReady);
}

}  // namespace
}  // namespace attnserve::server
