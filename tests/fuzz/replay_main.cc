// Runs a libFuzzer target over saved inputs without libFuzzer: every regular
// file named on the command line, or found (recursively) in a directory named
// there, is passed to LLVMFuzzerTestOneInput once. Lets the normal build and
// CTest replay the checked-in corpus with any compiler.
//
// A seed's name says what it is for, and the replay checks that it still gets
// there (so a seed made stale by an API change fails instead of silently
// covering nothing): valid_* must plan, invalid_* must parse and be refused,
// corrupt_* must not plan. Other names, and other targets' seeds, are only run.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// The AttendRequest target's verdict on the last input: 0 not an
// AttendRequest, 1 refused by PlanAttend, 2 planned. Weak: other targets do
// not define it, and their seeds are only run.
extern "C" int AttnserveFuzzLastOutcome() __attribute__((weak));

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot read %s\n", path.c_str());
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  if (AttnserveFuzzLastOutcome == nullptr) return true;
  const std::string name = path.filename().string();
  const int outcome = AttnserveFuzzLastOutcome();
  const char* wrong = nullptr;
  if (name.rfind("valid_", 0) == 0 && outcome != 2) wrong = "a valid_ seed that does not plan";
  if (name.rfind("invalid_", 0) == 0 && outcome != 1) wrong = "an invalid_ seed that is not refused by PlanAttend";
  if (name.rfind("corrupt_", 0) == 0 && outcome == 2) wrong = "a corrupt_ seed that plans";
  if (wrong != nullptr) {
    std::fprintf(stderr, "replay: %s is %s (rerun tests/fuzz/make_corpus.py)\n", path.c_str(), wrong);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  int files = 0;
  bool ok = true;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    std::error_code ec;
    if (std::filesystem::is_directory(arg, ec)) {
      for (const auto& entry : std::filesystem::recursive_directory_iterator(arg)) {
        if (!entry.is_regular_file()) continue;
        ok = RunFile(entry.path()) && ok;
        ++files;
      }
    } else {
      ok = RunFile(arg) && ok;
      ++files;
    }
  }
  std::printf("replay: ran %d inputs\n", files);
  // No inputs at all means a wrong path, not a pass.
  return ok && files > 0 ? 0 : 1;
}
