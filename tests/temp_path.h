#ifndef ATTNSERVE_TESTS_TEMP_PATH_H_
#define ATTNSERVE_TESTS_TEMP_PATH_H_

// A file path for a test to write, unique to its process. ctest runs each
// test in its own process and several at once (a test of the plain build
// beside the same test under a sanitizer), so a fixed name in the shared
// temporary directory is a race: one process truncates the file another is
// reading.

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

inline std::string TempPath(const std::string& name) {
  const std::string file = absl::StrCat("attnserve_", getpid(), "_", name);
  return (std::filesystem::path(::testing::TempDir()) / file).string();
}

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_TEMP_PATH_H_
