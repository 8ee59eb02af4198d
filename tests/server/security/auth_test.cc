// Bearer-token authentication: the token file's parsing, and the real server
// on an ephemeral port called with and without tokens.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/credentials.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "gtest/gtest.h"
#include "server/api/open_inference_service.h"
#include "server/attn_server.h"
#include "server/security/auth.h"
#include "tests/temp_path.h"

namespace attnserve::server {
namespace {

constexpr char kUserToken[] = "user-token-6f1c2a9e";
constexpr char kAdminToken[] = "admin-token-93b7d0c4";

TEST(TokenSet, ParsesTokensAdminLinesAndSkipsCommentsAndBlankLines) {
  absl::StatusOr<TokenSet> tokens = TokenSet::Parse(absl::StrCat(
      "# attnserve tokens\n\n  ", kUserToken, "  \n", "admin:", kAdminToken, "\r\n   # x\n"));
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->size(), 2);
  absl::StatusOr<Principal> user = tokens->Authenticate(absl::StrCat("Bearer ", kUserToken));
  ASSERT_TRUE(user.ok()) << user.status();
  EXPECT_FALSE(user->is_admin);
  absl::StatusOr<Principal> admin = tokens->Authenticate(absl::StrCat("bearer ", kAdminToken));
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(admin->is_admin);
  // "admin:" marks the token; it is not part of it.
  EXPECT_EQ(tokens->Authenticate(absl::StrCat("Bearer admin:", kAdminToken)).status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(TokenSet, RejectsMissingMalformedAndUnknownTokensWithoutNamingThem) {
  absl::StatusOr<TokenSet> tokens = TokenSet::Parse(kUserToken);
  ASSERT_TRUE(tokens.ok());
  for (const std::string& value :
       {std::string(kUserToken), absl::StrCat("Basic ", kUserToken), std::string("Bearer "),
        std::string("Bearer wrong-token"), absl::StrCat("Bearer ", kUserToken, "x")}) {
    absl::StatusOr<Principal> principal = tokens->Authenticate(value);
    EXPECT_EQ(principal.status().code(), absl::StatusCode::kUnauthenticated) << value;
    EXPECT_FALSE(absl::StrContains(principal.status().message(), "token-")) << value;
  }
  EXPECT_EQ(tokens->Authenticate(std::nullopt).status().code(),
            absl::StatusCode::kUnauthenticated);
}

// The metadata processor guards whole services by prefix, the server's own
// lists: a method of inference.GRPCInferenceService that no list names (one
// added later) needs a token; ServerLive and ServerReady do not (exactly:
// a longer name under them does); other services pass.
TEST(TokenAuthProcessor, GuardsTheOpenInferenceServiceByPrefixButItsProbes) {
  absl::StatusOr<TokenSet> tokens = TokenSet::Parse(kUserToken);
  ASSERT_TRUE(tokens.ok());
  std::shared_ptr<grpc::AuthMetadataProcessor> processor = MakeTokenAuthProcessor(
      *tokens, {"/attnserve.v1.AttentionService/", OpenInferenceService::GuardedPathPrefix()},
      OpenInferenceService::OpenMethodPaths());
  const std::string bearer = absl::StrCat("Bearer ", kUserToken);
  // The code of a call to `path`, with the user's token or none.
  auto code = [&](const std::string& path, bool with_token) {
    grpc::AuthMetadataProcessor::InputMetadata metadata;
    metadata.emplace(":path", path);
    if (with_token) metadata.emplace("authorization", bearer);
    grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
    return processor->Process(metadata, nullptr, &consumed, &response).error_code();
  };
  for (const char* method : {"ModelInfer", "ModelReady", "ModelMetadata", "ServerMetadata",
                             "ModelStreamInfer", "RepositoryIndex", "AMethodAddedLater",
                             "ServerLiveness", "ServerReadyz"}) {
    const std::string path = absl::StrCat("/inference.GRPCInferenceService/", method);
    EXPECT_EQ(code(path, false), grpc::StatusCode::UNAUTHENTICATED) << path;
    EXPECT_EQ(code(path, true), grpc::StatusCode::OK) << path;
  }
  for (const char* path :
       {"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady",
        "/grpc.health.v1.Health/Check", "/inference.GRPCInferenceServiceX/ModelInfer"}) {
    EXPECT_EQ(code(path, false), grpc::StatusCode::OK) << path;
  }
  EXPECT_EQ(code("/attnserve.v1.AttentionService/Attend", false),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST(TokenSet, AFileWithoutTokensOrWithABadLineIsRefused) {
  for (const std::string& contents :
       {std::string(""), std::string("\n# only comments\n\n"), std::string("admin:\n"),
        std::string("two words\n")}) {
    absl::StatusOr<TokenSet> tokens = TokenSet::Parse(contents);
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument) << contents;
    EXPECT_TRUE(absl::StartsWith(tokens.status().message(), "--auth_tokens_file:"));
  }
  EXPECT_EQ(TokenSet::Load("/nonexistent/tokens").status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::string WriteFile(const std::string& name, const std::string& contents) {
  const std::string path = testing::TempPath(name);
  std::ofstream(path) << contents;
  return path;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.lame_duck_seconds = 0;
    options.drain_timeout_seconds = 5;
    options.access_log = true;
    options.auth_tokens_file = WriteFile(
        "attnserve_auth_test_tokens",
        absl::StrCat("# test tokens\n", kUserToken, "\nadmin:", kAdminToken, "\n"));
    auto server = AttnServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->LoadModelsAndServe().ok());
  }

  std::unique_ptr<client::AttentionClient> Client(const std::string& token) {
    client::ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", server_->port());
    options.retry.max_attempts = 1;
    options.bearer_token = token;
    auto client = client::AttentionClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  static absl::StatusCode AttendCode(const client::AttentionClient& client) {
    const std::vector<float> hidden(2 * 768, 0.5f);
    return client.Attend(client::MakeAttendRequest("default", hidden, 1, 2, 768)).status().code();
  }

  std::unique_ptr<AttnServer> server_;
};

TEST_F(AuthTest, EveryAttentionServiceCallNeedsAValidBearerToken) {
  auto anonymous = Client("");
  EXPECT_EQ(AttendCode(*anonymous), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous->ListModels().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous->GetModel("default").status().code(), absl::StatusCode::kUnauthenticated);

  auto wrong = Client("not-a-valid-token");
  EXPECT_EQ(AttendCode(*wrong), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong->ListModels().status().code(), absl::StatusCode::kUnauthenticated);

  EXPECT_EQ(AttendCode(*Client(kUserToken)), absl::StatusCode::kOk);
  EXPECT_TRUE(Client(kUserToken)->GetModel("default").ok());
  EXPECT_EQ(AttendCode(*Client(kAdminToken)), absl::StatusCode::kOk);
}

TEST_F(AuthTest, AMalformedRequestWithoutATokenIsUnauthenticatedBeforeItIsParsed) {
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  v1::AttendRequest empty;  // would be INVALID_ARGUMENT once authenticated
  v1::AttendResponse response;
  EXPECT_EQ(stub->Attend(&context, empty, &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(AuthTest, HealthNeedsNoToken) {
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health =
      Client("")->CheckHealth("");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(AuthTest, TokensNeverAppearInTheAccessLogOrOnStderr) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(AttendCode(*Client(kUserToken)), absl::StatusCode::kOk);
  EXPECT_EQ(AttendCode(*Client(kAdminToken)), absl::StatusCode::kOk);
  EXPECT_EQ(AttendCode(*Client("wrong-secret-token")), absl::StatusCode::kUnauthenticated);
  server_->Shutdown();  // every access-log line is written
  const std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(absl::StrContains(logged, "UNAUTHENTICATED")) << logged;
  EXPECT_FALSE(absl::StrContains(logged, kUserToken)) << logged;
  EXPECT_FALSE(absl::StrContains(logged, kAdminToken)) << logged;
  EXPECT_FALSE(absl::StrContains(logged, "wrong-secret-token")) << logged;
  EXPECT_FALSE(absl::StrContains(logged, "Bearer")) << logged;
}

}  // namespace
}  // namespace attnserve::server
