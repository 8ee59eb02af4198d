// Extend's scheduling through the real service on an ephemeral port, its
// compute executor held (BlockableServer) so that calls queue for certain:
// Extend calls queued together run as one batch (the responses' timing and
// attnserve_decode_batch_tokens say so) and each answers as it would alone
// (the double-precision causal reference over each whole sequence: FP32 KV
// within 1e-5, BF16 KV within 2e-2, relative Frobenius), over an MHA and a
// GQA layer with RoPE; a member whose caller cancelled fails no batch-mate;
// a prefill longer than --prefill_chunk_tokens is computed chunk by chunk
// (outputs, maps and head statistics equal the reference for random chunk
// sizes and lengths),
// a decode step queued behind it is answered before it finishes, a replay of
// it returns its answer, a cancel or a deadline between chunks leaves the
// layer as it was; a chunked step may pass --max_seq_len, an unchunked one not;
// a prefill's chunks shorten as its keys grow (PrefillChunkTokens, against a
// search over the rule and hand-computed values);
// Attend calls beside sessions are answered as before.
#include <grpcpp/client_context.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "gtest/gtest.h"
#include "server/api/extend_runner.h"
#include "server/attn_server.h"
#include "tests/core/reference_attention.h"
#include "tests/server/api/attend_requests.h"
#include "tests/server/api/blockable_server.h"

