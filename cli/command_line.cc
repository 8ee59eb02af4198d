#include "cli/command_line.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve::cli {
namespace {

constexpr size_t kWidth = 80;
constexpr absl::string_view kHelpIndent = "      ";

bool IsHelpName(absl::string_view name) {
  return name == "help" || name == "h" || name == "helpfull";
}

// The program's own flags: Abseil's (--flagfile and the like, when a library
// links them in) are not part of the interface.
bool IsOwnFlag(const absl::CommandLineFlag& flag) {
  return !flag.IsRetired() && !absl::StrContains(flag.Filename(), "absl/flags/");
}

absl::CommandLineFlag* FindOwnFlag(absl::string_view name) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && IsOwnFlag(*flag) ? flag : nullptr;
}

// Edits (insert, delete, replace, swap two neighbours) from a to b, for "did
// you mean": the optimal string alignment distance.
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// " (did you mean --x?)" for the nearest flag name within a small edit
// distance of `name`, else "".
std::string Suggestion(absl::string_view name) {
  std::vector<std::string> names = {"help", "version"};
  for (const auto& [flag_name, flag] : absl::GetAllFlags()) {
    if (IsOwnFlag(*flag)) names.emplace_back(flag_name);
  }
  std::sort(names.begin(), names.end());
  const size_t limit = std::min<size_t>(2, name.size() / 3);
  std::string best;
  size_t best_distance = limit + 1;
  for (const std::string& candidate : names) {
    const size_t d = EditDistance(name, candidate);
    if (d < best_distance) {
      best = candidate;
      best_distance = d;
    }
  }
  return best.empty() ? "" : absl::StrCat(" (did you mean --", best, "?)");
}

absl::Status UsageStatus(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

// Appends `text` to `out`, words wrapped at kWidth, each line `indent`ed.
void AppendWrapped(absl::string_view text, absl::string_view indent, std::string* out) {
  std::string line(indent);
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (line.size() > indent.size() && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(out, line, "\n");
      line = std::string(indent);
    }
    if (line.size() > indent.size()) line.push_back(' ');
    absl::StrAppend(&line, word);
  }
  if (line.size() > indent.size()) absl::StrAppend(out, line, "\n");
}

std::string DefaultText(const absl::CommandLineFlag& flag) {
  const std::string value = flag.DefaultValue();
  if (flag.IsOfType<std::string>()) return absl::StrCat("\"", value, "\"");
  return value.empty() ? "none" : value;
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(int argc, const char* const* argv) {
  CommandLine result;
  bool help = false;
  bool version = false;
  absl::Status first_error;
  auto fail = [&first_error](absl::Status status) {
    if (first_error.ok()) first_error = std::move(status);
  };
  bool flags_ended = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (flags_ended || arg.size() < 2 || arg[0] != '-') {
      result.positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_ended = true;
      continue;
    }
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    const size_t equals = body.find('=');
    const bool has_value = equals != absl::string_view::npos;
    const absl::string_view name = body.substr(0, equals);
    const absl::string_view inline_value = has_value ? body.substr(equals + 1) : "";

    if (IsHelpName(name) || name == "version") {
      if (has_value) {
        fail(UsageStatus(absl::StrCat("--", name, " takes no value")));
      } else if (name == "version") {
        version = true;
      } else {
        help = true;
      }
      continue;
    }
    absl::CommandLineFlag* flag = FindOwnFlag(name);
    std::string value;
    if (flag == nullptr) {
      // --noname turns a boolean flag off.
      absl::CommandLineFlag* negated =
          absl::StartsWith(name, "no") ? FindOwnFlag(name.substr(2)) : nullptr;
      if (negated == nullptr || !negated->IsOfType<bool>()) {
        fail(UsageStatus(absl::StrCat("unknown flag --", name, Suggestion(name))));
        continue;
      }
      if (has_value) {
        fail(UsageStatus(absl::StrCat("--", name, " takes no value (use --", name.substr(2),
                                      "=false)")));
        continue;
      }
      flag = negated;
      value = "false";
    } else if (has_value) {
      value = std::string(inline_value);
    } else if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      fail(UsageStatus(absl::StrCat("--", name, " needs a value (--", name, "=VALUE)")));
      continue;
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      // Abseil's own text for a value its parser refuses repeats the value
      // and the flag; a flag type's own parser says what is wrong.
      const bool says_more = !error.empty() && !absl::StartsWith(error, "Illegal value");
      fail(UsageStatus(absl::StrCat("--", flag->Name(), ": bad value '", value, "'",
                                    says_more ? absl::StrCat(": ", error) : "")));
    }
  }
  if (help) {
    result.action = CommandLine::Action::kHelp;
  } else if (version) {
    result.action = CommandLine::Action::kVersion;
  } else if (!first_error.ok()) {
    return first_error;
  }
  return result;
}

std::string HelpText(absl::string_view usage) {
  std::string text(absl::StripTrailingAsciiWhitespace(usage));
  absl::StrAppend(&text, "\n\nFlags (--name=value; --name or --noname for true/false flags):\n");
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsOwnFlag(*flag)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](const absl::CommandLineFlag* a,
                                           const absl::CommandLineFlag* b) {
    return a->Name() < b->Name();
  });
  for (const absl::CommandLineFlag* flag : flags) {
    absl::StrAppend(&text, "  --", flag->Name(), " (default ", DefaultText(*flag), ")\n");
    AppendWrapped(flag->Help(), kHelpIndent, &text);
  }
  absl::StrAppend(&text, "  --help\n");
  AppendWrapped("Print this text and exit", kHelpIndent, &text);
  absl::StrAppend(&text, "  --version\n");
  AppendWrapped("Print the version, the git revision, the build type and the libraries' "
                "versions, and exit",
                kHelpIndent, &text);
  return text;
}

int UsageError(absl::string_view program, absl::string_view message) {
  std::fprintf(stderr, "%s: %s\nRun '%s --help' for the flags.\n", std::string(program).c_str(),
               std::string(message).c_str(), std::string(program).c_str());
  return kExitUsage;
}

}  // namespace attnserve::cli
