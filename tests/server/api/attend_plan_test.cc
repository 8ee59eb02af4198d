// PlanAttend refuses what it must before anything is allocated from the
// request's sizes. The wire-level table of bad inputs is in
// attention_service_test.cc; here we watch the allocator.
#include "server/api/attend_plan.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace {

// The largest single allocation made while `g_tracking` is set.
std::atomic<bool> g_tracking{false};
std::atomic<size_t> g_largest_allocation{0};

}  // namespace

// Replaces the global allocator pair: GCC cannot see that new and delete here
// agree, hence the pragma.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(size_t size) {
  if (g_tracking.load(std::memory_order_relaxed)) {
    size_t seen = g_largest_allocation.load();
    while (size > seen && !g_largest_allocation.compare_exchange_weak(seen, size)) {
    }
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace attnserve::server {
namespace {

class AttendPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = MakeBuiltinModel(/*seed=*/0);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE(registry_.Add(*model).ok());
  }

  // A request whose shape claims huge sizes; it carries `bytes` of data.
  static v1::AttendRequest Bomb(int64_t batch, int64_t seq, int64_t bytes, v1::AttentionMapMode maps) {
    v1::AttendRequest request;
    request.set_model("default");
    request.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_FP32);
    for (int64_t d : {batch, seq, int64_t{768}}) request.mutable_hidden_states()->add_shape(d);
    request.mutable_hidden_states()->mutable_raw_data()->assign(bytes, '\0');
    request.mutable_attention_maps()->set_mode(maps);
    return request;
  }

  absl::StatusOr<AttendPlan> PlanWatchingAllocations(const v1::AttendRequest& request,
                                                     const RequestLimits& limits) {
    g_largest_allocation = 0;
    g_tracking = true;
    absl::StatusOr<AttendPlan> plan =
        PlanAttend(request, registry_, limits, int64_t{1} << 40, core::BlockKernels::kAuto);
    g_tracking = false;
    return plan;
  }

  ModelRegistry registry_;
};

TEST_F(AttendPlanTest, MapBombIsRefusedWithoutAllocatingFromItsSizes) {
  // seq 100k with per-head maps: 12 x 10^10 x 4 bytes = 480 GB of maps. The
  // data matches the shape so only the limits can stop it.
  RequestLimits limits;
  limits.max_seq_len = 1 << 20;
  const int64_t seq = 100000;
  v1::AttendRequest request = Bomb(1, seq, seq * 768 * 4, v1::ATTENTION_MAP_MODE_PER_HEAD);
  absl::StatusOr<AttendPlan> plan = PlanWatchingAllocations(request, limits);
  // A fixed limit of the server: never load.
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(plan.status().message().find("attention_maps"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find("(--max_attention_map_bytes)"), std::string::npos)
      << plan.status();
  EXPECT_LT(g_largest_allocation.load(), size_t{4096});
}

TEST_F(AttendPlanTest, ShapeWhoseProductOverflowsIsInvalidWithoutAllocating) {
  v1::AttendRequest request = Bomb(int64_t{1} << 40, int64_t{1} << 40, 16, v1::ATTENTION_MAP_MODE_NONE);
  absl::StatusOr<AttendPlan> plan = PlanWatchingAllocations(request, RequestLimits{});
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(plan.status().message().find("hidden_states.shape"), std::string::npos);
  EXPECT_LT(g_largest_allocation.load(), size_t{4096});
}

TEST_F(AttendPlanTest, HugeShapeWithoutItsDataIsInvalidBeforeAnySizeIsUsed) {
  // Limits raised to the top: batch 2^20 x 12 heads x seq^2 (2^40) maps
  // would overflow int64.
  RequestLimits limits;
  limits.max_batch = int64_t{1} << 20;
  limits.max_seq_len = int64_t{1} << 20;
  limits.max_attention_map_bytes = int64_t{1} << 40;
  v1::AttendRequest request;
  request.set_model("default");
  for (int64_t d : {int64_t{1} << 20, int64_t{1} << 20, int64_t{768}}) {
    request.mutable_hidden_states()->add_shape(d);
  }
  // Data size cannot match such a shape, so validation stops at raw_data
  // first: INVALID_ARGUMENT, never an overflowed size.
  request.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_FP32);
  request.mutable_hidden_states()->set_raw_data("x");
  request.mutable_attention_maps()->set_mode(v1::ATTENTION_MAP_MODE_PER_HEAD);
  absl::StatusOr<AttendPlan> plan = PlanWatchingAllocations(request, limits);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_LT(g_largest_allocation.load(), size_t{4096});
}

