// Decode sessions through the real server on an ephemeral port, called with
// the generated stub: every step's output equals the matching rows of the
// double-precision reference layer run causally over the whole sequence so
// far (FP32 KV within 1e-5, BF16 KV within 2e-2, relative Frobenius); a
// micro-batch answers each step on its own; retries replay; forks diverge;
// truncation rewinds; tokens own their sessions; the metrics show them.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_weights.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "tests/core/reference_attention.h"
#include "tests/server/api/attend_requests.h"
#include "tests/server/api/blockable_server.h"

namespace attnserve::server {
namespace {

constexpr uint64_t kSeed = 5;
constexpr int64_t kDModel = 768;

std::vector<float> RandomRows(int64_t rows, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(rows * kDModel));
  for (float& v : values) v = normal(rng);
  return values;
}

using testing::Floats;

v1::ExtendStep Step(const std::string& id, int64_t expected, const std::vector<float>& rows) {
  v1::ExtendStep step;
  step.set_session_id(id);
  step.set_expected_length(expected);
  v1::Tensor* t = step.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  t->add_shape(static_cast<int64_t>(rows.size()) / kDModel);
  t->add_shape(kDModel);
  t->set_raw_data(rows.data(), rows.size() * sizeof(float));
  return step;
}

class SessionServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(""); }

  void Start(const std::string& tokens_file) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.builtin_model_seed = kSeed;
    options.lame_duck_seconds = 0;
    options.drain_timeout_seconds = 5;
    options.auth_tokens_file = tokens_file;
    server_.reset();
    server_ = *AttnServer::Create(options);
    ASSERT_TRUE(server_->LoadModelsAndServe().ok());
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
    core::HeadConfig requested;
    requested.d_model = kDModel;
    requested.num_heads = 12;
    config_ = *core::ResolveHeadConfig(requested);
    weights_ = core::SeededWeights(config_, kSeed);
  }

  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (v1::AttentionService::Stub::*method)(grpc::ClientContext*,
                                                                      const Request&, Response*),
                    const Request& request, Response* response, const std::string& token = "") {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    return ((*stub_).*method)(&context, request, response);
  }

  std::string Open(v1::DataType kv_dtype = v1::DATA_TYPE_FP32, const std::string& token = "") {
    v1::OpenSessionRequest request;
    request.add_models("default");
    request.set_kv_dtype(kv_dtype);
    v1::Session session;
    grpc::Status status = Call(&v1::AttentionService::Stub::OpenSession, request, &session, token);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return session.session_id();
  }

  v1::ExtendResponse Extend(const v1::ExtendRequest& request, const std::string& token = "") {
    v1::ExtendResponse response;
    grpc::Status status = Call(&v1::AttentionService::Stub::Extend, request, &response, token);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // The reference's output rows [from, from + n) of the causal layer over
  // `sequence` (all the tokens so far).
  testing::ReferenceResult Reference(const std::vector<float>& sequence) const {
    core::LayerInputs inputs;
    inputs.hidden_states = sequence;
    inputs.layout = *core::SequenceLayout::Padded(1, static_cast<int64_t>(sequence.size()) / kDModel);
    inputs.causal = true;
    return testing::ReferenceLayer(config_, weights_, inputs);
  }
  static std::vector<double> Rows(const std::vector<double>& all, int64_t from, int64_t n,
                                  int64_t width) {
    return {all.begin() + from * width, all.begin() + (from + n) * width};
  }

  std::unique_ptr<AttnServer> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  core::HeadConfig config_;
  core::AttentionWeights weights_;
};

TEST_F(SessionServiceTest, PrefillAndDecodeStepsMatchTheCausalReferenceOverTheWholeSequence) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  for (v1::DataType kv : {v1::DATA_TYPE_FP32, v1::DATA_TYPE_BF16}) {
    SCOPED_TRACE(v1::DataType_Name(kv));
    const double tolerance = kv == v1::DATA_TYPE_BF16 ? 2e-2 : 1e-5;
    const std::string id = Open(kv);
    std::vector<float> sequence;
    for (int64_t n : {7, 1, 1, 5, 1}) {
      const std::vector<float> rows = RandomRows(n, rng);
      const int64_t before = static_cast<int64_t>(sequence.size()) / kDModel;
      sequence.insert(sequence.end(), rows.begin(), rows.end());
      v1::ExtendRequest request;
      *request.add_steps() = Step(id, before, rows);
      request.mutable_steps(0)->set_attention_maps(true);
      const v1::ExtendResponse response = Extend(request);
      ASSERT_EQ(response.results_size(), 1);
      const v1::ExtendResult& result = response.results(0);
      ASSERT_EQ(result.code(), 0) << result.message();
      EXPECT_EQ(result.length(), before + n);
      EXPECT_FALSE(result.replayed());
      EXPECT_TRUE(absl::EndsWith(response.kernel_path(), "/paged")) << response.kernel_path();
      const testing::ReferenceResult reference = Reference(sequence);
      EXPECT_LT(testing::RelativeFrobeniusError(Floats(result.output()),
                                                Rows(reference.output, before, n, kDModel)),
                tolerance)
          << "step of " << n << " at " << before;
      // The new rows of every head's map: [heads, n, length].
      const int64_t length = before + n;
      std::vector<double> expected_maps;
      for (int64_t h = 0; h < 12; ++h) {
        for (int64_t i = before; i < length; ++i) {
          const auto row = reference.per_head_maps.begin() + (h * length + i) * length;
          expected_maps.insert(expected_maps.end(), row, row + length);
        }
      }
      EXPECT_LT(testing::RelativeFrobeniusError(Floats(result.attention_maps()), expected_maps),
                tolerance);
    }
  }
}

