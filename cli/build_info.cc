#include "cli/build_info.h"

#include "absl/strings/str_cat.h"
// Generated at every build by cli/write_build_info.cmake (only rewritten when
// its content changes): ATTNSERVE_BUILD_VERSION, _REVISION and _TYPE.
#include "cli/generated_build_info.h"

namespace attnserve::cli {

absl::string_view Version() { return ATTNSERVE_BUILD_VERSION; }

absl::string_view Revision() { return ATTNSERVE_BUILD_REVISION; }

absl::string_view BuildType() { return ATTNSERVE_BUILD_TYPE; }

std::string VersionText(absl::string_view program, absl::Span<const Component> components) {
  std::string text = absl::StrCat(program, " ", Version(), "\nrevision: ", Revision(),
                                  "\nbuild type: ", BuildType(), "\n");
  for (const auto& [name, version] : components) absl::StrAppend(&text, name, ": ", version, "\n");
  return text;
}

}  // namespace attnserve::cli
