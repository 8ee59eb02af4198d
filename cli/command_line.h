#ifndef ATTNSERVE_CLI_COMMAND_LINE_H_
#define ATTNSERVE_CLI_COMMAND_LINE_H_

// The command-line front end attnserve and attnctl share: flags parsed into
// the program's Abseil flags (ABSL_FLAG), --help and --version, and the exit
// codes. Abseil's own ParseCommandLine exits 1 for --help and for a mistake
// alike and prints the build machine's source paths; this one leaves the
// exit to the program:
//   0  done (and --help, --version)
//   1  the work failed (a call, a start, a file)
//   2  the command line is wrong (unknown flag, bad value, bad argument)

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// What a command line asks for.
struct CommandLine {
  enum class Action {
    kRun,      // do the work
    kHelp,     // --help (or -h, --helpfull): print HelpText, exit 0
    kVersion,  // --version: print the version, exit 0
  };
  Action action = Action::kRun;
  // The arguments that are not flags, in order, without argv[0].
  std::vector<std::string> positional;
};

// Parses argv[1..argc) and sets the program's Abseil flags. Flags are
// --name=value, --name value (not for booleans), --name and --noname for
// booleans, with one dash or two; "--" ends the flags, "-" alone is an
// argument. --help (-h, --helpfull) and --version may stand anywhere; --help
// wins over --version, and both win over a mistake elsewhere on the line.
// INVALID_ARGUMENT, its message naming the flag ("--name"), for an unknown
// flag (with the nearest known name when one is close), a value the flag's
// type does not parse, a missing value, or a value given to --help/--version.
// Not thread-safe with other flag access (call it first in main).
absl::StatusOr<CommandLine> ParseCommandLine(int argc, const char* const* argv);

// The --help text: `usage`, then every flag the program defines, sorted by
// name, with its default and help text (wrapped at 80 columns), then --help
// and --version. Names no source file or path.
std::string HelpText(absl::string_view usage);

// Prints "<program>: <message>" and a hint to --help on stderr; returns
// kExitUsage.
int UsageError(absl::string_view program, absl::string_view message);

}  // namespace attnserve::cli

#endif  // ATTNSERVE_CLI_COMMAND_LINE_H_