TEST_F(SessionServiceTest, AMicroBatchAnswersEachStepOnItsOwn) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string a = Open(), b = Open();
  const std::vector<float> a_rows = RandomRows(9, rng), b_rows = RandomRows(3, rng);
  v1::ExtendRequest prefill;
  *prefill.add_steps() = Step(a, 0, a_rows);
  *prefill.add_steps() = Step(b, 0, b_rows);
  *prefill.add_steps() = Step(std::string(32, 'f'), 0, b_rows);  // unknown
  *prefill.add_steps() = Step(a, 5, a_rows);                     // wrong length
  const v1::ExtendResponse response = Extend(prefill);
  ASSERT_EQ(response.results_size(), 4);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(1).code(), 0) << response.results(1).message();
  EXPECT_EQ(response.results(2).code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StartsWith(response.results(2).message(), "steps[2]: ")) << response.results(2).message();
  EXPECT_EQ(response.results(3).code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(absl::StrContains(response.results(3).message(), "holds 0 tokens") ||
              absl::StrContains(response.results(3).message(), "in flight"))
      << response.results(3).message();
  EXPECT_LT(testing::RelativeFrobeniusError(Floats(response.results(0).output()),
                                            Reference(a_rows).output),
            1e-5);
  EXPECT_LT(testing::RelativeFrobeniusError(Floats(response.results(1).output()),
                                            Reference(b_rows).output),
            1e-5);
  // A malformed step is refused by its field while its neighbour runs.
  v1::ExtendRequest mixed;
  *mixed.add_steps() = Step(a, 9, RandomRows(1, rng));
  *mixed.add_steps() = Step(b, 3, RandomRows(1, rng));
  mixed.mutable_steps(1)->mutable_hidden_states()->set_shape(1, 767);
  const v1::ExtendResponse answered = Extend(mixed);
  EXPECT_EQ(answered.results(0).code(), 0) << answered.results(0).message();
  EXPECT_EQ(answered.results(1).code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(answered.results(1).message(), "steps[1].hidden_states"))
      << answered.results(1).message();

  // Values a forward would only turn into NaN are refused by position, FP32
  // and BF16 (read as sent), and append nothing: the session goes on at its
  // length.
  v1::ExtendRequest non_finite;
  std::vector<float> with_nan = RandomRows(2, rng);
  with_nan[kDModel + 5] = std::numeric_limits<float>::quiet_NaN();
  *non_finite.add_steps() = Step(b, 3, with_nan);
  v1::ExtendStep bf16 = Step(b, 3, RandomRows(1, rng));
  std::string bits(static_cast<size_t>(kDModel) * 2, '\0');  // BF16 zeros
  bits[2 * 7] = '\x80';                                         // 0x7F80: +infinity at [0, 7]
  bits[2 * 7 + 1] = '\x7f';
  bf16.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_BF16);
  bf16.mutable_hidden_states()->set_raw_data(bits);
  *non_finite.add_steps() = bf16;
  const v1::ExtendResponse refused = Extend(non_finite);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(refused.results(i).code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StartsWith(refused.results(i).message(),
                                 absl::StrCat("steps[", i, "].hidden_states")))
        << refused.results(i).message();
  }
  EXPECT_TRUE(absl::StrContains(refused.results(0).message(), "row 1 (the session's token 4)"))
      << refused.results(0).message();
  EXPECT_TRUE(absl::StrContains(refused.results(1).message(), "row 0 (the session's token 3) holds inf"))
      << refused.results(1).message();
  v1::ExtendRequest next;
  *next.add_steps() = Step(b, 3, RandomRows(1, rng));
  EXPECT_EQ(Extend(next).results(0).code(), 0);
}

