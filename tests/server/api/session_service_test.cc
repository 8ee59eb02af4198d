// Decode sessions through the real server on an ephemeral port, called with
// the generated stub: every step's output equals the matching rows of the
// double-precision reference layer run causally over the whole sequence so
// far (FP32 KV within 1e-5, BF16 KV within 2e-2, relative Frobenius); a
// micro-batch answers each step on its own; retries replay; forks diverge;
// truncation rewinds; tokens own their sessions; the metrics show them;
// GetLatestAttention reads the last row of the latest step's maps.
// ExtendStream answers each message as Extend does (the same bits), in
// order; a bad step is refused by its code while the stream goes on; a
// message that fails as a whole ends the stream with its status;
// cancellation and the drain end it without appending a step half-done.
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_weights.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"
#include "tests/core/reference_attention.h"
#include "tests/server/api/attend_requests.h"
#include "tests/server/api/blockable_server.h"
#include "tests/temp_path.h"

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

  void Start(const std::string& tokens_file, int64_t max_attention_map_bytes = 0) {
    ServerOptions options;
    if (max_attention_map_bytes > 0) {
      options.limits.max_attention_map_bytes = max_attention_map_bytes;
    }
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
  testing::ReferenceResult Reference(const std::vector<float>& sequence,
                                     absl::Span<const float> head_mask = {}) const {
    core::LayerInputs inputs;
    inputs.hidden_states = sequence;
    inputs.head_mask = head_mask;
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

// ExtendStep.head_statistics: entropy and max weight of each new row of each
// head ([heads, n] FP32), after the head mask, equal those of the double
// reference's gated map rows (FP32 KV within 1e-5, BF16 KV within 2e-2,
// relative Frobenius); with the maps asked for too and without them; a
// removed head's are 0.
TEST_F(SessionServiceTest, ExtendReturnsTheHeadStatisticsOfEachNewRowUnderAHeadMask) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  std::vector<float> head_mask(12, 1.0f);
  head_mask[1] = 0.5f;
  head_mask[4] = 0.0f;
  head_mask[9] = 1.5f;
  for (v1::DataType kv : {v1::DATA_TYPE_FP32, v1::DATA_TYPE_BF16}) {
    for (bool with_maps : {false, true}) {
      SCOPED_TRACE(absl::StrCat(v1::DataType_Name(kv), with_maps ? ", with maps" : ""));
      const double tolerance = kv == v1::DATA_TYPE_BF16 ? 2e-2 : 1e-5;
      const std::string id = Open(kv);
      std::vector<float> sequence;
      for (int64_t n : {6, 1, 3}) {
        const std::vector<float> rows = RandomRows(n, rng);
        const int64_t before = static_cast<int64_t>(sequence.size()) / kDModel;
        sequence.insert(sequence.end(), rows.begin(), rows.end());
        v1::ExtendRequest request;
        v1::ExtendStep* step = request.add_steps();
        *step = Step(id, before, rows);
        step->set_head_statistics(true);
        step->set_attention_maps(with_maps);
        for (float g : head_mask) step->add_head_mask(g);
        const v1::ExtendResponse response = Extend(request);
        ASSERT_EQ(response.results_size(), 1);
        const v1::ExtendResult& result = response.results(0);
        ASSERT_EQ(result.code(), 0) << result.message();
        EXPECT_EQ(result.has_attention_maps(), with_maps);
        const v1::HeadStatistics& stats = result.head_statistics();
        ASSERT_EQ(stats.entropy().shape_size(), 2);
        EXPECT_EQ(stats.entropy().shape(0), 12);
        EXPECT_EQ(stats.entropy().shape(1), n);
        EXPECT_EQ(stats.entropy().dtype(), v1::DATA_TYPE_FP32);
        EXPECT_EQ(stats.max_weight().shape(1), n);
        EXPECT_FALSE(stats.has_contribution());
        const testing::ReferenceResult reference = Reference(sequence, head_mask);
        EXPECT_LT(testing::RelativeFrobeniusError(Floats(result.output()),
                                                  Rows(reference.output, before, n, kDModel)),
                  tolerance);
        const int64_t length = before + n;
        const testing::RowStatistics want =
            testing::ReferenceRowStatistics(reference.per_head_maps, 12, length, before, n);
        const std::vector<double>& entropy = want.entropy;
        const std::vector<double>& max_weight = want.max_weight;
        const std::vector<float> got_entropy = Floats(stats.entropy());
        const std::vector<float> got_max = Floats(stats.max_weight());
        EXPECT_LT(testing::RelativeFrobeniusError(got_entropy, entropy), tolerance);
        EXPECT_LT(testing::RelativeFrobeniusError(got_max, max_weight), tolerance);
        for (int64_t i = 0; i < n; ++i) {  // head 4 is removed
          EXPECT_EQ(got_entropy[static_cast<size_t>(4 * n + i)], 0.0f);
          EXPECT_EQ(got_max[static_cast<size_t>(4 * n + i)], 0.0f);
        }
      }
    }
  }
}

// The maps that head statistics are computed from (when the maps themselves
// are not asked for) count against --max_attention_map_bytes: a step over it
// is refused naming steps[i].head_statistics and its layer stays as it was.
TEST_F(SessionServiceTest, HeadStatisticsOverTheMapLimitAreRefusedNamingTheField) {
  // 12 heads x 8 rows x 8 keys x 4 bytes = 3072 bytes of maps.
  Start("", /*max_attention_map_bytes=*/3000);
  std::mt19937_64 rng(std::random_device{}());
  const std::string id = Open();
  v1::ExtendRequest request;
  *request.add_steps() = Step(id, 0, RandomRows(8, rng));
  request.mutable_steps(0)->set_head_statistics(true);
  v1::ExtendResponse response = Extend(request);
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(absl::StrContains(response.results(0).message(), "steps[0].head_statistics"))
      << response.results(0).message();
  // Fewer rows fit, and the layer grows from 0.
  v1::ExtendRequest smaller;
  *smaller.add_steps() = Step(id, 0, RandomRows(7, rng));
  smaller.mutable_steps(0)->set_head_statistics(true);
  response = Extend(smaller);
  ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).length(), 7);
  EXPECT_EQ(response.results(0).head_statistics().entropy().shape(1), 7);
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
  const std::string tokens = testing::TempPath("session_tokens");
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

