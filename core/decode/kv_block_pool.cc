#include "core/decode/kv_block_pool.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/checked_math.h"
#include "core/decode/kv_block_slabs.h"
#include "core/decode/kv_layout.h"
#include "core/status_macros.h"

namespace attnserve::core {
namespace {

// A handle that is not of a block in use is a broken invariant of the caller
// that would otherwise hand one sequence's keys to another: stop the process.
[[noreturn]] void DieOnBadHandle(const char* operation, int32_t id) {
  std::fprintf(stderr, "KvBlockPool::%s: block %d is not in use\n", operation,
               static_cast<int>(id));
  std::abort();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvBlockPool>> KvBlockPool::Create(
    const KvBlockPoolOptions& options) {
  if (options.budget_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_block_pool.budget_bytes: must be positive, got ", options.budget_bytes));
  }
  if (options.block_tokens < 1 || options.block_tokens > kMaxKvBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("kv_block_pool.block_tokens: must be in [1, ",
                                                   kMaxKvBlockTokens, "], got ",
                                                   options.block_tokens));
  }
  return std::unique_ptr<KvBlockPool>(new KvBlockPool(options));
}

KvBlockPool::KvBlockPool(const KvBlockPoolOptions& options) : options_(options) {}

// Every block's memory goes with its layout's slabs.
KvBlockPool::~KvBlockPool() = default;

void KvBlockPool::FreeAll(absl::Span<const BlockMemory> memory) {
  for (const BlockMemory& block : memory) block.slabs->Free(block.data);
}

absl::StatusOr<KvBlockHandle> KvBlockPool::Allocate(const KvLayout& layout) {
  std::vector<KvBlockHandle> blocks;
  ATTNSERVE_RETURN_IF_ERROR(AllocateBlocks(layout, 1, blocks));
  return blocks.front();
}

absl::Status KvBlockPool::AllocateBlocks(const KvLayout& layout, int64_t count,
                                         std::vector<KvBlockHandle>& blocks) {
  ATTNSERVE_RETURN_IF_ERROR(ValidateKvLayout(layout));
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("count: must be >= 0, got ", count));
  }
  if (count == 0) return absl::OkStatus();
  const int64_t block_bytes = KvBlockBytes(layout, options_.block_tokens);
  const size_t first = blocks.size();
  std::vector<BlockMemory> to_free;
  int layout_index = 0;
  internal::KvBlockSlabs* slabs = nullptr;
  int64_t fresh = 0;
  int64_t fresh_bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    layout_index = LayoutIndexLocked(layout);
    slabs = free_lists_[layout_index].slabs.get();
    std::vector<int32_t>& free_ids = free_lists_[layout_index].free_ids;
    fresh = count - std::min<int64_t>(count, static_cast<int64_t>(free_ids.size()));
    const std::optional<int64_t> bytes = CheckedMul(fresh, block_bytes);
    // Block ids are int32: records beyond that are refused like bytes.
    const int64_t ids_left = std::numeric_limits<int32_t>::max() -
                             static_cast<int64_t>(records_.size() - vacant_ids_.size());
    if (!bytes || fresh > ids_left || !MakeRoomLocked(*bytes, layout_index, to_free)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "kv_block_pool: ", count, " blocks of ", block_bytes, " bytes (", fresh,
          " not free-listed) would pass the budget of ", options_.budget_bytes, " bytes (",
          bytes_held_, " held, ", bytes_in_use_, " in use)"));
    }
    fresh_bytes = *bytes;
    bytes_held_ += fresh_bytes;  // reserved while the memory is allocated
    for (int64_t i = fresh; i < count; ++i) {
      const int32_t id = PopLowestFreeLocked(free_lists_[layout_index]);
      records_[id].references = 1;
      blocks.push_back(KvBlockHandle{id, records_[id].data});
    }
    const int64_t reused = count - fresh;
    free_blocks_ -= reused;
    blocks_in_use_ += reused;
    bytes_in_use_ += reused * block_bytes;
  }
  FreeAll(to_free);

  std::vector<BlockMemory> memory;
  memory.reserve(static_cast<size_t>(fresh));
  for (int64_t i = 0; i < fresh; ++i) {
    std::byte* data = slabs->Allocate();
    if (data == nullptr) {
      FreeAll(memory);
      const std::vector<KvBlockHandle> reused(blocks.begin() + first, blocks.end());
      blocks.resize(first);
      Release(reused);
      absl::MutexLock lock(&mu_);
      bytes_held_ -= fresh_bytes;
      return absl::ResourceExhaustedError(absl::StrCat(
          "kv_block_pool: the system has no memory for a block of ", block_bytes, " bytes"));
    }
    memory.push_back(BlockMemory{slabs, data});
  }
  absl::MutexLock lock(&mu_);
  for (const BlockMemory& block : memory) {
    blocks.push_back(AddRecordLocked(block.data, layout_index));
  }
  blocks_in_use_ += fresh;
  bytes_in_use_ += fresh_bytes;
  return absl::OkStatus();
}

void KvBlockPool::Share(absl::Span<const KvBlockHandle> blocks) {
  absl::MutexLock lock(&mu_);
  for (const KvBlockHandle& block : blocks) {
    if (block.id < 0 || block.id >= static_cast<int32_t>(records_.size()) ||
        records_[block.id].references < 1) {
      DieOnBadHandle("Share", block.id);
    }
    if (++records_[block.id].references == 2) ++shared_blocks_;
  }
}

