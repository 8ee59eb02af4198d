#ifndef ATTNSERVE_TESTS_CORE_STATUS_MATCHERS_H_
#define ATTNSERVE_TESTS_CORE_STATUS_MATCHERS_H_

// Abseil 20220623 has no status matchers; this is ours.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"

namespace attnserve::testing {

inline const absl::Status& StatusOf(const absl::Status& status) { return status; }

template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Matches an absl::Status or absl::StatusOr<T> whose code is `code` and whose
// message contains `message_substring`:
//   EXPECT_THAT(layer.Forward(...), StatusIs(absl::StatusCode::kCancelled, ""));
MATCHER_P2(StatusIs, code, message_substring,
           absl::StrCat(negation ? "is not " : "is ", absl::StatusCodeToString(code),
                        " with a message containing \"", std::string(message_substring), "\"")) {
  const absl::Status& status = ::attnserve::testing::StatusOf(arg);
  *result_listener << "the status is " << status.ToString();
  return status.code() == code && absl::StrContains(status.message(), message_substring);
}

// Matches an OK absl::Status or absl::StatusOr<T>.
MATCHER(IsOk, negation ? "is not OK" : "is OK") {
  const absl::Status& status = ::attnserve::testing::StatusOf(arg);
  *result_listener << "the status is " << status.ToString();
  return status.ok();
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_CORE_STATUS_MATCHERS_H_