// GetLatestAttention after each step: the last row of that step's maps (the
// same weights to 1e-6 absolute, FP32 and BF16 KV) and of the reference's
// (FP32 KV within 1e-5, BF16 within 2e-2, relative Frobenius); the session's
// owner alone; the codes; its own metrics method.
TEST_F(SessionServiceTest, GetLatestAttentionReadsTheLastRowOfTheLatestStepsMaps) {
  const std::string tokens = testing::TempPath("latest_tokens");
  std::ofstream(tokens) << "alice-token\nbob-token\n";
  // Room for the prefill's maps (12 heads x 7 x 7 x 4 bytes = 2352) and
  // reads of up to 50 tokens (12 x 50 x 4 = 2400 bytes).
  Start(tokens, 2400);
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  const auto latest = [this](const std::string& id, int layer, v1::LatestAttention* response,
                             const std::string& token = "alice-token") {
    v1::LatestAttentionRequest request;
    request.set_session_id(id);
    request.set_layer(layer);
    return Call(&v1::AttentionService::Stub::GetLatestAttention, request, response, token);
  };
  int reads = 0;
  for (v1::DataType kv : {v1::DATA_TYPE_FP32, v1::DATA_TYPE_BF16}) {
    SCOPED_TRACE(v1::DataType_Name(kv));
    const double tolerance = kv == v1::DATA_TYPE_BF16 ? 2e-2 : 1e-5;
    const std::string id = Open(kv, "alice-token");
    v1::LatestAttention read;
    EXPECT_EQ(latest(id, 0, &read).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    std::vector<float> sequence;
    for (int64_t n : {7, 1, 1, 1}) {
      const std::vector<float> rows = RandomRows(n, rng);
      const int64_t before = static_cast<int64_t>(sequence.size()) / kDModel;
      sequence.insert(sequence.end(), rows.begin(), rows.end());
      const int64_t length = before + n;
      v1::ExtendRequest request;
      *request.add_steps() = Step(id, before, rows);
      request.mutable_steps(0)->set_attention_maps(true);
      const v1::ExtendResponse response = Extend(request, "alice-token");
      ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
      grpc::Status status = latest(id, 0, &read);
      ASSERT_TRUE(status.ok()) << status.error_message();
      ++reads;
      EXPECT_EQ(read.session_id(), id);
      EXPECT_EQ(read.length(), length);
      EXPECT_EQ(read.position(), length - 1);
      ASSERT_EQ(read.maps().dtype(), v1::DATA_TYPE_FP32);
      ASSERT_EQ(read.maps().shape_size(), 2);
      EXPECT_EQ(read.maps().shape(0), 12);
      EXPECT_EQ(read.maps().shape(1), length);
      const std::vector<float> maps = Floats(read.maps());
      const std::vector<float> step_maps = Floats(response.results(0).attention_maps());
      const testing::ReferenceResult reference = Reference(sequence);
      std::vector<double> expected;
      for (int64_t h = 0; h < 12; ++h) {
        for (int64_t j = 0; j < length; ++j) {
          EXPECT_NEAR(maps[static_cast<size_t>(h * length + j)],
                      step_maps[static_cast<size_t>((h * n + n - 1) * length + j)], 1e-6);
          expected.push_back(
              reference.per_head_maps[static_cast<size_t>((h * length + length - 1) * length + j)]);
        }
      }
      EXPECT_LT(testing::RelativeFrobeniusError(maps, expected), tolerance);
      EXPECT_EQ(Floats(read.head_statistics().entropy()).size(), 12u);
      EXPECT_EQ(Floats(read.head_statistics().max_weight()).size(), 12u);
    }
    // Another token: NOT_FOUND, as for an unknown id.
    grpc::Status bob = latest(id, 0, &read, "bob-token");
    EXPECT_EQ(bob.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_TRUE(absl::StrContains(bob.error_message(), "unknown session")) << bob.error_message();
    grpc::Status layer = latest(id, 1, &read);
    EXPECT_EQ(layer.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StartsWith(layer.error_message(), "layer:")) << layer.error_message();
    // 51 tokens: maps over --max_attention_map_bytes.
    v1::ExtendRequest more;
    *more.add_steps() = Step(id, 10, RandomRows(41, rng));
    ASSERT_EQ(Extend(more, "alice-token").results(0).code(), 0);
    grpc::Status over = latest(id, 0, &read);
    EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_TRUE(absl::StrContains(over.error_message(), "--max_attention_map_bytes"))
        << over.error_message();
    // Truncated below the latest token: FAILED_PRECONDITION.
    v1::TruncateSessionRequest truncate;
    truncate.set_session_id(id);
    truncate.set_length(9);
    v1::Session session;
    ASSERT_TRUE(
        Call(&v1::AttentionService::Stub::TruncateSession, truncate, &session, "alice-token").ok());
    grpc::Status truncated = latest(id, 0, &read);
    EXPECT_EQ(truncated.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_TRUE(absl::StrContains(truncated.error_message(), "extend it by a token first"))
        << truncated.error_message();
  }
  const auto scrape = [this] { return server_->MetricsText(); };
  // Counted when each call is done: wait for the last.
  EXPECT_TRUE(testing::WaitForSample(
      scrape, "attnserve_requests_total{code=\"OK\",method=\"GetLatestAttention\"}", reads));
  EXPECT_TRUE(testing::WaitForSample(scrape,
                                     "attnserve_requests_total{code=\"FAILED_PRECONDITION\","
                                     "method=\"GetLatestAttention\"}",
                                     4));
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

// A decode step that needs a fresh block takes a run of them (a quarter of
// the blocks the layer has taken: 2 after 8) and keeps the rest ahead of its
// tokens: they count in the session's kv_blocks, in the bytes used and in the
// gauge of blocks ahead.
TEST_F(SessionServiceTest, AStepNeedingAFreshBlockTakesARunAndTheBlocksAheadAreCounted) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string id = Open();
  constexpr double kBlockBytes = 196608;  // 32 tokens of 12 heads x 64, K and V, FP32
  const auto scrape = [this] { return server_->MetricsText(); };
  v1::ExtendRequest prefill;
  *prefill.add_steps() = Step(id, 0, RandomRows(256, rng));  // 8 blocks, exactly
  ASSERT_EQ(Extend(prefill).results(0).code(), 0);
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_used_bytes", 8 * kBlockBytes));
  EXPECT_EQ(testing::SampleValue(scrape(), "attnserve_kv_cache_ahead_blocks"), 0);
  v1::ExtendRequest step;
  *step.add_steps() = Step(id, 256, RandomRows(1, rng));  // token 257: block 9 and one ahead
  ASSERT_EQ(Extend(step).results(0).code(), 0);
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_used_bytes", 10 * kBlockBytes));
  EXPECT_EQ(testing::SampleValue(scrape(), "attnserve_kv_cache_ahead_blocks"), 1);
  v1::GetSessionRequest get;
  get.set_session_id(id);
  v1::Session session;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::GetSession, get, &session).ok());
  EXPECT_EQ(session.layer_lengths(0), 257);
  EXPECT_EQ(session.kv_blocks(), 10);
  EXPECT_EQ(session.kv_bytes(), 10 * kBlockBytes);
  // 31 tokens fill block 9; token 289 goes into the block ahead: nothing more
  // is taken.
  v1::ExtendRequest fill;
  *fill.add_steps() = Step(id, 257, RandomRows(31, rng));
  ASSERT_EQ(Extend(fill).results(0).code(), 0);
  v1::ExtendRequest next;
  *next.add_steps() = Step(id, 288, RandomRows(1, rng));
  ASSERT_EQ(Extend(next).results(0).code(), 0);
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_ahead_blocks", 0));
  EXPECT_EQ(testing::SampleValue(scrape(), "attnserve_kv_cache_used_bytes"), 10 * kBlockBytes);
}

TEST_F(SessionServiceTest, TheStepMetricsFollowTheStepsTheirTokensAndTheKvTheyRead) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string a = Open(), b = Open();
  // K and V of one token of the built-in model: 12 heads x 64 x 4 bytes each.
  constexpr double kTokenKvBytes = 2 * 12 * 64 * 4;
  const auto scrape = [this] { return server_->MetricsText(); };
  double read = 0, tokens = 0, batches = 0;
  int64_t a_length = 0, b_length = 0;
  for (const auto& [a_new, b_new] : std::vector<std::pair<int64_t, int64_t>>{{40, 9}, {1, 1}, {3, 1}}) {
    v1::ExtendRequest request;
    *request.add_steps() = Step(a, a_length, RandomRows(a_new, rng));
    *request.add_steps() = Step(b, b_length, RandomRows(b_new, rng));
    const v1::ExtendResponse response = Extend(request);
    ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
    ASSERT_EQ(response.results(1).code(), 0) << response.results(1).message();
    a_length += a_new;
    b_length += b_new;
    // A step's attention reads every token its layer holds after it, once.
    read += static_cast<double>(a_length + b_length) * kTokenKvBytes;
    tokens += static_cast<double>(a_new + b_new);
    ++batches;
  }
  // A repeated step replays: nothing computed, nothing read.
  v1::ExtendRequest again;
  *again.add_steps() = Step(a, a_length, RandomRows(1, rng));
  ASSERT_EQ(Extend(again).results(0).code(), 0);
  read += static_cast<double>(a_length + 1) * kTokenKvBytes;
  tokens += 1;
  ++batches;
  ASSERT_TRUE(Extend(again).results(0).replayed());
  a_length += 1;
  const std::string text = scrape();
  const std::string model = "{model=\"default\"}";
  EXPECT_EQ(testing::SampleValue(text, "attnserve_kv_cache_read_bytes_total" + model), read);
  EXPECT_EQ(testing::SampleValue(text, "attnserve_decode_batch_tokens_count" + model), batches);
  EXPECT_EQ(testing::SampleValue(text, "attnserve_decode_batch_tokens_sum" + model), tokens);
  // Every call answered OK is a step, the replay too.
  EXPECT_EQ(testing::SampleValue(
                text, "attnserve_decode_step_seconds_count{method=\"Extend\"}"),
            batches + 1);
  // The lengths the reads were counted from are the sessions'.
  for (const auto& [id, length] : {std::pair{a, a_length}, std::pair{b, b_length}}) {
    v1::GetSessionRequest get;
    get.set_session_id(id);
    v1::Session session;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::GetSession, get, &session).ok());
    EXPECT_EQ(session.layer_lengths(0), length);
  }

  // A fork shares every block of its parent until one of them writes: a's
  // 45 tokens are two blocks (of 32).
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_shared_blocks", 0));
  v1::ForkSessionRequest fork;
  fork.set_session_id(a);
  v1::Session child;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::ForkSession, fork, &child).ok());
  ASSERT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_shared_blocks", 2));
  v1::ExtendRequest diverge;
  *diverge.add_steps() = Step(child.session_id(), a_length, RandomRows(1, rng));
  ASSERT_EQ(Extend(diverge).results(0).code(), 0);
  // The child's last block was copied before its write; the first stays shared.
  EXPECT_TRUE(testing::WaitForSample(scrape, "attnserve_kv_cache_shared_blocks", 1));
}

