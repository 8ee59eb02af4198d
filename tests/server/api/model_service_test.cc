// Models managed at run time through the real server on an ephemeral port:
// admin authorization, start-up with a repository (health, failed models and
// their reasons), LoadModel/UnloadModel, the model's outputs against the
// double-precision reference, and eight threads loading and unloading while a
// stable model keeps answering.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "client/request_builder.h"
#include "core/attention_weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"
#include "tests/server/models/model_test_repository.h"

namespace attnserve::server {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::LayoutCase;
using ::attnserve::testing::StatusIs;
using ::attnserve::testing::TestRepository;
using grpc::health::v1::HealthCheckResponse;

constexpr char kUserToken[] = "user-token-5d2e8a71";
constexpr char kAdminToken[] = "admin-token-c04f9b36";

class ModelServiceTest : public ::testing::Test {
 protected:
  void StartServer(bool with_tokens) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.lame_duck_seconds = 0;
    options.drain_timeout_seconds = 5;
    options.model_repository = repo_.root();
    if (with_tokens) {
      options.auth_tokens_file = repo_.base() + "/tokens";
      TestRepository::WriteText(options.auth_tokens_file,
                                absl::StrCat(kUserToken, "\nadmin:", kAdminToken, "\n"));
    }
    auto server = AttnServer::Create(options);
    ASSERT_THAT(server, IsOk());
    server_ = *std::move(server);
    // Not ready before the configured models have loaded.
    EXPECT_EQ(*Client("")->CheckHealth("attnserve.v1.AttentionService"),
              HealthCheckResponse::NOT_SERVING);
    ASSERT_THAT(server_->LoadModelsAndServe(), IsOk());
    EXPECT_EQ(*Client("")->CheckHealth("attnserve.v1.AttentionService"),
              HealthCheckResponse::SERVING);
  }

  std::unique_ptr<client::AttentionClient> Client(const std::string& token) {
    client::ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", server_->port());
    options.retry.max_attempts = 1;
    options.bearer_token = token;
    options.timeout_seconds = 60;
    auto client = client::AttentionClient::Create(options);
    EXPECT_THAT(client, IsOk());
    return *std::move(client);
  }

  static std::vector<float> Hidden(int64_t n, uint64_t seed) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(core::SeededUniform(seed, 0, i) - 0.5);
    return v;
  }

  static absl::StatusCode AttendCode(const client::AttentionClient& client, const std::string& model,
                                     int64_t d_model) {
    return client.Attend(client::MakeAttendRequest(model, Hidden(3 * d_model, 1), 1, 3, d_model))
        .status()
        .code();
  }

  TestRepository repo_;
  std::unique_ptr<AttnServer> server_;
};