namespace attnserve::server {
namespace {

constexpr uint64_t kSeed = 5;

// A served layer and what the reference needs of it.
struct Layer {
  std::string model;
  core::HeadConfig config;
  core::AttentionWeights weights;
};

Layer MhaLayer() {  // the built-in model
  core::HeadConfig requested;
  requested.d_model = 768;
  requested.num_heads = 12;
  Layer layer{"default", *core::ResolveHeadConfig(requested), {}};
  layer.weights = core::SeededWeights(layer.config, kSeed);
  return layer;
}

// A GQA layer with RoPE (8 query heads over 2 KV heads, rotary on 16 of 32 dims).
Layer GqaLayer() {
  core::HeadConfig requested;
  requested.d_model = 256;
  requested.num_heads = 8;
  requested.num_kv_heads = 2;
  requested.rotary.rotary_dim = 16;
  Layer layer{"gqa", *core::ResolveHeadConfig(requested), {}};
  layer.weights = core::SeededWeights(layer.config, 77);
  return layer;
}

// The new tokens of each chunk a prefill of `n` tokens into a layer holding
// `keys` is computed in with --prefill_chunk_tokens=`chunk` (> 0), by the
// rule PrefillChunkTokens states (server/api/extend_runner.h), found here by
// search rather than its closed form: a step of at most `chunk` tokens is one
// piece; else each chunk is the longest t in [max(1, chunk / 8), chunk] (or
// what is left) with t (keys + t + P) <= chunk (chunk + P), where
// P = d_model (q_width + kv_width) / q_width.
std::vector<int64_t> ExpectedChunks(const core::HeadConfig& config, int64_t chunk, int64_t keys,
                                    int64_t n) {
  if (n <= chunk) return {n};
  const double p = static_cast<double>(config.d_model) *
                   static_cast<double>(config.q_width() + config.kv_width()) /
                   static_cast<double>(config.q_width());
  const double work = static_cast<double>(chunk) * (static_cast<double>(chunk) + p);
  std::vector<int64_t> chunks;
  for (int64_t done = 0; done < n;) {
    int64_t t = std::max<int64_t>(1, chunk / 8);
    while (t < chunk &&
           static_cast<double>(t + 1) * (static_cast<double>(keys + t + 1) + p) <= work) {
      ++t;
    }
    t = std::min(t, n - done);
    chunks.push_back(t);
    done += t;
    keys += t;
  }
  return chunks;
}

std::shared_ptr<const Model> ModelOf(const Layer& layer) {
  auto model = std::make_shared<Model>();
  model->name = layer.model;
  model->layer = *core::AttentionLayer::Create(layer.config, layer.weights);
  model->causal = true;
  return model;
}

std::vector<float> RandomRows(int64_t rows, int64_t width, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(rows * width));
  for (float& v : values) v = normal(rng);
  return values;
}

v1::ExtendStep Step(const std::string& id, int64_t expected, const std::vector<float>& rows,
                    int64_t width) {
  v1::ExtendStep step;
  step.set_session_id(id);
  step.set_expected_length(expected);
  v1::Tensor* t = step.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  t->add_shape(static_cast<int64_t>(rows.size()) / width);
  t->add_shape(width);
  t->set_raw_data(rows.data(), rows.size() * sizeof(float));
  return step;
}

// One Extend call in flight.
struct PendingExtend {
  grpc::ClientContext context;
  v1::ExtendRequest request;
  v1::ExtendResponse response;
  grpc::Status status;
  absl::Notification done;
};

// A session's tokens so far, on one layer.
struct Sequence {
  std::string id;
  const Layer* layer = nullptr;
  std::vector<float> tokens;
  int64_t length() const { return static_cast<int64_t>(tokens.size()) / layer->config.d_model; }
};

// The reference's rows [from, from + n) of the causal layer over `sequence`,
// (when `maps` is given) each head's map rows [from, from + n): [heads, n, from + n],
// and (when `stats` is given) each head's entropy and max weight of those rows.
std::vector<double> ReferenceRows(const Sequence& sequence, int64_t from, int64_t n,
                                  std::vector<double>* maps = nullptr,
                                  testing::RowStatistics* stats = nullptr) {
  const core::HeadConfig& config = sequence.layer->config;
  const int64_t length = sequence.length();
  core::LayerInputs inputs;
  inputs.hidden_states = sequence.tokens;
  inputs.layout = *core::SequenceLayout::Padded(1, length);
  inputs.causal = true;
  const testing::ReferenceResult reference =
      testing::ReferenceLayer(config, sequence.layer->weights, inputs);
  if (stats != nullptr) {
    *stats = testing::ReferenceRowStatistics(reference.per_head_maps, config.num_heads, length,
                                             from, n);
  }
  if (maps != nullptr) {
    maps->clear();
    for (int64_t h = 0; h < config.num_heads; ++h) {
      for (int64_t i = from; i < from + n; ++i) {
        const auto row = reference.per_head_maps.begin() + (h * length + i) * length;
        maps->insert(maps->end(), row, row + from + n);
      }
    }
  }
  return {reference.output.begin() + from * config.d_model,
          reference.output.begin() + (from + n) * config.d_model};
}

class ExtendBatchingTest : public ::testing::Test {
 protected:
  void Start(int64_t chunk_tokens, int64_t max_batch_tokens = 4096, int64_t max_seq_len = 2048) {
    ServerOptions options;
    options.limits.max_seq_len = max_seq_len;
    options.prefill_chunk_tokens = chunk_tokens;
    options.max_batch_tokens = max_batch_tokens;
    options.builtin_model_seed = kSeed;
    server_ = std::make_unique<testing::BlockableServer>(options, kSeed);
    server_->AddModel(ModelOf(gqa_));
  }

  Sequence Open(const Layer& layer, v1::DataType kv) {
    v1::OpenSessionRequest request;
    request.add_models(layer.model);
    request.set_kv_dtype(kv);
    v1::Session session;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    const grpc::Status status = server_->stub().OpenSession(&context, request, &session);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return {session.session_id(), &layer, {}};
  }

  int64_t Length(const std::string& id) {
    v1::GetSessionRequest request;
    request.set_session_id(id);
    v1::Session session;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    const grpc::Status status = server_->stub().GetSession(&context, request, &session);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return session.layer_lengths_size() == 1 ? session.layer_lengths(0) : -1;
  }