// ExtendStream: one stream, many messages, each answered in order.
using StreamPtr = std::unique_ptr<grpc::ClientReaderWriter<v1::ExtendRequest, v1::ExtendResponse>>;

// Writes `request` on `stream` and reads its answer; false when the stream
// ended instead.
bool Exchange(StreamPtr& stream, const v1::ExtendRequest& request, v1::ExtendResponse* response) {
  return stream->Write(request) && stream->Read(response);
}

// The stream's status once it has ended (what is left unread is dropped).
grpc::Status Ended(StreamPtr& stream) {
  v1::ExtendResponse unread;
  while (stream->Read(&unread)) {
  }
  return stream->Finish();
}

TEST_F(SessionServiceTest, ExtendStreamAnswersEachMessageInOrderAsExtendDoes) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  // The stream drives a and b; unary Extend calls drive their twins with the
  // same messages.
  const std::string a = Open(), b = Open(), twin_a = Open(), twin_b = Open();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  StreamPtr stream = stub_->ExtendStream(&context);
  std::vector<float> a_seq, b_seq;
  int64_t messages = 0;
  for (const auto& [a_new, b_new] : std::vector<std::pair<int64_t, int64_t>>{
           {7, 3}, {1, 1}, {1, 1}, {4, 1}, {1, 2}, {1, 1}}) {
    const std::vector<float> a_rows = RandomRows(a_new, rng), b_rows = RandomRows(b_new, rng);
    const int64_t a_before = static_cast<int64_t>(a_seq.size()) / kDModel;
    const int64_t b_before = static_cast<int64_t>(b_seq.size()) / kDModel;
    a_seq.insert(a_seq.end(), a_rows.begin(), a_rows.end());
    b_seq.insert(b_seq.end(), b_rows.begin(), b_rows.end());
    v1::ExtendRequest request, twin;
    *request.add_steps() = Step(a, a_before, a_rows);
    *request.add_steps() = Step(b, b_before, b_rows);
    *twin.add_steps() = Step(twin_a, a_before, a_rows);
    *twin.add_steps() = Step(twin_b, b_before, b_rows);
    v1::ExtendResponse streamed;
    ASSERT_TRUE(Exchange(stream, request, &streamed)) << Ended(stream).error_message();
    ++messages;
    const v1::ExtendResponse unary = Extend(twin);
    ASSERT_EQ(streamed.results_size(), 2);
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(streamed.results(i).code(), 0) << streamed.results(i).message();
      // The same code plans and runs both forms: the same bits.
      EXPECT_EQ(streamed.results(i).output().raw_data(), unary.results(i).output().raw_data())
          << "message " << messages << ", step " << i;
    }
    EXPECT_EQ(streamed.results(0).length(), a_before + a_new);
    EXPECT_EQ(streamed.results(1).length(), b_before + b_new);
    EXPECT_TRUE(absl::EndsWith(streamed.kernel_path(), "/paged")) << streamed.kernel_path();
    EXPECT_LT(testing::RelativeFrobeniusError(Floats(streamed.results(0).output()),
                                              Rows(Reference(a_seq).output, a_before, a_new,
                                                   kDModel)),
              1e-5);
    EXPECT_LT(testing::RelativeFrobeniusError(Floats(streamed.results(1).output()),
                                              Rows(Reference(b_seq).output, b_before, b_new,
                                                   kDModel)),
              1e-5);
  }
  // A message repeated after a lost answer replays on the stream as well.
  v1::ExtendRequest last;
  *last.add_steps() = Step(a, static_cast<int64_t>(a_seq.size()) / kDModel, RandomRows(1, rng));
  v1::ExtendResponse first, again;
  ASSERT_TRUE(Exchange(stream, last, &first));
  ASSERT_TRUE(Exchange(stream, last, &again));
  EXPECT_FALSE(first.results(0).replayed());
  EXPECT_TRUE(again.results(0).replayed());
  EXPECT_EQ(again.results(0).output().raw_data(), first.results(0).output().raw_data());
  // The client half-closes: the stream ends OK.
  ASSERT_TRUE(stream->WritesDone());
  const grpc::Status status = Ended(stream);
  EXPECT_TRUE(status.ok()) << status.error_message();
  const std::string metrics = server_->MetricsText();
  EXPECT_EQ(testing::SampleValue(
                metrics, "attnserve_requests_total{code=\"OK\",method=\"ExtendStream\"}"),
            1);
  EXPECT_EQ(testing::SampleValue(
                metrics, "attnserve_decode_step_seconds_count{method=\"ExtendStream\"}"),
            static_cast<double>(messages) + 2);
  // Each message waited for the compute executor as an Extend call does.
  EXPECT_EQ(testing::SampleValue(metrics, "attnserve_queue_wait_seconds_count{model=\"\"}"),
            2.0 * static_cast<double>(messages) + 1);
}

