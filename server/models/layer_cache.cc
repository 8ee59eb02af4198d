#include "server/models/layer_cache.h"

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "core/attention_weights.h"

namespace attnserve::server {
namespace {

// Floats by their bits: two scales that print alike are still two layers.
std::string ConfigKey(const core::HeadConfig& c) {
  return absl::StrCat(c.d_model, "/", c.num_heads, "/", c.num_kv_heads, "/", c.head_dim, "/",
                      absl::bit_cast<uint32_t>(c.scale), "/", c.rotary.rotary_dim, "/",
                      absl::bit_cast<uint32_t>(c.rotary.theta), "/", c.context_dim);
}

}  // namespace

template <typename T, typename Make>
absl::StatusOr<std::shared_ptr<T>> LayerCache::GetOrMake(Entries<T>& entries,
                                                         const std::string& key, Make make) {
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    if (it->first == key) {
      entries.splice(entries.begin(), entries, it);
      return entries.front().second;
    }
  }
  absl::StatusOr<std::unique_ptr<T>> made = make();
  if (!made.ok()) return made.status();
  std::shared_ptr<T> value(std::move(*made));
  entries.emplace_front(key, value);
  while (static_cast<int>(entries.size()) > capacity_) entries.pop_back();
  return value;
}

absl::StatusOr<std::shared_ptr<core::AttentionLayer>> LayerCache::SeededLayer(
    const core::HeadConfig& config, uint64_t seed) {
  absl::MutexLock lock(&mu_);
  return GetOrMake(layers_, absl::StrCat(ConfigKey(config), "#", seed), [&] {
    return core::AttentionLayer::Create(config, core::SeededWeights(config, seed));
  });
}

absl::StatusOr<std::shared_ptr<core::AttentionCore>> LayerCache::Core(
    const core::HeadConfig& config) {
  absl::MutexLock lock(&mu_);
  return GetOrMake(cores_, ConfigKey(config), [&] { return core::AttentionCore::Create(config); });
}

}  // namespace attnserve::server