  // Starts a call of one step appending `rows` to `sequence` (`maps`: asks
  // for its maps, `stats`: for its head statistics); `on_done` runs when it
  // has finished.
  std::unique_ptr<PendingExtend> StartStep(Sequence& sequence, std::vector<float> rows,
                                           bool maps = false,
                                           std::function<void()> on_done = nullptr,
                                           absl::Duration timeout = absl::Seconds(300),
                                           bool stats = false) {
    auto call = std::make_unique<PendingExtend>();
    *call->request.add_steps() =
        Step(sequence.id, sequence.length(), rows, sequence.layer->config.d_model);
    call->request.mutable_steps(0)->set_attention_maps(maps);
    call->request.mutable_steps(0)->set_head_statistics(stats);
    sequence.tokens.insert(sequence.tokens.end(), rows.begin(), rows.end());
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    PendingExtend* c = call.get();
    server_->stub().async()->Extend(&c->context, &c->request, &c->response,
                                    [c, on_done = std::move(on_done)](grpc::Status status) {
                                      c->status = std::move(status);
                                      if (on_done) on_done();
                                      c->done.Notify();
                                    });
    return call;
  }

  // Checks a finished call of one step against the reference over its
  // sequence (as it was when the step was started: `length` after it).
  static void ExpectMatches(PendingExtend& call, const Sequence& sequence, int64_t length,
                            double tolerance) {
    call.done.WaitForNotification();
    ASSERT_TRUE(call.status.ok()) << call.status.error_message();
    ASSERT_EQ(call.response.results_size(), 1);
    const v1::ExtendResult& result = call.response.results(0);
    ASSERT_EQ(result.code(), 0) << result.message();
    EXPECT_EQ(result.length(), length);
    const int64_t n = call.request.steps(0).hidden_states().shape(0);
    Sequence prefix = sequence;
    prefix.tokens.resize(static_cast<size_t>(length * sequence.layer->config.d_model));
    std::vector<double> maps;
    testing::RowStatistics stats;
    const bool want_stats = call.request.steps(0).head_statistics();
    const std::vector<double> expected =
        ReferenceRows(prefix, length - n, n,
                      call.request.steps(0).attention_maps() ? &maps : nullptr,
                      want_stats ? &stats : nullptr);
    EXPECT_LT(testing::RelativeFrobeniusError(testing::Floats(result.output()), expected),
              tolerance)
        << "step of " << n << " to " << length;
    if (!maps.empty()) {
      EXPECT_LT(testing::RelativeFrobeniusError(testing::Floats(result.attention_maps()), maps),
                tolerance)
          << "maps of the step of " << n << " to " << length;
    }
    EXPECT_EQ(result.has_head_statistics(), want_stats);
    if (want_stats) {
      const v1::HeadStatistics& got = result.head_statistics();
      for (const v1::Tensor* t : {&got.entropy(), &got.max_weight()}) {
        ASSERT_EQ(t->shape_size(), 2);
        EXPECT_EQ(t->shape(0), sequence.layer->config.num_heads);
        EXPECT_EQ(t->shape(1), n);
      }
      EXPECT_LT(testing::RelativeFrobeniusError(testing::Floats(got.entropy()), stats.entropy),
                tolerance)
          << "entropy of the step of " << n << " to " << length;
      EXPECT_LT(
          testing::RelativeFrobeniusError(testing::Floats(got.max_weight()), stats.max_weight),
          tolerance)
          << "max weight of the step of " << n << " to " << length;
    }
  }

  // The layer's length once no step holds it: steps of one token are sent
  // until one is admitted (ABORTED while the stopped call still holds the
  // layer), and that step must match the reference over what the layer holds.
  int64_t HeldOnceFree(const Sequence& sequence, std::mt19937_64& rng) {
    const int64_t width = sequence.layer->config.d_model;
    for (const absl::Time give_up = absl::Now() + absl::Seconds(60); absl::Now() < give_up;) {
      Sequence probe = sequence;
      probe.tokens.resize(static_cast<size_t>(Length(sequence.id) * width));
      auto next = StartStep(probe, RandomRows(1, width, rng));
      next->done.WaitForNotification();
      EXPECT_TRUE(next->status.ok()) << next->status.error_message();
      if (!next->status.ok()) return -1;
      if (next->response.results(0).code() == grpc::StatusCode::ABORTED) continue;
      EXPECT_EQ(next->response.results(0).code(), 0) << next->response.results(0).message();
      const int64_t length = next->response.results(0).length() - 1;
      ExpectMatches(*next, probe, length + 1, 1e-5);
      return length;
    }
    ADD_FAILURE() << "the layer stayed held";
    return -1;
  }