TEST_F(SessionServiceTest, ExtendStreamAnswersABadStepWithItsCodeAndGoesOn) {
  const std::string tokens = testing::TempPath("stream_tokens");
  std::ofstream(tokens) << "alice-token\nbob-token\n";
  Start(tokens);
  std::mt19937_64 rng(std::random_device{}());
  const std::string alice = Open(v1::DATA_TYPE_FP32, "alice-token");
  const std::string bob = Open(v1::DATA_TYPE_FP32, "bob-token");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  context.AddMetadata("authorization", "Bearer bob-token");
  StreamPtr stream = stub_->ExtendStream(&context);
  v1::ExtendRequest mixed;
  *mixed.add_steps() = Step(bob, 0, RandomRows(2, rng));
  *mixed.add_steps() = Step(alice, 0, RandomRows(1, rng));  // not bob's: as if unknown
  *mixed.add_steps() = Step(bob, 2, RandomRows(1, rng));
  mixed.mutable_steps(2)->mutable_hidden_states()->set_shape(1, 767);
  v1::ExtendResponse response;
  ASSERT_TRUE(Exchange(stream, mixed, &response)) << Ended(stream).error_message();
  ASSERT_EQ(response.results_size(), 3);
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(1).code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StartsWith(response.results(1).message(), "steps[1]: "))
      << response.results(1).message();
  EXPECT_EQ(response.results(2).code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(response.results(2).message(), "steps[2].hidden_states"))
      << response.results(2).message();
  // The stream goes on, and alice's session is as it was.
  v1::ExtendRequest next;
  *next.add_steps() = Step(bob, 2, RandomRows(1, rng));
  ASSERT_TRUE(Exchange(stream, next, &response));
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).length(), 3);
  v1::GetSessionRequest get;
  get.set_session_id(alice);
  v1::Session session;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::GetSession, get, &session, "alice-token").ok());
  EXPECT_EQ(session.layer_lengths(0), 0);
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(Ended(stream).ok());

  // Without a token the stream is refused before its first message is run.
  grpc::ClientContext anonymous;
  anonymous.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  StreamPtr refused = stub_->ExtendStream(&anonymous);
  refused->Write(next);  // may fail: the server may have ended the stream already
  EXPECT_EQ(Ended(refused).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(SessionServiceTest, ExtendStreamEndsWithTheStatusOfAMessageThatFailsAsAWhole) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string id = Open();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  StreamPtr stream = stub_->ExtendStream(&context);
  v1::ExtendRequest good;
  *good.add_steps() = Step(id, 0, RandomRows(3, rng));
  v1::ExtendResponse response;
  ASSERT_TRUE(Exchange(stream, good, &response));
  ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
  v1::ExtendRequest empty;  // no steps: Extend would fail as a whole
  EXPECT_FALSE(Exchange(stream, empty, &response));
  const grpc::Status status = Ended(stream);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "steps")) << status.error_message();
  EXPECT_EQ(testing::SampleValue(
                server_->MetricsText(),
                "attnserve_requests_total{code=\"INVALID_ARGUMENT\",method=\"ExtendStream\"}"),
            1);
}

