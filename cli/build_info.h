#ifndef ATTNSERVE_CLI_BUILD_INFO_H_
#define ATTNSERVE_CLI_BUILD_INFO_H_

// What the binaries say about their own build (--version, the server's
// start-up log, the attnserve_build_info metric). One source: CMake's
// project(VERSION), the build type, and the git revision read at build time.

#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attnserve::cli {

// The project's version, "major.minor.patch" (the top-level CMakeLists.txt's
// project(VERSION)).
absl::string_view Version();

// The git commit the binary was built from: 12 hex digits, with "-dirty"
// when tracked files differed from it; the build's ATTNSERVE_REVISION when
// one was given (a build from a source archive); "unknown" otherwise.
absl::string_view Revision();

// CMake's build type ("Release", "RelWithDebInfo", ...); "unknown" if none.
absl::string_view BuildType();

// A library the binary reports with its version, e.g. {"gRPC", "1.51.1"}.
using Component = std::pair<absl::string_view, std::string>;

// The --version text, one "key: value" per line after the first:
//   attnserve 1.2.3
//   revision: 0123456789ab
//   build type: Release
//   gRPC: 1.51.1
// (one line per component, in order). Ends with a newline.
std::string VersionText(absl::string_view program, absl::Span<const Component> components);

}  // namespace attnserve::cli

#endif  // ATTNSERVE_CLI_BUILD_INFO_H_