TEST_F(AttendPlanTest, RequestOverTheMemoryBudgetIsRefusedBeforeAllocationAndSaysWhatToAskFor) {
  // seq 2048 with mean maps: maps 16 MiB, scores a few hundred MiB; every
  // other limit passes, the per-request memory budget (64 MiB) does not.
  RequestLimits limits;
  limits.max_request_bytes = int64_t{64} << 20;
  const int64_t seq = 2048;
  v1::AttendRequest request = Bomb(1, seq, seq * 768 * 4, v1::ATTENTION_MAP_MODE_MEAN);
  absl::StatusOr<AttendPlan> plan = PlanWatchingAllocations(request, limits);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  for (const char* hint : {"--max_request_bytes", "attention_maps.query_rows",
                           "attention_maps.head_statistics", "attention_maps.heads"}) {
    EXPECT_NE(plan.status().message().find(hint), std::string::npos) << hint << ": " << plan.status();
  }
  EXPECT_LT(g_largest_allocation.load(), size_t{4096});

  // Within the default budget it plans, and knows its memory: at least its
  // output and maps as FP32.
  absl::StatusOr<AttendPlan> accepted =
      PlanAttend(request, registry_, RequestLimits{}, 1 << 30, core::BlockKernels::kAuto);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_GE(accepted->memory_bytes, (seq * 768 + seq * seq) * 4);
  EXPECT_LE(accepted->memory_bytes, RequestLimits{}.max_request_bytes);
}