// A server whose compute executor the test holds (BlockableServer), so a
// message stays queued until the test lets it run.
server::ServerOptions BlockableOptions() {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  return options;
}

std::string OpenOn(v1::AttentionService::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::OpenSessionRequest request;
  request.add_models("default");
  v1::Session session;
  EXPECT_TRUE(stub.OpenSession(&context, request, &session).ok());
  return session.session_id();
}

int64_t LengthOn(v1::AttentionService::Stub& stub, const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::GetSessionRequest request;
  request.set_session_id(id);
  v1::Session session;
  const grpc::Status status = stub.GetSession(&context, request, &session);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return session.layer_lengths_size() > 0 ? session.layer_lengths(0) : -1;
}

TEST(ExtendStreamService, ACancelledStreamStopsItsQueuedMessageAndAppendsNothing) {
  testing::BlockableServer server(BlockableOptions(), kSeed);
  std::mt19937_64 rng(std::random_device{}());
  const std::string id = OpenOn(server.stub());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  StreamPtr stream = server.stub().ExtendStream(&context);
  v1::ExtendRequest request;
  *request.add_steps() = Step(id, 0, RandomRows(4, rng));
  server.Block();
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(server.WaitForQueueDepth(1));
  context.TryCancel();
  server.Release();
  EXPECT_EQ(Ended(stream).error_code(), grpc::StatusCode::CANCELLED);
  // The step was not appended: the session goes on from 0.
  EXPECT_EQ(LengthOn(server.stub(), id), 0);
  const std::function<std::string()> scrape = [&server] { return server.MetricsText(); };
  EXPECT_TRUE(testing::WaitForSample(
      scrape, "attnserve_requests_total{code=\"CANCELLED\",method=\"ExtendStream\"}", 1));
  EXPECT_TRUE(testing::WaitForSample(scrape, "attnserve_queue_depth", 0));
}

