// PlanAttend refuses what it must before anything is allocated from the
// request's sizes. The wire-level table of bad inputs is in
// attention_service_test.cc; here we watch the allocator.
#include "server/attend_plan.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

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
    absl::StatusOr<AttendPlan> plan = PlanAttend(request, registry_, limits, int64_t{1} << 40);
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
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted) << plan.status();
  EXPECT_NE(plan.status().message().find("attention_maps"), std::string::npos) << plan.status();
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
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted) << plan.status();
  for (const char* hint : {"--max_request_bytes", "attention_maps.query_rows",
                           "attention_maps.head_statistics", "attention_maps.heads"}) {
    EXPECT_NE(plan.status().message().find(hint), std::string::npos) << hint << ": " << plan.status();
  }
  EXPECT_LT(g_largest_allocation.load(), size_t{4096});

  // Within the default budget it plans, and knows its memory: at least its
  // output and maps as FP32.
  absl::StatusOr<AttendPlan> accepted = PlanAttend(request, registry_, RequestLimits{}, 1 << 30);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_GE(accepted->memory_bytes, (seq * 768 + seq * seq) * 4);
  EXPECT_LE(accepted->memory_bytes, RequestLimits{}.max_request_bytes);
}

TEST_F(AttendPlanTest, AcceptedPlanKnowsEverySize) {
  v1::AttendRequest request = Bomb(2, 5, 2 * 5 * 768 * 4, v1::ATTENTION_MAP_MODE_PER_HEAD);
  absl::StatusOr<AttendPlan> plan = PlanAttend(request, registry_, RequestLimits{}, 1 << 30);
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