// Each fixed limit, just over: INVALID_ARGUMENT (retrying cannot help; load is
// RESOURCE_EXHAUSTED, and PlanAttend never answers it), naming the field, the
// flag and what to send instead; just at the limit the request plans.
TEST_F(AttendPlanTest, EveryFixedLimitIsInvalidArgumentNamingItsFlagAndIsInclusive) {
  struct Case {
    const char* name;
    int64_t batch, seq;
    v1::AttentionMapMode maps;
    std::function<void(RequestLimits&, int64_t& max_response_bytes, int64_t over)> limit;
    const char* field;
    const char* flag;
    const char* instead;
  };
  // A [2, 8] request with mean maps: 2 x 8 x 8 x 4 = 512 map bytes; its other
  // sizes come from an accepted plan.
  const v1::AttendRequest probe = Bomb(2, 8, 2 * 8 * 768 * 4, v1::ATTENTION_MAP_MODE_MEAN);
  absl::StatusOr<AttendPlan> accepted =
      PlanAttend(probe, registry_, RequestLimits{}, 1 << 30, core::BlockKernels::kAuto);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  const int64_t memory = accepted->memory_bytes;
  const int64_t response = (2 * 8 * 768 + 2 * 8 * 8) * 4 + 4096;  // output, maps, framing
  const std::vector<Case> cases = {
      {"batch", 2, 8, v1::ATTENTION_MAP_MODE_MEAN,
       [](RequestLimits& l, int64_t&, int64_t over) { l.max_batch = 2 - over; },
       "hidden_states.shape[0] (batch)", "--max_batch", "split the batch"},
      {"seq", 2, 8, v1::ATTENTION_MAP_MODE_MEAN,
       [](RequestLimits& l, int64_t&, int64_t over) { l.max_seq_len = 8 - over; },
       "hidden_states.shape[1] (seq)", "--max_seq_len", "split or truncate"},
      {"maps", 2, 8, v1::ATTENTION_MAP_MODE_MEAN,
       [](RequestLimits& l, int64_t&, int64_t over) { l.max_attention_map_bytes = 512 - over; },
       "attention_maps", "--max_attention_map_bytes", "head_statistics"},
      {"response", 2, 8, v1::ATTENTION_MAP_MODE_MEAN,
       [response](RequestLimits&, int64_t& m, int64_t over) { m = response - over; },
       "response", "--max_send_message_bytes", "BF16 output"},
      {"request memory", 2, 8, v1::ATTENTION_MAP_MODE_MEAN,
       [memory](RequestLimits& l, int64_t&, int64_t over) {
         // The estimate is in double and truncated: a byte of slack.
         l.max_request_bytes = over ? memory - 1 : memory + 1;
       },
       "request", "--max_request_bytes", "fewer or shorter sequences"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const v1::AttendRequest request = Bomb(c.batch, c.seq, c.batch * c.seq * 768 * 4, c.maps);
    for (int64_t over : {0, 1}) {
      RequestLimits limits;
      int64_t max_response_bytes = int64_t{1} << 30;
      c.limit(limits, max_response_bytes, over);
      absl::StatusOr<AttendPlan> plan =
          PlanAttend(request, registry_, limits, max_response_bytes, core::BlockKernels::kAuto);
      if (over == 0) {
        EXPECT_TRUE(plan.ok()) << plan.status();
        continue;
      }
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
      for (const std::string& part : {std::string(c.field), absl::StrCat("(", c.flag, ")"),
                                      std::string(c.instead)}) {
        EXPECT_NE(plan.status().message().find(part), std::string::npos)
            << "'" << plan.status().message() << "' does not say " << part;
      }
    }
  }

  // Compute scratch and ad-hoc weights, on an ad-hoc layer: a [1, 4] request
  // of a d_model 64 layer with 4 heads, and statistics (materialized scores).
  v1::AttendRequest adhoc;
  v1::HeadConfig* head = adhoc.mutable_layer()->mutable_head_config();
  head->set_d_model(64);
  head->set_num_heads(4);
  adhoc.mutable_layer()->set_seed(5);
  adhoc.mutable_hidden_states()->set_dtype(v1::DATA_TYPE_FP32);
  for (int64_t d : {1, 4, 64}) adhoc.mutable_hidden_states()->add_shape(d);
  adhoc.mutable_hidden_states()->mutable_raw_data()->assign(4 * 64 * 4, '\0');
  const int64_t weight_bytes = (4 * 64 * 64 + 4 * 64) * 4;  // w_q, w_k, w_v, w_o and biases
  RequestLimits limits;
  limits.max_adhoc_weight_bytes = weight_bytes;
  ASSERT_TRUE(PlanAttend(adhoc, registry_, limits, 1 << 30, core::BlockKernels::kAuto).ok());
  limits.max_adhoc_weight_bytes = weight_bytes - 1;
  absl::StatusOr<AttendPlan> plan =
      PlanAttend(adhoc, registry_, limits, 1 << 30, core::BlockKernels::kAuto);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(plan.status().message().find("(--max_adhoc_weight_bytes)"), std::string::npos)
      << plan.status();
  limits = RequestLimits{};
  limits.max_scratch_bytes = 1;  // below any request's scratch
  plan = PlanAttend(adhoc, registry_, limits, 1 << 30, core::BlockKernels::kAuto);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_NE(plan.status().message().find("(--max_scratch_bytes)"), std::string::npos)
      << plan.status();
}

TEST_F(AttendPlanTest, AcceptedPlanKnowsEverySize) {
  v1::AttendRequest request = Bomb(2, 5, 2 * 5 * 768 * 4, v1::ATTENTION_MAP_MODE_PER_HEAD);
  absl::StatusOr<AttendPlan> plan =
      PlanAttend(request, registry_, RequestLimits{}, 1 << 30, core::BlockKernels::kAuto);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->queries.batch(), 2);
  EXPECT_EQ(plan->queries.max_length(), 5);
  EXPECT_EQ(plan->output_elements, 2 * 5 * 768);
  EXPECT_EQ(plan->map_elements, 2 * 12 * 5 * 5);
  EXPECT_EQ(plan->map_shape, (std::vector<int64_t>{2, 12, 5, 5}));
  EXPECT_EQ(plan->maps.mode, core::AttentionMapMode::kPerHead);
}

}  // namespace
}  // namespace attnserve::server
