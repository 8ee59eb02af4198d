#ifndef ATTNSERVE_TESTS_CLIENT_TEST_FILES_H_
#define ATTNSERVE_TESTS_CLIENT_TEST_FILES_H_

// Paths the client tests read and write.

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnserve::client {

// A fixture in tests/client/testdata/ (written by NumPy 1.24).
inline std::string TestData(const std::string& name) {
  return absl::StrCat(ATTNSERVE_CLIENT_TESTDATA, "/", name);
}

// A path in the test's temporary directory, unique to this process.
inline std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / absl::StrCat(getpid(), "_", name)).string();
}

}  // namespace attnserve::client

#endif  // ATTNSERVE_TESTS_CLIENT_TEST_FILES_H_