TEST_F(ModelServiceTest, AdminRpcsNeedAnAdminToken) {
  repo_.AddSmallModel("small", 1);
  StartServer(/*with_tokens=*/true);
  EXPECT_THAT(Client("")->LoadModel("small"), StatusIs(absl::StatusCode::kUnauthenticated, ""));
  EXPECT_THAT(Client("wrong-token")->LoadModel("small"),
              StatusIs(absl::StatusCode::kUnauthenticated, ""));
  EXPECT_THAT(Client(kUserToken)->LoadModel("small"),
              StatusIs(absl::StatusCode::kPermissionDenied, "admin token"));
  EXPECT_THAT(Client("")->UnloadModel("small"), StatusIs(absl::StatusCode::kUnauthenticated, ""));
  EXPECT_THAT(Client("wrong-token")->UnloadModel("small"),
              StatusIs(absl::StatusCode::kUnauthenticated, ""));
  EXPECT_THAT(Client(kUserToken)->UnloadModel("small"),
              StatusIs(absl::StatusCode::kPermissionDenied, "admin token"));
  // Nothing changed; a plain token still serves.
  EXPECT_EQ(AttendCode(*Client(kUserToken), "small", 16), absl::StatusCode::kOk);
  auto admin = Client(kAdminToken);
  EXPECT_THAT(admin->UnloadModel("small"), IsOk());
  EXPECT_EQ(AttendCode(*Client(kUserToken), "small", 16), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::LoadModelResponse> loaded = admin->LoadModel("small");
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(loaded->model().state(), v1::MODEL_STATE_READY);
  EXPECT_EQ(loaded->model().head_config().d_model(), 16);
  EXPECT_EQ(AttendCode(*Client(kUserToken), "small", 16), absl::StatusCode::kOk);
  // Health stays open.
  EXPECT_EQ(*Client("")->CheckHealth(""), HealthCheckResponse::SERVING);
}

// A folder whose config.json has "layers": one model per layer (<folder>.<i>)
// in ListModels; OpenSession over the folder's name opens a session over its
// layers in order, and each layer's Extend output is its own weights' causal
// layer (the double reference, FP32 KV within 1e-5, relative Frobenius),
// layer i's input being layer i-1's output; the folder unloads and loads as
// one, a layer alone does not.
TEST_F(ModelServiceTest, ASessionOverAFolderOfLayersRunsEachLayersOwnWeights) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  LayoutCase c{"gpt2", {}, "unused.", "F32"};
  c.head.d_model = 32;
  c.head.num_heads = 4;
  const core::HeadConfig h = *core::ResolveHeadConfig(c.head);
  std::vector<core::AttentionWeights> weights;
  for (uint64_t i = 0; i < 3; ++i) weights.push_back(core::SeededWeights(h, seed + i));
  repo_.AddLayers("net", c, weights, R"({"count": 3, "prefix": "h.{layer}.attn."})");
  StartServer(false);
  auto client = Client("");
  absl::StatusOr<v1::ListModelsResponse> models = client->ListModels();
  ASSERT_THAT(models, IsOk());
  std::vector<std::string> names;
  for (const v1::ModelInfo& m : models->models()) {
    names.push_back(m.name());
    EXPECT_EQ(m.state(), v1::MODEL_STATE_READY) << m.name();
    EXPECT_TRUE(m.causal()) << m.name();
  }
  EXPECT_EQ(names, (std::vector<std::string>{"net.0", "net.1", "net.2"}));
  EXPECT_THAT(client->GetModel("net"), StatusIs(absl::StatusCode::kNotFound, "net.0, net.1, net.2"));

  v1::OpenSessionRequest open;
  open.add_models("net");
  absl::StatusOr<v1::Session> session = client->OpenSession(open);
  ASSERT_THAT(session, IsOk());
  EXPECT_THAT(session->models(), ::testing::ElementsAre("net.0", "net.1", "net.2"));
  // A folder counts each of its layers against a session's 1024.
  v1::OpenSessionRequest too_many;
  for (int i = 0; i < 342; ++i) too_many.add_models("net");  // 1026 layers
  EXPECT_THAT(client->OpenSession(too_many),
              StatusIs(absl::StatusCode::kInvalidArgument, "models: more than 1024 layers"));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> inputs(3);  // each layer's tokens so far
  for (int64_t n : {5, 1, 2}) {
    std::vector<float> x(static_cast<size_t>(n * 32));
    for (float& v : x) v = normal(rng);
    for (int layer = 0; layer < 3; ++layer) {
      SCOPED_TRACE(absl::StrCat("layer ", layer, ", ", n, " new tokens"));
      const int64_t before = static_cast<int64_t>(inputs[layer].size()) / 32;
      v1::ExtendRequest request;
      v1::ExtendStep* step = request.add_steps();
      step->set_session_id(session->session_id());
      step->set_layer(layer);
      step->set_expected_length(before);
      v1::Tensor* states = step->mutable_hidden_states();
      states->set_dtype(v1::DATA_TYPE_FP32);
      states->add_shape(n);
      states->add_shape(32);
      states->set_raw_data(x.data(), x.size() * sizeof(float));
      absl::StatusOr<v1::ExtendResponse> response = client->Extend(request);
      ASSERT_THAT(response, IsOk());
      const v1::ExtendResult& result = response->results(0);
      ASSERT_EQ(result.code(), 0) << result.message();
      inputs[layer].insert(inputs[layer].end(), x.begin(), x.end());
      core::LayerInputs reference_inputs;
      reference_inputs.hidden_states = inputs[layer];
      reference_inputs.layout = *core::SequenceLayout::Padded(1, before + n);
      reference_inputs.causal = true;
      const testing::ReferenceResult reference =
          testing::ReferenceLayer(h, weights[layer], reference_inputs);
      const std::vector<float> output = *client::TensorValues(result.output());
      EXPECT_LE(testing::RelativeFrobeniusError(
                    output, std::vector<double>(reference.output.begin() + before * 32,
                                                reference.output.end())),
                1e-5);
      x = output;  // the next layer's input
    }
  }

  // The layers' metrics are the folder's: one set of series labelled "net",
  // where the steps of every layer were counted; none labelled by a layer.
  const std::string metrics = server_->MetricsText();
  EXPECT_FALSE(absl::StrContains(metrics, "model=\"net.")) << metrics;
  int info_series = 0;
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    if (absl::StartsWith(line, "attnserve_model_info{")) {
      EXPECT_TRUE(absl::StrContains(line, "model=\"net\"")) << line;
      ++info_series;
    }
    if (absl::StartsWith(line, "attnserve_decode_batch_tokens_count{")) {
      ASSERT_TRUE(absl::StrContains(line, "model=\"net\"") ||
                  absl::StrContains(line, "model=\"\"")) << line;
      if (absl::StrContains(line, "model=\"net\"")) {
        EXPECT_NE(line.substr(line.rfind(' ') + 1), "0") << line;  // every layer's steps
      }
    }
  }
  EXPECT_EQ(info_series, 1);

  auto admin = Client("");
  EXPECT_THAT(admin->UnloadModel("net.1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "unload 'net'"));
  EXPECT_THAT(admin->LoadModel("net"),
              StatusIs(absl::StatusCode::kAlreadyExists, "already loaded as its 3 layers"));
  ASSERT_THAT(admin->UnloadModel("net"), IsOk());
  EXPECT_EQ(client->ListModels()->models_size(), 0);
  EXPECT_THAT(admin->LoadModel("net.1"), StatusIs(absl::StatusCode::kNotFound, "load 'net'"));
  absl::StatusOr<v1::LoadModelResponse> loaded = admin->LoadModel("net");
  ASSERT_THAT(loaded, IsOk());
  EXPECT_FALSE(loaded->has_model());
  ASSERT_EQ(loaded->layers_size(), 3);
  EXPECT_EQ(loaded->layers(2).name(), "net.2");
  EXPECT_EQ(loaded->layers(2).head_config().d_model(), 32);
  EXPECT_EQ(client->ListModels()->models_size(), 3);
}

TEST_F(ModelServiceTest, LoadedModelsMatchTheReferenceAndCausalModelsAreCausal) {
  LayoutCase llama{"llama", {}, "model.layers.2.self_attn.", "F32"};
  llama.head.d_model = 32;
  llama.head.num_heads = 4;
  llama.head.num_kv_heads = 2;
  llama.head.rotary.rotary_dim = 8;
  core::AttentionWeights w = repo_.AddModel("llama", llama, 5);
  for (auto* b : {&w.b_q, &w.b_k, &w.b_v, &w.b_o}) std::fill(b->begin(), b->end(), 0.0f);
  StartServer(false);
  absl::StatusOr<v1::ModelInfo> info = Client("")->GetModel("llama");
  ASSERT_THAT(info, IsOk());
  EXPECT_TRUE(info->causal());
  EXPECT_EQ(info->head_config().num_kv_heads(), 2);
  EXPECT_EQ(info->head_config().rotary().rotary_dim(), 8);

  const int64_t seq = 5, d = 32;
  const std::vector<float> x = Hidden(seq * d, 9);
  absl::StatusOr<v1::AttendResponse> response =
      Client("")->Attend(client::MakeAttendRequest("llama", x, 1, seq, d));
  ASSERT_THAT(response, IsOk());
  absl::StatusOr<std::vector<float>> got = client::TensorValues(response->output());
  ASSERT_THAT(got, IsOk());

  core::HeadConfig h = *core::ResolveHeadConfig(llama.head);
  h.rotary.theta = 500000.0f;  // as ConfigJson writes it
  core::LayerInputs inputs;
  inputs.hidden_states = x;
  inputs.layout = *core::SequenceLayout::Padded(1, seq);
  inputs.causal = true;  // the model is causal although the request did not ask
  const testing::ReferenceResult expected = testing::ReferenceLayer(h, w, inputs);
  // FP32 compute against the double-precision reference.
  EXPECT_LT(testing::RelativeFrobeniusError(*got, expected.output), 1e-5);
  // And it is not the bidirectional result (the check can fail).
  inputs.causal = false;
  EXPECT_GT(testing::RelativeFrobeniusError(*got, testing::ReferenceLayer(h, w, inputs).output), 1e-3);
}

TEST_F(ModelServiceTest, AFailedModelShowsItsReasonWhileTheOthersServe) {
  repo_.AddSmallModel("good", 1);
  repo_.AddSmallModel("truncated", 2);
  std::filesystem::resize_file(repo_.root() + "/truncated/model.safetensors",
                               std::filesystem::file_size(repo_.root() + "/truncated/model.safetensors") - 64);
  StartServer(false);
  auto client = Client("");
  absl::StatusOr<v1::ListModelsResponse> list = client->ListModels();
  ASSERT_THAT(list, IsOk());
  ASSERT_EQ(list->models_size(), 2);
  EXPECT_EQ(list->models(0).name(), "good");
  EXPECT_EQ(list->models(0).state(), v1::MODEL_STATE_READY);
  EXPECT_EQ(list->models(1).name(), "truncated");
  EXPECT_EQ(list->models(1).state(), v1::MODEL_STATE_FAILED);
  EXPECT_THAT(list->models(1).failure_reason(), ::testing::HasSubstr("truncated/model.safetensors"));
  EXPECT_THAT(list->models(1).failure_reason(), ::testing::HasSubstr("the file is truncated"));
  EXPECT_EQ(client->GetModel("truncated")->failure_reason(), list->models(1).failure_reason());
  EXPECT_THAT(client->Attend(client::MakeAttendRequest("truncated", Hidden(16, 1), 1, 1, 16)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "'truncated' is FAILED"));
  EXPECT_EQ(AttendCode(*client, "good", 16), absl::StatusCode::kOk);
  // A retry fails again with the reason; a fixed file loads.
  EXPECT_THAT(client->LoadModel("truncated"),
              StatusIs(absl::StatusCode::kFailedPrecondition, "the file is truncated"));
  repo_.AddSmallModel("truncated", 2);
  EXPECT_THAT(client->LoadModel("truncated"), IsOk());
  EXPECT_EQ(AttendCode(*client, "truncated", 16), absl::StatusCode::kOk);
  // Path tricks are refused by name; an absent folder is NOT_FOUND.
  EXPECT_THAT(client->LoadModel("../repo/good"), StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  EXPECT_THAT(client->LoadModel("/etc"), StatusIs(absl::StatusCode::kInvalidArgument, "name"));
  EXPECT_THAT(client->LoadModel("absent"), StatusIs(absl::StatusCode::kNotFound, "absent"));
  EXPECT_THAT(client->LoadModel("good"), StatusIs(absl::StatusCode::kAlreadyExists, "already loaded"));
  EXPECT_EQ(client->ListModels()->models_size(), 2);
}

TEST_F(ModelServiceTest, EightThreadsLoadAndUnloadWhileTheStableModelNeverFails) {
  // Every answer is checked against the reference of the named model's own
  // weights: a registry that served another model's weights under a name
  // would fail.
  const int64_t seq = 3, d = 16;
  const std::vector<float> x = Hidden(seq * d, testing::FreshSeed());
  auto reference = [&](const core::AttentionWeights& w) {
    core::HeadConfig h;
    h.d_model = d;
    h.num_heads = 2;
    core::LayerInputs inputs;
    inputs.hidden_states = x;
    inputs.layout = *core::SequenceLayout::Padded(1, seq);
    return testing::ReferenceLayer(*core::ResolveHeadConfig(h), w, inputs).output;
  };
  const std::vector<double> stable_reference = reference(repo_.AddSmallModel("stable", 1));
  constexpr int kChurnModels = 4;
  std::vector<std::vector<double>> churn_references;
  for (int i = 0; i < kChurnModels; ++i) {
    churn_references.push_back(reference(repo_.AddSmallModel(absl::StrCat("m", i), 10 + i)));
    // The models differ enough for the check to tell them apart.
    ASSERT_GT(testing::RelativeFrobeniusError(
                  std::vector<float>(churn_references[i].begin(), churn_references[i].end()),
                  stable_reference),
              1e-2);
  }
  // The error of `model`'s answer to x against `expected`; infinity when the
  // call failed (its status in `status`).
  auto answer_error = [&](const client::AttentionClient& client, const std::string& model,
                          const std::vector<double>& expected, absl::Status* status) {
    absl::StatusOr<v1::AttendResponse> response =
        client.Attend(client::MakeAttendRequest(model, x, 1, seq, d));
    *status = response.status();
    if (!response.ok()) return std::numeric_limits<double>::infinity();
    absl::StatusOr<std::vector<float>> got = client::TensorValues(response->output());
    *status = got.status();
    return got.ok() ? testing::RelativeFrobeniusError(*got, expected)
                    : std::numeric_limits<double>::infinity();
  };
  StartServer(false);
  for (int i = 0; i < kChurnModels; ++i) {
    ASSERT_THAT(Client("")->UnloadModel(absl::StrCat("m", i)), IsOk());
  }
  auto client = Client("");
  std::atomic<bool> stop{false};
  // Loads that ended READY, and loads another thread's unload of the same
  // name cut short (ABORTED): under a busy machine's slow loads every load
  // may be cut short, so the churn counts both.
  std::atomic<int> stable_calls{0}, loads{0}, aborted_loads{0}, unloads{0};
  std::thread requests([&] {
    while (!stop.load()) {
      absl::Status status;
      EXPECT_LE(answer_error(*client, "stable", stable_reference, &status), testing::kFp32Tolerance)
          << status;
      ++stable_calls;
    }
  });
  std::vector<std::thread> churn;
  for (int t = 0; t < 8; ++t) {
    churn.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const std::string name = absl::StrCat("m", (t + i) % kChurnModels);
        absl::Status loaded = client->LoadModel(name).status();
        if (loaded.ok()) {
          ++loads;
        } else if (absl::IsAborted(loaded)) {
          ++aborted_loads;
        } else {
          EXPECT_TRUE(absl::IsAlreadyExists(loaded)) << loaded;
        }
        // Calls on a model being unloaded: its own answer, or a clean
        // NOT_FOUND/UNAVAILABLE.
        absl::Status status;
        const double error =
            answer_error(*client, name, churn_references[(t + i) % kChurnModels], &status);
        if (status.ok()) {
          EXPECT_LE(error, testing::kFp32Tolerance) << name;
        } else {
          EXPECT_TRUE(absl::IsNotFound(status) || absl::IsUnavailable(status)) << status;
        }
        absl::Status unloaded = client->UnloadModel(name);
        if (unloaded.ok()) {
          ++unloads;
        } else {
          EXPECT_TRUE(absl::IsNotFound(unloaded)) << unloaded;
        }
      }
    });
  }
  for (auto& t : churn) t.join();
  stop = true;
  requests.join();
  EXPECT_GT(stable_calls.load(), 0);
  EXPECT_GT(loads.load() + aborted_loads.load(), 0);
  EXPECT_GT(unloads.load(), 0);
  EXPECT_EQ(client->GetModel("stable")->state(), v1::MODEL_STATE_READY);
  absl::Status status;
  EXPECT_LE(answer_error(*client, "stable", stable_reference, &status), testing::kFp32Tolerance)
      << status;
  // After the churn a load no one cuts short ends READY (or m0 is still
  // loaded from the churn's last load) and answers.
  const absl::Status loaded = client->LoadModel("m0").status();
  ASSERT_TRUE(loaded.ok() || absl::IsAlreadyExists(loaded)) << loaded;
  EXPECT_LE(answer_error(*client, "m0", churn_references[0], &status), testing::kFp32Tolerance)
      << status;
}

}  // namespace
}  // namespace attnserve::server
