#ifndef ATTNSERVE_SERVER_SESSIONS_ENDED_SESSIONS_H_
#define ATTNSERVE_SERVER_SESSIONS_ENDED_SESSIONS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// Why a session ended (for its owner's NOT_FOUND).
enum class SessionEnd : uint8_t { kExpired, kEvictedForMemory, kEvictedForSessions, kClosed };

// A session id in binary: the 16 random bytes its 32 hex digits spell.
using SessionKey = std::array<uint8_t, 16>;

// The key of a session id: 32 lowercase hex digits (as SessionManager issues
// them), or nullopt for anything else.
std::optional<SessionKey> ParseSessionId(absl::string_view id);

// The last `capacity` ended sessions: each one's id, why it ended and its
// owner, so that the owner's NOT_FOUND can say why.
//
// Its memory, but for the owners' names, is taken at construction and never
// grows, so a server's RSS does not climb while it fills: a ring of 24-byte
// records (the binary id, an owner number, why) overwritten oldest first, and
// an index of ring slots sized for `capacity` records (its own slots are
// 4-byte slot numbers; a lookup hashes the record's id). Owners are kept once
// each while a record names them (the distinct callers among the records: ""
// with authentication off, one per token of --auth_tokens_file with it).
//
// Not thread-safe (SessionManager guards it); neither copyable nor movable
// (the index's hash and equality point into the ring).
class EndedSessions {
 public:
  explicit EndedSessions(size_t capacity);
  EndedSessions(const EndedSessions&) = delete;
  EndedSessions& operator=(const EndedSessions&) = delete;

  // Remembers that session `id` of `owner` ended for `why`, forgetting the
  // oldest record when all `capacity` are taken. `id` must not be remembered
  // already (ids are never reused).
  void Remember(const SessionKey& id, absl::string_view owner, SessionEnd why);
  // Why session `id` ended, when it is remembered and `owner` is its owner;
  // nullopt otherwise (why a session ended is its owner's to know).
  std::optional<SessionEnd> Find(const SessionKey& id, absl::string_view owner) const;
  // Whether `id` is remembered, whoever its owner.
  bool Contains(const SessionKey& id) const;

  size_t size() const { return size_; }
  size_t capacity() const { return records_.size(); }
  // Distinct owners the records name.
  size_t owners() const { return owner_numbers_.size(); }
  // Bytes of the ring and of the index's table (fixed at construction; the
  // owners' names are not counted).
  size_t table_bytes() const;

 private:
  struct Record {
    SessionKey id = {};
    uint32_t owner = 0;  // into owners_
    SessionEnd why = SessionEnd::kClosed;
  };
  // The index holds ring slots; it hashes and compares them by their
  // records' ids, and looks up ids directly (transparent).
  struct SlotHash {
    using is_transparent = void;
    size_t operator()(uint32_t slot) const;
    size_t operator()(const SessionKey& id) const;
    const std::vector<Record>* records;
  };
  struct SlotEq {
    using is_transparent = void;
    bool operator()(uint32_t a, uint32_t b) const { return a == b; }
    bool operator()(uint32_t slot, const SessionKey& id) const;
    bool operator()(const SessionKey& id, uint32_t slot) const { return (*this)(slot, id); }
    const std::vector<Record>* records;
  };
  struct Owner {
    std::string name;
    size_t records = 0;  // 0: a free entry
  };

  // The number of `owner` in owners_, counting one more record of it.
  uint32_t HoldOwner(absl::string_view owner);
  // One record fewer of owner `number` (the entry is freed at none).
  void ReleaseOwner(uint32_t number);

  std::vector<Record> records_;  // the ring; its size is the capacity
  size_t next_ = 0;              // the slot the next record takes
  size_t size_ = 0;
  absl::flat_hash_set<uint32_t, SlotHash, SlotEq> index_;
  std::vector<Owner> owners_;
  std::vector<uint32_t> free_owners_;
  absl::flat_hash_map<std::string, uint32_t> owner_numbers_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SESSIONS_ENDED_SESSIONS_H_
