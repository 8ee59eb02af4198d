#include "core/decode/layer_kv_cache.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/checked_math.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "core/status_macros.h"

namespace attnserve::core {
namespace {

// OK when `rows` holds n tokens of `row` floats each; INVALID_ARGUMENT naming
// `field` otherwise.
absl::Status CheckRows(absl::string_view field, absl::Span<const float> rows, int64_t n,
                       int64_t row) {
  const std::optional<int64_t> expected = CheckedMul(n, row);
  if (!expected || static_cast<int64_t>(rows.size()) != *expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": has ", rows.size(), " floats, expected n * num_kv_heads * head_dim = ", n,
        " * ", row));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LayerKvCache>> LayerKvCache::Create(KvBlockPool* pool,
                                                                   const KvLayout& layout) {
  if (pool == nullptr) return absl::InvalidArgumentError("pool: must not be null");
  ATTNSERVE_RETURN_IF_ERROR(ValidateKvLayout(layout));
  return std::unique_ptr<LayerKvCache>(new LayerKvCache(pool, layout));
}

LayerKvCache::LayerKvCache(KvBlockPool* pool, const KvLayout& layout)
    : pool_(pool),
      layout_(layout),
      block_tokens_(pool->block_tokens()),
      head_rows_bytes_(int64_t{block_tokens_} * layout.head_dim * layout.element_bytes()) {}

LayerKvCache::~LayerKvCache() {
  pool_->Release(blocks_);
  pool_->Release(ahead_);
}

absl::Status LayerKvCache::Append(absl::Span<const float> k, absl::Span<const float> v,
                                  int64_t n, BlocksAhead ahead) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("n: must be >= 0, got ", n));
  const int64_t row = int64_t{layout_.num_kv_heads} * layout_.head_dim;
  ATTNSERVE_RETURN_IF_ERROR(CheckRows("k", k, n, row));
  ATTNSERVE_RETURN_IF_ERROR(CheckRows("v", v, n, row));
  if (n == 0) return absl::OkStatus();

  const int64_t new_length = length_ + n;
  const bool copy_last = CopiesLastBlock();
  const int64_t needed = BlocksNeeded(n, copy_last);
  const int64_t fresh = needed - std::min(needed, static_cast<int64_t>(ahead_.size()));
  if (fresh > 0) {
    std::vector<KvBlockHandle> taken;
    const int64_t run = RunFor(fresh, ahead);
    absl::Status status = pool_->AllocateBlocks(layout_, run, taken);
    if (absl::IsResourceExhausted(status) && run > fresh) {
      status = pool_->AllocateBlocks(layout_, fresh, taken);  // no room to run ahead
    }
    ATTNSERVE_RETURN_IF_ERROR(status);
    taken_ += static_cast<int64_t>(taken.size());
    ahead_.insert(ahead_.end(), taken.begin(), taken.end());
  }

  // The blocks ahead, in order, become the copy of the last block (if it is
  // shared) and the new blocks of the table.
  const auto used = ahead_.begin() + needed;
  auto next = ahead_.begin();
  if (copy_last) {
    CopyRows(blocks_.back(), *next, length_ % block_tokens_);
    pool_->Release(blocks_.back());
    blocks_.back() = *next++;
  }
  blocks_.insert(blocks_.end(), next, used);
  ahead_.erase(ahead_.begin(), used);
  WriteRows(k.data(), v.data(), n);
  length_ = new_length;
  return absl::OkStatus();
}

bool LayerKvCache::CopiesLastBlock() const {
  // Its count cannot rise concurrently (only a cache holding it can share it,
  // and this one is ours); if it falls meanwhile, the copy is merely spare.
  return length_ % block_tokens_ > 0 && pool_->ReferenceCount(blocks_.back()) > 1;
}

int64_t LayerKvCache::BlocksNeeded(int64_t n, bool copy_last) const {
  const int64_t blocks_needed = (length_ + n + block_tokens_ - 1) / block_tokens_;
  return blocks_needed - static_cast<int64_t>(blocks_.size()) + (copy_last ? 1 : 0);
}

int64_t LayerKvCache::RunFor(int64_t fresh, BlocksAhead ahead) const {
  if (fresh != 1 || ahead == BlocksAhead::kNone) return fresh;
  return std::clamp<int64_t>(taken_ / 4, 1, kMaxRunBlocks);
}