  double Sample(const std::string& series) const {
    return testing::SampleValue(server_->MetricsText(), series);
  }

  Layer mha_ = MhaLayer();
  Layer gqa_ = GqaLayer();
  std::unique_ptr<testing::BlockableServer> server_;
};

TEST_F(ExtendBatchingTest, CallsQueuedTogetherRunAsOneBatchEachAnsweredAsAlone) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  Start(/*chunk_tokens=*/512);
  for (const Layer* layer : {&mha_, &gqa_}) {
    for (v1::DataType kv : {v1::DATA_TYPE_FP32, v1::DATA_TYPE_BF16}) {
      SCOPED_TRACE(absl::StrCat(layer->model, " ", v1::DataType_Name(kv)));
      const double tolerance = kv == v1::DATA_TYPE_BF16 ? 2e-2 : 1e-5;
      const int64_t width = layer->config.d_model;
      std::vector<Sequence> sequences;
      for (int i = 0; i < 4; ++i) sequences.push_back(Open(*layer, kv));
      const std::string label = absl::StrCat("{model=\"", layer->model, "\"}");
      // A prefill of mixed lengths, then two rounds of decode steps: each
      // round's calls queued together.
      const std::vector<std::vector<int64_t>> rounds = {{1, 7, 3, 12}, {1, 1, 1, 1}, {1, 2, 1, 1}};
      for (const std::vector<int64_t>& lengths : rounds) {
        const double batches = Sample("attnserve_decode_batch_tokens_count" + label);
        const double batch_tokens = Sample("attnserve_decode_batch_tokens_sum" + label);
        server_->Block();
        std::vector<std::unique_ptr<PendingExtend>> calls;
        int64_t total = 0;
        for (size_t i = 0; i < sequences.size(); ++i) {
          calls.push_back(StartStep(sequences[i], RandomRows(lengths[i], width, rng),
                                    /*maps=*/i == 1));
          total += lengths[i];
        }
        ASSERT_TRUE(server_->WaitForQueueDepth(static_cast<int64_t>(calls.size())));
        server_->Release();
        for (size_t i = 0; i < calls.size(); ++i) {
          ExpectMatches(*calls[i], sequences[i], sequences[i].length(), tolerance);
          const v1::Timing& timing = calls[i]->response.timing();
          EXPECT_EQ(timing.batch_size(), 4);
          EXPECT_EQ(timing.batch_tokens(), total);
        }
        // One core call over the four steps (same model, mask, precision).
        EXPECT_EQ(Sample("attnserve_decode_batch_tokens_count" + label), batches + 1);
        EXPECT_EQ(Sample("attnserve_decode_batch_tokens_sum" + label),
                  batch_tokens + static_cast<double>(total));
      }
    }
  }
}

TEST_F(ExtendBatchingTest, AMemberWhoseCallerCancelledFailsNoBatchMate) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  Start(/*chunk_tokens=*/512);
  const int64_t width = gqa_.config.d_model;
  std::vector<Sequence> sequences;
  for (int i = 0; i < 3; ++i) sequences.push_back(Open(gqa_, v1::DATA_TYPE_FP32));
  server_->Block();
  std::vector<std::unique_ptr<PendingExtend>> calls;
  for (int i = 0; i < 3; ++i)
    calls.push_back(StartStep(sequences[i], RandomRows(5 + i, width, rng)));
  ASSERT_TRUE(server_->WaitForQueueDepth(3));
  calls[1]->context.TryCancel();
  calls[1]->done.WaitForNotification();
  EXPECT_EQ(calls[1]->status.error_code(), grpc::StatusCode::CANCELLED);
  server_->Release();
  for (int i : {0, 2}) {
    ExpectMatches(*calls[i], sequences[i], sequences[i].length(), 1e-5);
    // With the cancelled one when the server saw the cancel after the batch began.
    EXPECT_GE(calls[i]->response.timing().batch_size(), 2);
    EXPECT_LE(calls[i]->response.timing().batch_size(), 3);
  }
  // The cancelled step appended all of its tokens (it ran) or none.
  const int64_t length = Length(sequences[1].id);
  EXPECT_TRUE(length == 0 || length == 6) << length;
}