TEST(ExtendStreamService, ADrainAnswersTheMessageRunningThenEndsEveryStreamUnavailable) {
  testing::BlockableServer server(BlockableOptions(), kSeed);
  std::mt19937_64 rng(std::random_device{}());
  const std::string busy_id = OpenOn(server.stub()), idle_id = OpenOn(server.stub());
  grpc::ClientContext busy_context, idle_context;
  for (grpc::ClientContext* c : {&busy_context, &idle_context}) {
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  }
  StreamPtr busy = server.stub().ExtendStream(&busy_context);
  StreamPtr idle = server.stub().ExtendStream(&idle_context);
  // The idle stream has answered a message and waits for the next.
  v1::ExtendRequest first;
  *first.add_steps() = Step(idle_id, 0, RandomRows(2, rng));
  v1::ExtendResponse response;
  ASSERT_TRUE(Exchange(idle, first, &response));
  ASSERT_EQ(response.results(0).code(), 0) << response.results(0).message();
  // The busy one has a message queued behind the held executor.
  v1::ExtendRequest queued;
  *queued.add_steps() = Step(busy_id, 0, RandomRows(3, rng));
  server.Block();
  ASSERT_TRUE(busy->Write(queued));
  ASSERT_TRUE(server.WaitForQueueDepth(1));
  server.service().set_state(server::AttentionServiceImpl::State::kDraining);
  // The idle stream ends at once, though the executor is still held.
  const grpc::Status idle_status = Ended(idle);
  EXPECT_EQ(idle_status.error_code(), grpc::StatusCode::UNAVAILABLE) << idle_status.error_message();
  EXPECT_FALSE(server.service().WaitForIdle(absl::Now()));  // the queued message is in flight
  server.Release();
  // The queued message runs and is answered; then the stream ends.
  ASSERT_TRUE(busy->Read(&response));
  EXPECT_EQ(response.results(0).code(), 0) << response.results(0).message();
  EXPECT_EQ(response.results(0).length(), 3);
  EXPECT_EQ(Ended(busy).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(server.service().WaitForIdle(absl::Now() + absl::Seconds(60)));
  // A stream opened during the drain is refused.
  grpc::ClientContext late_context;
  late_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  StreamPtr late = server.stub().ExtendStream(&late_context);
  late->Write(first);  // may fail: the server may have ended the stream already
  EXPECT_EQ(Ended(late).error_code(), grpc::StatusCode::UNAVAILABLE);
}

// The whole shutdown (AttnServer::Shutdown: lame duck, drain, stop): an idle
// stream is told UNAVAILABLE (retryable), not cut off CANCELLED when the
// server stops.
TEST_F(SessionServiceTest, ShutdownEndsAnIdleStreamUnavailable) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string id = Open();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  StreamPtr stream = stub_->ExtendStream(&context);
  v1::ExtendRequest request;
  *request.add_steps() = Step(id, 0, RandomRows(2, rng));
  v1::ExtendResponse response;
  ASSERT_TRUE(Exchange(stream, request, &response));
  server_->Shutdown();
  const grpc::Status status = Ended(stream);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  // The drain's own answer, not gRPC ending what is left when the server stops.
  EXPECT_TRUE(absl::StrContains(status.error_message(), "open the stream again"))
      << status.error_message();
}

}  // namespace
}  // namespace attnserve::server