TEST_F(SessionServiceTest, ARepeatedStepReplaysItsAnswerAndForksDivergeFromTheirParent) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string parent = Open();
  const std::vector<float> prompt = RandomRows(6, rng);
  v1::ExtendRequest request;
  *request.add_steps() = Step(parent, 0, prompt);
  const v1::ExtendResponse first = Extend(request);
  ASSERT_EQ(first.results(0).code(), 0) << first.results(0).message();
  const v1::ExtendResponse again = Extend(request);
  EXPECT_TRUE(again.results(0).replayed());
  EXPECT_EQ(again.results(0).length(), 6);
  EXPECT_EQ(again.results(0).output().SerializeAsString(), first.results(0).output().SerializeAsString());

  v1::ForkSessionRequest fork;
  fork.set_session_id(parent);
  v1::Session child;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::ForkSession, fork, &child).ok());
  EXPECT_EQ(child.layer_lengths(0), 6);
  const std::vector<float> to_parent = RandomRows(1, rng), to_child = RandomRows(2, rng);
  v1::ExtendRequest both;
  *both.add_steps() = Step(parent, 6, to_parent);
  *both.add_steps() = Step(child.session_id(), 6, to_child);
  const v1::ExtendResponse diverged = Extend(both);
  std::vector<float> parent_seq = prompt, child_seq = prompt;
  parent_seq.insert(parent_seq.end(), to_parent.begin(), to_parent.end());
  child_seq.insert(child_seq.end(), to_child.begin(), to_child.end());
  EXPECT_LT(testing::RelativeFrobeniusError(Floats(diverged.results(0).output()),
                                            Rows(Reference(parent_seq).output, 6, 1, kDModel)),
            1e-5);
  EXPECT_LT(testing::RelativeFrobeniusError(Floats(diverged.results(1).output()),
                                            Rows(Reference(child_seq).output, 6, 2, kDModel)),
            1e-5);

  // Truncating the child back to the prompt makes it the parent's twin again.
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(child.session_id());
  truncate.set_all_layers(true);
  truncate.set_length(6);
  v1::Session truncated;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::TruncateSession, truncate, &truncated).ok());
  EXPECT_EQ(truncated.layer_lengths(0), 6);
  v1::ExtendRequest twin;
  *twin.add_steps() = Step(child.session_id(), 6, to_parent);
  const v1::ExtendResponse same = Extend(twin);
  EXPECT_LT(testing::RelativeFrobeniusError(Floats(same.results(0).output()),
                                            Rows(Reference(parent_seq).output, 6, 1, kDModel)),
            1e-5);

  v1::CloseSessionRequest close;
  close.set_session_id(parent);
  v1::CloseSessionResponse closed;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::CloseSession, close, &closed).ok());
  v1::GetSessionRequest get;
  get.set_session_id(parent);
  v1::Session gone;
  grpc::Status status = Call(&v1::AttentionService::Stub::GetSession, get, &gone);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "closed")) << status.error_message();
}

TEST_F(SessionServiceTest, OpenRefusesWhatItCannotServeNamingTheField) {
  v1::OpenSessionRequest request;
  request.add_models("no-such-model");
  v1::Session session;
  grpc::Status status = Call(&v1::AttentionService::Stub::OpenSession, request, &session);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "models[0]")) << status.error_message();
  request.set_models(0, "default");
  request.set_max_tokens(int64_t{1} << 40);
  status = Call(&v1::AttentionService::Stub::OpenSession, request, &session);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "max_tokens")) << status.error_message();
  v1::ExtendRequest empty;
  v1::ExtendResponse response;
  status = Call(&v1::AttentionService::Stub::Extend, empty, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "steps")) << status.error_message();
}

TEST_F(SessionServiceTest, ASessionBelongsToTheTokenThatOpenedIt) {
  const std::string dir = ::testing::TempDir();
  const std::string tokens = dir + "/session_tokens";
  std::ofstream(tokens) << "alice-token\nbob-token\n";
  Start(tokens);
  const std::string id = Open(v1::DATA_TYPE_FP32, "alice-token");
  ASSERT_FALSE(id.empty());
  v1::GetSessionRequest get;
  get.set_session_id(id);
  v1::Session session;
  EXPECT_TRUE(Call(&v1::AttentionService::Stub::GetSession, get, &session, "alice-token").ok());
  grpc::Status bob = Call(&v1::AttentionService::Stub::GetSession, get, &session, "bob-token");
  EXPECT_EQ(bob.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(bob.error_message(), "unknown session")) << bob.error_message();
  grpc::Status none = Call(&v1::AttentionService::Stub::GetSession, get, &session);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(SessionServiceTest, TheMetricsShowTheSessionsAndTheirKvCache) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string id = Open();
  v1::ExtendRequest request;
  *request.add_steps() = Step(id, 0, RandomRows(40, rng));
  ASSERT_EQ(Extend(request).results(0).code(), 0);
  const auto scrape = [this] { return server_->MetricsText(); };
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_sessions", 1));
  // 40 tokens in blocks of 32: 2 blocks of K and V, 12 heads x 32 x 64 x 4
  // bytes each (196608 bytes a block).
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_used_bytes", 2 * 196608));
  EXPECT_EQ(testing::SampleValue(scrape(), "attnserve_kv_cache_budget_bytes"),
            static_cast<double>(SessionLimits().kv_cache_bytes));
  EXPECT_EQ(testing::SampleValue(
                scrape(), "attnserve_requests_total{code=\"OK\",method=\"Extend\"}"),
            1);
}

}  // namespace
}  // namespace attnserve::server