TEST_F(ExtendBatchingTest, ALongPrefillIsComputedInChunksAndMatchesTheReference) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> chunk_of(3, 40);
  for (const Layer* layer : {&mha_, &gqa_}) {
    for (v1::DataType kv : {v1::DATA_TYPE_FP32, v1::DATA_TYPE_BF16}) {
      const int64_t chunk = chunk_of(rng);
      SCOPED_TRACE(absl::StrCat(layer->model, " ", v1::DataType_Name(kv), " chunk ", chunk));
      const double tolerance = kv == v1::DATA_TYPE_BF16 ? 2e-2 : 1e-5;
      Start(chunk);
      const std::string label = absl::StrCat("{model=\"", layer->model, "\"}");
      Sequence sequence = Open(*layer, kv);
      // Lengths that are not multiples of the chunk, the last after a cached prefix.
      std::uniform_int_distribution<int64_t> extra(1, chunk - 1);
      for (int64_t n : {chunk * 3 + extra(rng), chunk + extra(rng)}) {
        const double batches = Sample("attnserve_decode_batch_tokens_count" + label);
        const std::vector<int64_t> chunks =
            ExpectedChunks(layer->config, chunk, sequence.length(), n);
        auto call = StartStep(sequence, RandomRows(n, layer->config.d_model, rng), /*maps=*/true);
        ExpectMatches(*call, sequence, sequence.length(), tolerance);
        // One core call a chunk.
        EXPECT_EQ(Sample("attnserve_decode_batch_tokens_count" + label),
                  batches + static_cast<double>(chunks.size()));
        EXPECT_EQ(call->response.timing().batch_tokens(), chunks.back());  // its last chunk's
      }
      // A retry of the chunked step gets its stored answer.
      const int64_t n = chunk + 1;
      const std::vector<float> rows = RandomRows(n, layer->config.d_model, rng);
      auto first = StartStep(sequence, rows);
      ExpectMatches(*first, sequence, sequence.length(), tolerance);
      grpc::ClientContext context;
      v1::ExtendResponse replayed;
      ASSERT_TRUE(server_->stub().Extend(&context, first->request, &replayed).ok());
      ASSERT_EQ(replayed.results_size(), 1);
      EXPECT_TRUE(replayed.results(0).replayed());
      EXPECT_EQ(replayed.results(0).output().raw_data(),
                first->response.results(0).output().raw_data());
      EXPECT_EQ(Length(sequence.id), sequence.length());
    }
  }
}