int64_t LayerKvCache::BlocksToTake(int64_t n, BlocksAhead ahead) const {
  if (n <= 0) return 0;
  const int64_t needed = BlocksNeeded(n, CopiesLastBlock());
  const int64_t fresh = needed - std::min(needed, static_cast<int64_t>(ahead_.size()));
  return fresh > 0 ? RunFor(fresh, ahead) : 0;
}

absl::Status LayerKvCache::Truncate(int64_t length) {
  if (length < 0 || length > length_) {
    return absl::InvalidArgumentError(
        absl::StrCat("length: must be in [0, ", length_, "], got ", length));
  }
  const size_t keep = static_cast<size_t>((length + block_tokens_ - 1) / block_tokens_);
  pool_->Release(absl::MakeConstSpan(blocks_).subspan(keep));
  blocks_.resize(keep);
  pool_->Release(ahead_);
  ahead_.clear();
  length_ = length;
  if (length < latest_query_length_) {
    latest_query_.clear();
    latest_query_length_ = 0;
  }
  return absl::OkStatus();
}

void LayerKvCache::SetLatestQuery(absl::Span<const float> query) {
  if (query.empty() || length_ == 0) return;
  latest_query_.assign(query.begin(), query.end());
  latest_query_length_ = length_;
}

std::unique_ptr<LayerKvCache> LayerKvCache::Fork() const {
  pool_->Share(blocks_);
  std::unique_ptr<LayerKvCache> child(new LayerKvCache(pool_, layout_));
  child->blocks_ = blocks_;
  child->length_ = length_;
  child->latest_query_ = latest_query_;
  child->latest_query_length_ = latest_query_length_;
  return child;
}

void LayerKvCache::CopyRows(const KvBlockHandle& from, const KvBlockHandle& to,
                            int64_t tokens) const {
  const size_t bytes = static_cast<size_t>(tokens * layout_.head_dim * layout_.element_bytes());
  // K and V of every head: 2 * num_kv_heads runs of rows, head_rows_bytes_ apart.
  for (int64_t part = 0; part < 2 * int64_t{layout_.num_kv_heads}; ++part) {
    std::memcpy(to.data + part * head_rows_bytes_, from.data + part * head_rows_bytes_, bytes);
  }
}

void LayerKvCache::WriteRows(const float* k, const float* v, int64_t n) {
  const int64_t heads = layout_.num_kv_heads;
  const int64_t head_dim = layout_.head_dim;
  const int64_t element_bytes = layout_.element_bytes();
  const bool bf16 = layout_.precision == KvPrecision::kBf16;
  auto write_token = [&](int64_t t) {
    const int64_t position = length_ + t;
    const int64_t block = position / block_tokens_;
    const int64_t slot_offset = (position % block_tokens_) * head_dim * element_bytes;
    for (int64_t g = 0; g < heads; ++g) {
      const float* from_k = k + (t * heads + g) * head_dim;
      const float* from_v = v + (t * heads + g) * head_dim;
      std::byte* const data = blocks_[static_cast<size_t>(block)].data + slot_offset;
      std::byte* to_k = data + g * head_rows_bytes_;
      std::byte* to_v = data + (heads + g) * head_rows_bytes_;
      if (bf16) {
        FloatsToBf16(from_k, head_dim, reinterpret_cast<Bf16*>(to_k));
        FloatsToBf16(from_v, head_dim, reinterpret_cast<Bf16*>(to_v));
      } else {
        std::memcpy(to_k, from_k, static_cast<size_t>(head_dim) * sizeof(float));
        std::memcpy(to_v, from_v, static_cast<size_t>(head_dim) * sizeof(float));
      }
    }
  };
  // A prefill chunk's rows on the OpenMP threads: the first write to a fresh
  // block's pages is most of their cost on the virtual machine measured, and
  // it scales with threads. A decode step's few rows on this one, outside any
  // parallel region (even one that an `if` keeps to one thread costs a few
  // microseconds an append: BM_Append measured 2-5x the time a row).
  if (n * layout_.token_bytes() >= kParallelWriteBytes) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t) write_token(t);
  } else {
    for (int64_t t = 0; t < n; ++t) write_token(t);
  }
}

}  // namespace attnserve::core
