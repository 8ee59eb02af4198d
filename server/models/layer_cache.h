#ifndef ATTNSERVE_SERVER_MODELS_LAYER_CACHE_H_
#define ATTNSERVE_SERVER_MODELS_LAYER_CACHE_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/attention_layer.h"
#include "core/head_config.h"

namespace attnserve::server {

// The layers requests build for themselves, kept so that a client repeating an
// ad-hoc configuration does not pay for weights and primitives every time:
// seeded ad-hoc layers by (config, seed), and attention cores (for projected
// requests) by config. Least recently used entries go first.
//
// Thread-safe.
class LayerCache {
 public:
  explicit LayerCache(int capacity = 4) : capacity_(capacity) {}
  LayerCache(const LayerCache&) = delete;
  LayerCache& operator=(const LayerCache&) = delete;

  // INVALID_ARGUMENT / INTERNAL as AttentionLayer::Create.
  absl::StatusOr<std::shared_ptr<core::AttentionLayer>> SeededLayer(const core::HeadConfig& config,
                                                                    uint64_t seed);
  absl::StatusOr<std::shared_ptr<core::AttentionCore>> Core(const core::HeadConfig& config);

 private:
  template <typename T>
  using Entries = std::list<std::pair<std::string, std::shared_ptr<T>>>;

  template <typename T, typename Make>
  absl::StatusOr<std::shared_ptr<T>> GetOrMake(Entries<T>& entries, const std::string& key,
                                               Make make) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int capacity_;
  absl::Mutex mu_;
  Entries<core::AttentionLayer> layers_ ABSL_GUARDED_BY(mu_);  // most recent first
  Entries<core::AttentionCore> cores_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_MODELS_LAYER_CACHE_H_