// Head statistics of a chunked prefill (alone, then with the maps, after a
// cached prefix) are the whole step's rows, each chunk's in its place: they
// match the reference's over the whole sequence; a replay carries none.
TEST_F(ExtendBatchingTest, HeadStatisticsOfAChunkedPrefillMatchTheReference) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> chunk_of(3, 40);
  for (const Layer* layer : {&mha_, &gqa_}) {
    for (v1::DataType kv : {v1::DATA_TYPE_FP32, v1::DATA_TYPE_BF16}) {
      const int64_t chunk = chunk_of(rng);
      SCOPED_TRACE(absl::StrCat(layer->model, " ", v1::DataType_Name(kv), " chunk ", chunk));
      const double tolerance = kv == v1::DATA_TYPE_BF16 ? 2e-2 : 1e-5;
      Start(chunk);
      const std::string label = absl::StrCat("{model=\"", layer->model, "\"}");
      Sequence sequence = Open(*layer, kv);
      std::uniform_int_distribution<int64_t> extra(1, chunk - 1);
      for (const bool maps : {false, true}) {
        const int64_t n = (maps ? chunk : chunk * 3) + extra(rng);
        const double batches = Sample("attnserve_decode_batch_tokens_count" + label);
        const size_t chunks = ExpectedChunks(layer->config, chunk, sequence.length(), n).size();
        auto call = StartStep(sequence, RandomRows(n, layer->config.d_model, rng), maps,
                              nullptr, absl::Seconds(300), /*stats=*/true);
        ExpectMatches(*call, sequence, sequence.length(), tolerance);
        // It was chunked: one core call a chunk.
        EXPECT_EQ(Sample("attnserve_decode_batch_tokens_count" + label),
                  batches + static_cast<double>(chunks));
        if (maps) {
          grpc::ClientContext context;
          v1::ExtendResponse replayed;
          ASSERT_TRUE(server_->stub().Extend(&context, call->request, &replayed).ok());
          ASSERT_EQ(replayed.results_size(), 1);
          EXPECT_TRUE(replayed.results(0).replayed());
          EXPECT_FALSE(replayed.results(0).has_head_statistics());
        }
      }
    }
  }
}

TEST_F(ExtendBatchingTest, ADecodeStepQueuedBehindAPrefillIsAnsweredBeforeItFinishes) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  // With and without batching: the decode step joins the prefill's first
  // chunk's batch, or runs alone between its chunks.
  for (int64_t max_batch_tokens : {int64_t{4096}, int64_t{0}}) {
    SCOPED_TRACE(absl::StrCat("max_batch_tokens ", max_batch_tokens));
    Start(/*chunk_tokens=*/16, max_batch_tokens);
    const int64_t width = gqa_.config.d_model;
    Sequence prefill = Open(gqa_, v1::DATA_TYPE_FP32), decode = Open(gqa_, v1::DATA_TYPE_FP32);
    ExpectMatches(*StartStep(decode, RandomRows(5, width, rng)), decode, 5, 1e-5);
    absl::Mutex mu;
    std::vector<std::string> finished;
    auto note = [&mu, &finished](std::string what) {
      return [&mu, &finished, what] {
        absl::MutexLock lock(&mu);
        finished.push_back(what);
      };
    };
    server_->Block();
    auto long_call =
        StartStep(prefill, RandomRows(16 * 20 + 3, width, rng), false, note("prefill"));
    ASSERT_TRUE(server_->WaitForQueueDepth(1));
    auto step = StartStep(decode, RandomRows(1, width, rng), false, note("decode"));
    ASSERT_TRUE(server_->WaitForQueueDepth(2));
    server_->Release();
    ExpectMatches(*long_call, prefill, prefill.length(), 1e-5);
    ExpectMatches(*step, decode, decode.length(), 1e-5);
    absl::MutexLock lock(&mu);
    const std::vector<std::string> order = {"decode", "prefill"};
    EXPECT_EQ(finished, order);
    server_.reset();
  }
}

