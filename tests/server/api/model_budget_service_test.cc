// Checkpoints cannot crash the server, through the real server on an
// ephemeral port: a repository holding a good model and one whose
// checkpoint's header declares a 96 GiB tensor (a sparse file) starts and
// serves; the big model is FAILED with a reason naming --max_model_bytes, the
// bytes it needs and the limit; LoadModel of it (at start-up and for a folder
// added at run time) answers FAILED_PRECONDITION while the good model keeps
// answering Attend, checked against the double-precision reference.
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "core/attention_weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/reference_attention.h"
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
using grpc::health::v1::HealthCheckResponse;

// The budget the server runs with (--max_model_bytes; not its default, so
// the messages show it is the one configured).
constexpr int64_t kMaxModelBytes = int64_t{3} << 30;

void AddHugeModel(const TestRepository& repo, const std::string& name) {
  const std::string folder = repo.root() + "/" + name;
  std::filesystem::create_directories(folder);
  TestRepository::WriteText(folder + "/config.json", HugeLlamaConfigJson());
  WriteSparseCheckpoint(folder + "/model.safetensors", HugeLlamaTensors("F32"));
}

std::unique_ptr<client::AttentionClient> Client(const AttnServer& server) {
  client::ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server.port());
  options.retry.max_attempts = 1;
  options.timeout_seconds = 60;
  auto client = client::AttentionClient::Create(options);
  EXPECT_THAT(client, IsOk());
  return *std::move(client);
}

// The failure reason of a model over the budget names the flag, what the
// model needs and the limit.
void ExpectOverBudgetReason(absl::string_view reason, absl::string_view name) {
  EXPECT_THAT(reason, HasSubstr(absl::StrCat(name, "/model.safetensors")));
  EXPECT_THAT(reason, HasSubstr(absl::StrCat("take ", kHugeLlamaWeightBytes, " bytes as FP32")));
  EXPECT_THAT(reason,
              HasSubstr(absl::StrCat("over --max_model_bytes (", kMaxModelBytes, " bytes")));
}

TEST(ModelBudgetService, ACheckpointDeclaring96GiBFailsItsModelWhileTheOthersServe) {
  TestRepository repo;
  const core::AttentionWeights good_weights = repo.AddSmallModel("good", testing::FreshSeed());
  AddHugeModel(repo, "huge");

  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.lame_duck_seconds = 0;
  options.drain_timeout_seconds = 5;
  options.model_repository = repo.root();
  ASSERT_NE(options.max_model_bytes, kMaxModelBytes);
  options.max_model_bytes = kMaxModelBytes;
  auto server = AttnServer::Create(options);
  ASSERT_THAT(server, IsOk());
  ASSERT_THAT((*server)->LoadModelsAndServe(), IsOk());
  auto client = Client(**server);
  EXPECT_EQ(*client->CheckHealth("attnserve.v1.AttentionService"), HealthCheckResponse::SERVING);

  absl::StatusOr<v1::ListModelsResponse> list = client->ListModels();
  ASSERT_THAT(list, IsOk());
  ASSERT_EQ(list->models_size(), 2);
  EXPECT_EQ(list->models(0).name(), "good");
  EXPECT_EQ(list->models(0).state(), v1::MODEL_STATE_READY);
  EXPECT_EQ(list->models(1).name(), "huge");
  EXPECT_EQ(list->models(1).state(), v1::MODEL_STATE_FAILED);
  ExpectOverBudgetReason(list->models(1).failure_reason(), "huge");

  // The good model answers, and answers right.
  std::mt19937_64 rng(testing::FreshSeed());
  const int64_t seq = 4, d = 16;
  const std::vector<float> x = testing::RandomNormal(seq * d, rng);
  core::HeadConfig h;
  h.d_model = d;
  h.num_heads = 2;
  core::LayerInputs inputs;
  inputs.hidden_states = x;
  inputs.layout = *core::SequenceLayout::Padded(1, seq);
  const std::vector<double> expected =
      testing::ReferenceLayer(*core::ResolveHeadConfig(h), good_weights, inputs).output;
  auto expect_good_answers = [&] {
    absl::StatusOr<v1::AttendResponse> response =
        client->Attend(client::MakeAttendRequest("good", x, 1, seq, d));
    ASSERT_THAT(response, IsOk());
    absl::StatusOr<std::vector<float>> got = client::TensorValues(response->output());
    ASSERT_THAT(got, IsOk());
    EXPECT_LE(testing::RelativeFrobeniusError(*got, expected), testing::kFp32Tolerance);
  };
  expect_good_answers();
  EXPECT_THAT(client->Attend(client::MakeAttendRequest("huge", x, 1, seq, d)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "'huge' is FAILED"));

  // LoadModel of it again: the same reason, FAILED_PRECONDITION as every
  // checkpoint that cannot load (raising the flag, not retrying, fixes it).
  absl::StatusOr<v1::LoadModelResponse> retried = client->LoadModel("huge");
  EXPECT_THAT(retried, StatusIs(absl::StatusCode::kFailedPrecondition, "--max_model_bytes"));
  ExpectOverBudgetReason(retried.status().message(), "huge");
  expect_good_answers();

  // A folder added at run time: the same, and the server serves on.
  AddHugeModel(repo, "huge_late");
  absl::StatusOr<v1::LoadModelResponse> late = client->LoadModel("huge_late");
  EXPECT_THAT(late, StatusIs(absl::StatusCode::kFailedPrecondition, "--max_model_bytes"));
  ExpectOverBudgetReason(late.status().message(), "huge_late");
  absl::StatusOr<v1::ModelInfo> info = client->GetModel("huge_late");
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->state(), v1::MODEL_STATE_FAILED);
  ExpectOverBudgetReason(info->failure_reason(), "huge_late");
  expect_good_answers();
  EXPECT_EQ(*client->CheckHealth("attnserve.v1.AttentionService"), HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace attnserve::server
