#include "cli/command_line.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/build_info.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

ABSL_FLAG(int64_t, count, 0, "How many");
ABSL_FLAG(std::string, name, "", "Who");
ABSL_FLAG(bool, verbose, false,
          "Say more: a help text long enough to be wrapped at eighty columns, so that the help "
          "printer's wrapping is seen to keep every line short");

namespace attnserve::cli {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<CommandLine> Parse(std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return ParseCommandLine(static_cast<int>(args.size()), args.data());
}

TEST(ParseCommandLine, SetsFlagsGivenWithEqualsOrAsTheNextArgument) {
  absl::FlagSaver saver;
  absl::StatusOr<CommandLine> line = Parse({"run", "--count=3", "--name", "bob", "-count=4", "x"});
  ASSERT_THAT(line, IsOk());
  EXPECT_EQ(line->action, CommandLine::Action::kRun);
  EXPECT_THAT(line->positional, ElementsAre("run", "x"));
  EXPECT_EQ(absl::GetFlag(FLAGS_count), 4);
  EXPECT_EQ(absl::GetFlag(FLAGS_name), "bob");
  ASSERT_THAT(Parse({"--name="}), IsOk());
  EXPECT_EQ(absl::GetFlag(FLAGS_name), "");
  ASSERT_THAT(Parse({"--count", "-7"}), IsOk());
  EXPECT_EQ(absl::GetFlag(FLAGS_count), -7);
}

TEST(ParseCommandLine, BooleansTakeNoSeparateValue) {
  absl::FlagSaver saver;
  absl::StatusOr<CommandLine> line = Parse({"--verbose", "false"});
  ASSERT_THAT(line, IsOk());
  EXPECT_TRUE(absl::GetFlag(FLAGS_verbose));
  EXPECT_THAT(line->positional, ElementsAre("false"));
  ASSERT_THAT(Parse({"--noverbose"}), IsOk());
  EXPECT_FALSE(absl::GetFlag(FLAGS_verbose));
  ASSERT_THAT(Parse({"-verbose=yes"}), IsOk());
  EXPECT_TRUE(absl::GetFlag(FLAGS_verbose));
  ASSERT_THAT(Parse({"--verbose=false"}), IsOk());
  EXPECT_FALSE(absl::GetFlag(FLAGS_verbose));
  EXPECT_THAT(Parse({"--noverbose=true"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--noverbose takes no value"));
  // "no" before a flag that is not a boolean is no flag at all.
  EXPECT_THAT(Parse({"--nocount"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "unknown flag --nocount"));
}

TEST(ParseCommandLine, DoubleDashEndsTheFlagsAndADashAloneIsAnArgument) {
  absl::FlagSaver saver;
  absl::StatusOr<CommandLine> line = Parse({"-", "--", "--count=9", "--help"});
  ASSERT_THAT(line, IsOk());
  EXPECT_EQ(line->action, CommandLine::Action::kRun);
  EXPECT_THAT(line->positional, ElementsAre("-", "--count=9", "--help"));
  EXPECT_EQ(absl::GetFlag(FLAGS_count), 0);
}

TEST(ParseCommandLine, AnUnknownFlagIsNamedWithTheNearestKnownOne) {
  EXPECT_THAT(Parse({"--cuont=3"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "unknown flag --cuont (did you mean --count?)"));
  EXPECT_THAT(Parse({"--verison"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "did you mean --version?"));
  absl::StatusOr<CommandLine> far = Parse({"--zzzzzzzz"});
  EXPECT_THAT(far, StatusIs(absl::StatusCode::kInvalidArgument, "unknown flag --zzzzzzzz"));
  EXPECT_THAT(std::string(far.status().message()), Not(HasSubstr("did you mean")));
}

TEST(ParseCommandLine, ABadOrMissingValueNamesTheFlag) {
  absl::FlagSaver saver;
  EXPECT_THAT(Parse({"--count=many"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--count: bad value 'many'"));
  EXPECT_THAT(Parse({"--count=99999999999999999999"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--count: bad value"));
  EXPECT_THAT(Parse({"--verbose=maybe"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--verbose: bad value 'maybe'"));
  EXPECT_THAT(Parse({"x", "--count"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--count needs a value"));
  // The first mistake is the one reported.
  EXPECT_THAT(Parse({"--count=a", "--nope"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--count"));
}

TEST(ParseCommandLine, HelpWinsOverVersionAndMistakes) {
  for (const std::vector<const char*>& args :
       std::vector<std::vector<const char*>>{{"--help"},
                                             {"-h"},
                                             {"-help"},
                                             {"--helpfull"},
                                             {"--nope", "--version", "--help"},
                                             {"--help", "--count=x"}}) {
    absl::StatusOr<CommandLine> line = Parse(args);
    ASSERT_THAT(line, IsOk()) << args[0];
    EXPECT_EQ(line->action, CommandLine::Action::kHelp) << args[0];
  }
  absl::StatusOr<CommandLine> version = Parse({"--count=x", "--version"});
  ASSERT_THAT(version, IsOk());
  EXPECT_EQ(version->action, CommandLine::Action::kVersion);
  EXPECT_THAT(Parse({"--help=1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--help takes no value"));
}

TEST(HelpText, ListsEveryFlagSortedWithItsDefaultAndNoSourcePath) {
  const std::string text = HelpText("Usage: prog [flags]\n\n");
  EXPECT_THAT(text, ::testing::StartsWith("Usage: prog [flags]\n\nFlags"));
  const size_t count = text.find("  --count (default 0)\n      How many\n");
  const size_t name = text.find("  --name (default \"\")\n      Who\n");
  const size_t verbose = text.find("  --verbose (default false)\n");
  const size_t help = text.find("  --help\n");
  const size_t version = text.find("  --version\n");
  ASSERT_NE(count, std::string::npos) << text;
  ASSERT_NE(name, std::string::npos) << text;
  ASSERT_NE(verbose, std::string::npos) << text;
  EXPECT_LT(count, name);
  EXPECT_LT(name, verbose);
  EXPECT_LT(verbose, help);
  EXPECT_LT(help, version);
  EXPECT_THAT(text, Not(HasSubstr(".cc")));
  EXPECT_THAT(text, Not(HasSubstr("Flags from")));
  for (absl::string_view line : absl::StrSplit(text, '\n')) EXPECT_LE(line.size(), 80u) << line;
}

TEST(BuildInfo, SaysTheProjectVersionTheBuildTypeAndARevision) {
  EXPECT_EQ(Version(), ATTNSERVE_TEST_VERSION);
  EXPECT_EQ(BuildType(), std::string(ATTNSERVE_TEST_BUILD_TYPE).empty()
                             ? "unknown"
                             : ATTNSERVE_TEST_BUILD_TYPE);
  // git's commit ("0123456789ab", "-dirty" after it), "unknown", or the
  // build's ATTNSERVE_REVISION, which keeps only these characters.
  EXPECT_THAT(std::string(Revision()), ::testing::MatchesRegex("[0-9A-Za-z._+-]+"));
  const Component components[] = {{"gRPC", "1.2.3"}, {"oneDNN", "4.5.6"}};
  EXPECT_EQ(VersionText("prog", components),
            absl::StrCat("prog ", Version(), "\nrevision: ", Revision(),
                         "\nbuild type: ", BuildType(), "\ngRPC: 1.2.3\noneDNN: 4.5.6\n"));
}

}  // namespace
}  // namespace attnserve::cli