TEST_F(ExtendBatchingTest, ACancelBetweenChunksLeavesTheLayerAsItWas) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  Start(/*chunk_tokens=*/8);
  const int64_t width = gqa_.config.d_model;
  const std::string label = absl::StrCat("{model=\"", gqa_.model, "\"}");
  Sequence sequence = Open(gqa_, v1::DATA_TYPE_FP32);
  ExpectMatches(*StartStep(sequence, RandomRows(3, width, rng)), sequence, 3, 1e-5);
  // Cancelled once its first chunk has run (the metric counts it), while
  // later chunks are left: the layer keeps its 3 tokens, or (when every
  // chunk ran first) all of them; never a part.
  const double batches = Sample("attnserve_decode_batch_tokens_count" + label);
  const int64_t n = 8 * 200 + 5;
  auto call = StartStep(sequence, RandomRows(n, width, rng));
  for (const absl::Time give_up = absl::Now() + absl::Seconds(60);
       Sample("attnserve_decode_batch_tokens_count" + label) <= batches;) {
    ASSERT_LT(absl::Now(), give_up) << "no chunk ran";
    absl::SleepFor(absl::Milliseconds(1));
  }
  call->context.TryCancel();
  call->done.WaitForNotification();
  // The layer's latest token can still be read once the server lets go of
  // the layer: the truncation drops the query a later chunk kept, and the
  // stopped call puts back the one before it.
  v1::LatestAttention latest;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(60);;) {
    grpc::ClientContext context;
    v1::LatestAttentionRequest request;
    request.set_session_id(sequence.id);
    const grpc::Status read = server_->stub().GetLatestAttention(&context, request, &latest);
    if (read.error_code() == grpc::StatusCode::ABORTED && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));  // the step still holds the layer
      continue;
    }
    ASSERT_TRUE(read.ok()) << read.error_message();
    break;
  }
  EXPECT_TRUE(latest.length() == 3 || latest.length() == 3 + n) << latest.length();
  const int64_t length = HeldOnceFree(sequence, rng);
  EXPECT_EQ(length, latest.length());
}

// A deadline that passes between chunks: DEADLINE_EXCEEDED, and the layer
// keeps what it held before the call (or, when every chunk ran in time, OK
// and all of it).
TEST_F(ExtendBatchingTest, ADeadlinePassingBetweenChunksLeavesTheLayerAsItWas) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  Start(/*chunk_tokens=*/8);
  const int64_t width = gqa_.config.d_model;
  Sequence sequence = Open(gqa_, v1::DATA_TYPE_FP32);
  ExpectMatches(*StartStep(sequence, RandomRows(3, width, rng)), sequence, 3, 1e-5);
  const int64_t n = 8 * 400 + 5;
  auto call = StartStep(sequence, RandomRows(n, width, rng), false, nullptr,
                        absl::Milliseconds(200));
  call->done.WaitForNotification();
  const int64_t length = HeldOnceFree(sequence, rng);
  if (call->status.ok()) {
    EXPECT_EQ(length, 3 + n);
  } else {
    EXPECT_EQ(call->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << call->status.error_message();
    EXPECT_EQ(length, 3);
  }
}

TEST_F(ExtendBatchingTest, AttendCallsBesideSessionsAreAnsweredAsBefore) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  Start(/*chunk_tokens=*/16);
  Sequence sequence = Open(mha_, v1::DATA_TYPE_FP32);
  server_->Block();
  auto prefill = StartStep(sequence, RandomRows(40, 768, rng));
  ASSERT_TRUE(server_->WaitForQueueDepth(1));
  const std::vector<float> states = RandomRows(6, 768, rng);
  v1::AttendRequest request;
  request.set_model("default");
  v1::Tensor* t = request.mutable_hidden_states();
  t->set_dtype(v1::DATA_TYPE_FP32);
  t->add_shape(1);
  t->add_shape(6);
  t->add_shape(768);
  t->set_raw_data(states.data(), states.size() * sizeof(float));
  auto attend = server_->Start(request);
  ASSERT_TRUE(server_->WaitForQueueDepth(2));
  server_->Release();
  attend->done.WaitForNotification();
  ASSERT_TRUE(attend->status.ok()) << attend->status.error_message();
  // Never in a batch with the Extend call.
  EXPECT_EQ(attend->response.timing().batch_size(), 1);
  EXPECT_EQ(attend->response.timing().batch_tokens(), 6);
  core::LayerInputs inputs;
  inputs.hidden_states = states;
  inputs.layout = *core::SequenceLayout::Padded(1, 6);
  const testing::ReferenceResult reference =
      testing::ReferenceLayer(mha_.config, mha_.weights, inputs);
  EXPECT_LT(
      testing::RelativeFrobeniusError(testing::Floats(attend->response.output()), reference.output),
      1e-5);
  ExpectMatches(*prefill, sequence, 40, 1e-5);
}