void KvBlockPool::Release(absl::Span<const KvBlockHandle> blocks) {
  absl::MutexLock lock(&mu_);
  for (const KvBlockHandle& block : blocks) {
    if (block.id < 0 || block.id >= static_cast<int32_t>(records_.size()) ||
        records_[block.id].references < 1) {
      DieOnBadHandle("Release", block.id);
    }
    Record& record = records_[block.id];
    if (--record.references == 1) --shared_blocks_;
    if (record.references > 0) continue;
    LayoutFreeList& list = free_lists_[record.layout_index];
    PushFreeLocked(list, block.id);
    bytes_in_use_ -= list.block_bytes;
    --blocks_in_use_;
    ++free_blocks_;
  }
}

int KvBlockPool::ReferenceCount(const KvBlockHandle& block) const {
  absl::MutexLock lock(&mu_);
  if (block.id < 0 || block.id >= static_cast<int32_t>(records_.size()) ||
      records_[block.id].references < 1) {
    DieOnBadHandle("ReferenceCount", block.id);
  }
  return records_[block.id].references;
}

bool KvBlockPool::AnyUnshared(absl::Span<const KvBlockHandle> blocks) const {
  absl::MutexLock lock(&mu_);
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    if (it->id < 0 || it->id >= static_cast<int32_t>(records_.size()) ||
        records_[it->id].references < 1) {
      DieOnBadHandle("AnyUnshared", it->id);
    }
    if (records_[it->id].references == 1) return true;
  }
  return false;
}

int64_t KvBlockPool::Trim() {
  std::vector<BlockMemory> to_free;
  int64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    for (LayoutFreeList& list : free_lists_) {
      for (int32_t id : list.free_ids) to_free.push_back(RemoveFreeBlockLocked(id));
      freed += static_cast<int64_t>(list.free_ids.size()) * list.block_bytes;
      list.free_ids.clear();
    }
  }
  FreeAll(to_free);
  return freed;
}

KvBlockPoolStats KvBlockPool::stats() const {
  absl::MutexLock lock(&mu_);
  return KvBlockPoolStats{bytes_in_use_, bytes_held_, blocks_in_use_, free_blocks_,
                          shared_blocks_};
}

int KvBlockPool::LayoutIndexLocked(const KvLayout& layout) {
  for (size_t i = 0; i < free_lists_.size(); ++i) {
    if (free_lists_[i].layout == layout) return static_cast<int>(i);
  }
  const int64_t block_bytes = KvBlockBytes(layout, options_.block_tokens);
  free_lists_.push_back(LayoutFreeList{layout, block_bytes, {},
                                       std::make_unique<internal::KvBlockSlabs>(block_bytes)});
  return static_cast<int>(free_lists_.size()) - 1;
}

bool KvBlockPool::MakeRoomLocked(int64_t bytes, int keep, std::vector<BlockMemory>& to_free) {
  const int64_t room = options_.budget_bytes - bytes_held_;
  if (bytes <= room) return true;
  int64_t reclaimable = 0;
  for (size_t i = 0; i < free_lists_.size(); ++i) {
    if (static_cast<int>(i) == keep) continue;
    reclaimable += static_cast<int64_t>(free_lists_[i].free_ids.size()) * free_lists_[i].block_bytes;
  }
  if (bytes > room + reclaimable) return false;
  for (size_t i = 0; i < free_lists_.size() && bytes > options_.budget_bytes - bytes_held_; ++i) {
    if (static_cast<int>(i) == keep) continue;
    std::vector<int32_t>& free_ids = free_lists_[i].free_ids;
    while (!free_ids.empty() && bytes > options_.budget_bytes - bytes_held_) {
      to_free.push_back(RemoveFreeBlockLocked(free_ids.back()));
      free_ids.pop_back();
    }
  }
  return true;
}

auto KvBlockPool::LowestOnTopLocked() const {
  return [this](int32_t a, int32_t b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return std::greater<const std::byte*>()(records_[a].data, records_[b].data);
  };
}

void KvBlockPool::PushFreeLocked(LayoutFreeList& list, int32_t id) {
  list.free_ids.push_back(id);
  std::push_heap(list.free_ids.begin(), list.free_ids.end(), LowestOnTopLocked());
}

int32_t KvBlockPool::PopLowestFreeLocked(LayoutFreeList& list) {
  std::pop_heap(list.free_ids.begin(), list.free_ids.end(), LowestOnTopLocked());
  const int32_t id = list.free_ids.back();
  list.free_ids.pop_back();
  return id;
}

KvBlockHandle KvBlockPool::AddRecordLocked(std::byte* data, int layout_index) {
  int32_t id = 0;
  if (!vacant_ids_.empty()) {
    id = vacant_ids_.back();
    vacant_ids_.pop_back();
  } else {
    id = static_cast<int32_t>(records_.size());
    records_.emplace_back();
  }
  records_[id] = Record{data, 1, layout_index};
  return KvBlockHandle{id, data};
}

KvBlockPool::BlockMemory KvBlockPool::RemoveFreeBlockLocked(int32_t id) {
  Record& record = records_[id];
  const BlockMemory memory{free_lists_[record.layout_index].slabs.get(), record.data};
  bytes_held_ -= free_lists_[record.layout_index].block_bytes;
  --free_blocks_;
  record = Record{};
  vacant_ids_.push_back(id);
  return memory;
}

}  // namespace attnserve::core
