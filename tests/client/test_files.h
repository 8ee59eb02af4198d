#ifndef ATTNSERVE_TESTS_CLIENT_TEST_FILES_H_
#define ATTNSERVE_TESTS_CLIENT_TEST_FILES_H_

// Paths the client tests read and write.

#include <string>

#include "absl/strings/str_cat.h"
#include "tests/temp_path.h"

namespace attnserve::client {

// A fixture in tests/client/testdata/ (written by NumPy 1.24).
inline std::string TestData(const std::string& name) {
  return absl::StrCat(ATTNSERVE_CLIENT_TESTDATA, "/", name);
}

using ::attnserve::testing::TempPath;

}  // namespace attnserve::client

#endif  // ATTNSERVE_TESTS_CLIENT_TEST_FILES_H_