// With chunking a step may be longer than --max_seq_len (up to the
// session's limit); without, it is refused naming the field and the flags.
TEST_F(ExtendBatchingTest, AChunkedStepMayPassMaxSeqLenAnUnchunkedOneIsRefused) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  const int64_t width = gqa_.config.d_model;
  Start(/*chunk_tokens=*/64, 4096, /*max_seq_len=*/16);  // chunks of 16: it acts as the limit
  Sequence sequence = Open(gqa_, v1::DATA_TYPE_BF16);
  ExpectMatches(*StartStep(sequence, RandomRows(45, width, rng), /*maps=*/true), sequence, 45,
                2e-2);
  server_.reset();
  Start(/*chunk_tokens=*/0, 4096, /*max_seq_len=*/16);
  Sequence unchunked = Open(gqa_, v1::DATA_TYPE_FP32);
  auto refused = StartStep(unchunked, RandomRows(17, width, rng));
  refused->done.WaitForNotification();
  ASSERT_TRUE(refused->status.ok());
  const v1::ExtendResult& result = refused->response.results(0);
  EXPECT_EQ(result.code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(result.message().find("steps[0].hidden_states"), std::string::npos) << result.message();
  EXPECT_NE(result.message().find("--prefill_chunk_tokens=0"), std::string::npos)
      << result.message();
  EXPECT_EQ(Length(unchunked.id), 0);
  unchunked.tokens.clear();  // the refused rows were not appended
  ExpectMatches(*StartStep(unchunked, RandomRows(16, width, rng)), unchunked, 16, 1e-5);
}

// PrefillChunkTokens against a search over its stated rule (random
// layers, chunk sizes and keys), and two values computed by hand.
TEST(PrefillChunkTokensTest, EachChunkCostsAtMostTheFirstAndNoLessThanAnEighth) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(absl::StrCat("input seed ", seed));
  std::mt19937_64 rng(seed);
  // The built-in model (d_model 768, 12 heads: 1536 keys a token's
  // projections) at 512: at the start, the whole chunk; after 3584 keys,
  // 197 tokens: 197 x (3584 + 197 + 1536) = 1047449 <= 512 x (512 + 1536) =
  // 1048576 < 198 x 5318.
  EXPECT_EQ(PrefillChunkTokens(512, 0, 768, 768, 768), 512);
  EXPECT_EQ(PrefillChunkTokens(512, 3584, 768, 768, 768), 197);
  // Far out, an eighth.
  EXPECT_EQ(PrefillChunkTokens(512, 1 << 20, 768, 768, 768), 64);
  EXPECT_EQ(PrefillChunkTokens(3, 1 << 20, 768, 768, 768), 1);
  std::uniform_int_distribution<int64_t> chunk_of(1, 1024), keys_of(0, 20000), heads_of(1, 16),
      dim_of(4, 128);
  for (int i = 0; i < 300; ++i) {
    core::HeadConfig config;
    config.num_heads = heads_of(rng);
    config.num_kv_heads = std::uniform_int_distribution<int64_t>(1, config.num_heads)(rng);
    config.head_dim = dim_of(rng);
    config.d_model = std::uniform_int_distribution<int64_t>(16, 4096)(rng);
    const int64_t chunk = chunk_of(rng), keys = keys_of(rng);
    SCOPED_TRACE(absl::StrCat("chunk ", chunk, " keys ", keys, " d_model ", config.d_model,
                              " q ", config.q_width(), " kv ", config.kv_width()));
    const int64_t tokens = PrefillChunkTokens(chunk, keys, config.d_model, config.q_width(),
                                              config.kv_width());
    EXPECT_EQ(tokens, ExpectedChunks(config, chunk, keys, chunk + 1).front());
    EXPECT_GE(tokens, std::max<int64_t>(1, chunk / kMinChunkFraction));
    EXPECT_LE(tokens, chunk);
    EXPECT_LE(PrefillChunkTokens(chunk, keys + 1000, config.d_model, config.q_width(),
                                 config.kv_width()),
              tokens);
  }
}

}  // namespace
}  // namespace attnserve::server
