// The ended sessions' records: ids parsed as SessionManager issues them, why a
// session ended told to its owner alone, the oldest record forgotten past the
// capacity, and memory that stays what construction took.
#include "server/sessions/ended_sessions.h"

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

SessionKey RandomKey(std::mt19937_64& random) {
  SessionKey key;
  for (uint8_t& byte : key) byte = static_cast<uint8_t>(random());
  return key;
}

TEST(ParseSessionId, TakesExactly32LowercaseHexDigits) {
  const std::optional<SessionKey> key = ParseSessionId("00ff10a9b8c7d6e5f4031223344556fa");
  ASSERT_TRUE(key.has_value());
  EXPECT_EQ(*key, (SessionKey{0x00, 0xff, 0x10, 0xa9, 0xb8, 0xc7, 0xd6, 0xe5, 0xf4, 0x03, 0x12,
                              0x23, 0x34, 0x45, 0x56, 0xfa}));
  for (const std::string& bad : std::vector<std::string>{
           "", "00ff10a9b8c7d6e5f4031223344556f", "00ff10a9b8c7d6e5f4031223344556fa0",
           "00FF10A9B8C7D6E5F4031223344556FA", "00ff10a9b8c7d6e5f4031223344556fg",
           "00ff10a9b8c7d6e5f4031223344556f ", "../etc/passwd", std::string(32, '\0')}) {
    EXPECT_FALSE(ParseSessionId(bad).has_value()) << bad;
  }
}

TEST(EndedSessions, TellsWhyToTheOwnerAloneAndForgetsTheOldestPastItsCapacity) {
  EndedSessions ended(3);
  std::mt19937_64 random(1);
  const SessionKey a = RandomKey(random), b = RandomKey(random), c = RandomKey(random),
                   d = RandomKey(random);
  ended.Remember(a, "alice", SessionEnd::kClosed);
  ended.Remember(b, "", SessionEnd::kExpired);
  ended.Remember(c, "alice", SessionEnd::kEvictedForMemory);
  EXPECT_EQ(ended.Find(a, "alice"), SessionEnd::kClosed);
  EXPECT_EQ(ended.Find(a, "mallory"), std::nullopt);
  EXPECT_EQ(ended.Find(a, ""), std::nullopt);
  EXPECT_EQ(ended.Find(b, ""), SessionEnd::kExpired);
  EXPECT_EQ(ended.Find(b, "alice"), std::nullopt);
  EXPECT_EQ(ended.Find(c, "alice"), SessionEnd::kEvictedForMemory);
  EXPECT_EQ(ended.Find(d, "alice"), std::nullopt);
  EXPECT_TRUE(ended.Contains(a));
  EXPECT_EQ(ended.owners(), 2u);
  ended.Remember(d, "bob", SessionEnd::kEvictedForSessions);  // a goes
  EXPECT_EQ(ended.size(), 3u);
  EXPECT_EQ(ended.Find(a, "alice"), std::nullopt);
  EXPECT_FALSE(ended.Contains(a));
  EXPECT_EQ(ended.Find(c, "alice"), SessionEnd::kEvictedForMemory);
  EXPECT_EQ(ended.Find(d, "bob"), SessionEnd::kEvictedForSessions);
  EXPECT_EQ(ended.owners(), 3u);
  // Owners are kept while a record names them.
  ended.Remember(RandomKey(random), "bob", SessionEnd::kClosed);  // b goes: "" too
  ended.Remember(RandomKey(random), "bob", SessionEnd::kClosed);  // c goes: alice too
  EXPECT_EQ(ended.owners(), 1u);
  EXPECT_EQ(ended.Find(d, "bob"), SessionEnd::kEvictedForSessions);
}

TEST(EndedSessions, TakesItsMemoryAtConstructionAndKeepsExactlyTheLastRecords) {
  // 28672 is 7/8 of 32768: room for it alone would fill the index's table up
  // to the point where clearing tombstones grows it.
  for (const size_t capacity : {size_t{1}, size_t{7}, size_t{100}, size_t{16384}, size_t{28672}}) {
    EndedSessions ended(capacity);
    const size_t bytes = ended.table_bytes();
    EXPECT_GE(bytes, capacity * 24) << capacity;
    std::mt19937_64 random(capacity);
    std::vector<SessionKey> keys;
    for (size_t i = 0; i < 4 * capacity + 5; ++i) {
      keys.push_back(RandomKey(random));
      ended.Remember(keys.back(), i % 2 == 0 ? "even" : "odd",
                     static_cast<SessionEnd>(i % 4));
      ASSERT_EQ(ended.table_bytes(), bytes) << capacity << " after " << i + 1;
    }
    EXPECT_EQ(ended.size(), capacity);
    for (size_t i = 0; i < keys.size(); ++i) {
      const bool kept = i + capacity >= keys.size();
      ASSERT_EQ(ended.Contains(keys[i]), kept) << capacity << ": record " << i;
      if (kept) {
        EXPECT_EQ(ended.Find(keys[i], i % 2 == 0 ? "even" : "odd"), static_cast<SessionEnd>(i % 4));
      }
    }
  }
}

TEST(EndedSessions, OfNoCapacityRemembersNothing) {
  EndedSessions ended(0);
  std::mt19937_64 random(2);
  const SessionKey key = RandomKey(random);
  ended.Remember(key, "", SessionEnd::kClosed);
  EXPECT_FALSE(ended.Contains(key));
  EXPECT_EQ(ended.size(), 0u);
}

}  // namespace
}  // namespace attnserve::server
