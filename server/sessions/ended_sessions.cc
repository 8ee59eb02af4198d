#include "server/sessions/ended_sessions.h"

#include <utility>

#include "absl/hash/hash.h"

namespace attnserve::server {
namespace {

// 0-15 for a lowercase hex digit, -1 for anything else.
int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

std::optional<SessionKey> ParseSessionId(absl::string_view id) {
  SessionKey key;
  if (id.size() != 2 * key.size()) return std::nullopt;
  for (size_t i = 0; i < key.size(); ++i) {
    const int high = HexValue(id[2 * i]);
    const int low = HexValue(id[2 * i + 1]);
    if (high < 0 || low < 0) return std::nullopt;
    key[i] = static_cast<uint8_t>(high << 4 | low);
  }
  return key;
}

size_t EndedSessions::SlotHash::operator()(uint32_t slot) const {
  return (*this)((*records)[slot].id);
}

size_t EndedSessions::SlotHash::operator()(const SessionKey& id) const {
  return absl::Hash<SessionKey>{}(id);
}

bool EndedSessions::SlotEq::operator()(uint32_t slot, const SessionKey& id) const {
  return (*records)[slot].id == id;
}

EndedSessions::EndedSessions(size_t capacity)
    : records_(capacity),
      index_(0, SlotHash{&records_}, SlotEq{&records_}) {
  // Room for every record at once, so that the index never grows. Overwriting
  // the oldest record leaves tombstones in Abseil's table; when they use up
  // its room it clears them in place, without growing, as long as its
  // elements fill at most 25/32 of its buckets. Room for 8/7 of the records
  // makes at least 64/49 as many buckets as records: at most 49/64 full.
  index_.reserve(capacity + capacity / 7 + 1);
}

void EndedSessions::Remember(const SessionKey& id, absl::string_view owner, SessionEnd why) {
  if (records_.empty()) return;
  Record& record = records_[next_];
  // The new owner is held first: if that throws, the ring and the index are
  // as they were (and an owner whose last record this replaces is kept).
  const uint32_t held = HoldOwner(owner);
  if (size_ == records_.size()) {  // the oldest record goes
    index_.erase(static_cast<uint32_t>(next_));  // hashed by the id it still holds
    ReleaseOwner(record.owner);
  } else {
    ++size_;
  }
  record = {.id = id, .owner = held, .why = why};
  index_.insert(static_cast<uint32_t>(next_));
  next_ = (next_ + 1) % records_.size();
}

std::optional<SessionEnd> EndedSessions::Find(const SessionKey& id,
                                              absl::string_view owner) const {
  const auto it = index_.find(id);
  if (it == index_.end()) return std::nullopt;
  const Record& record = records_[*it];
  if (owners_[record.owner].name != owner) return std::nullopt;
  return record.why;
}

bool EndedSessions::Contains(const SessionKey& id) const { return index_.contains(id); }

size_t EndedSessions::table_bytes() const {
  // The index: a 4-byte slot and a control byte per bucket.
  return records_.capacity() * sizeof(Record) +
         index_.bucket_count() * (sizeof(uint32_t) + 1);
}

uint32_t EndedSessions::HoldOwner(absl::string_view owner) {
  const auto found = owner_numbers_.find(owner);
  if (found != owner_numbers_.end()) {
    ++owners_[found->second].records;
    return found->second;
  }
  uint32_t number;
  if (!free_owners_.empty()) {
    number = free_owners_.back();
    free_owners_.pop_back();
  } else {
    number = static_cast<uint32_t>(owners_.size());
    owners_.emplace_back();
  }
  owners_[number] = {.name = std::string(owner), .records = 1};
  owner_numbers_.emplace(owners_[number].name, number);
  return number;
}

void EndedSessions::ReleaseOwner(uint32_t number) {
  Owner& owner = owners_[number];
  if (--owner.records > 0) return;
  owner_numbers_.erase(owner.name);
  owner.name.clear();
  owner.name.shrink_to_fit();
  free_owners_.push_back(number);
}

}  // namespace attnserve::server
