// The .npy parser's mutation run, a fuzzer without libFuzzer for CTest (and
// ASan): every valid_* seed of tests/fuzz/npy_corpus is mutated many times
// (random bytes overwritten, inserted or removed, truncation, the header's
// length field and its shape replaced by huge or malformed values) and each
// mutant goes through npy_fuzzer.cc's LLVMFuzzerTestOneInput, which traps
// unless cli::ParseNpy accepts it consistently or refuses it naming the
// file. The random seed is fresh each run and printed; pass it as the
// second argument to replay a run.
//
//   npy_mutation_fuzz <corpus dir> [seed]
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int AttnserveFuzzLastOutcome();

namespace {

constexpr int kMutantsPerSeed = 20000;

// Shapes that overflow, exceed the limits or are not integers.
const char* const kShapes[] = {
    "(9223372036854775807, 2)", "(9223372036854775808,)", "(4294967296, 4294967296)",
    "(99999999999999999999999,)", "(1048577,)", "(-1, 3)", "(1, 2, 3, 4, 5, 6, 7, 8, 9)",
    "(3.5,)", "(", ")", "(,)", "(1,,2)", "()", "(0,)", "(1 2)"};

std::string Mutate(const std::string& seed, std::mt19937_64& rng) {
  std::string out = seed;
  auto pick = [&rng](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  switch (rng() % 7) {
    case 0:  // overwrite a few bytes
      for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n && !out.empty(); ++i) {
        out[pick(out.size())] = static_cast<char>(rng());
      }
      break;
    case 1:  // truncate
      out.resize(pick(out.size() + 1));
      break;
    case 2:  // insert random bytes
      out.insert(pick(out.size() + 1), std::string(1 + rng() % 8, static_cast<char>(rng())));
      break;
    case 3:  // remove bytes
      if (!out.empty()) out.erase(pick(out.size()), 1 + rng() % 8);
      break;
    case 4: {  // a huge or wrong header length field
      const uint32_t length = rng() % 2 ? static_cast<uint32_t>(rng()) : 0xffffffffu;
      for (size_t i = 0; i < 4 && 8 + i < out.size(); ++i) out[8 + i] = static_cast<char>(length >> (8 * i));
      break;
    }
    case 5: {  // another shape
      const size_t at = out.find("'shape': ");
      const size_t end = out.find(')', at);
      if (at != std::string::npos && end != std::string::npos) {
        out.replace(at + 9, end + 1 - (at + 9), kShapes[pick(std::size(kShapes))]);
      }
      break;
    }
    default: {  // another version byte
      if (out.size() > 7) out[6] = static_cast<char>(rng() % 6);
      break;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <corpus dir> [seed]\n", argv[0]);
    return 2;
  }
  const uint64_t seed = argc > 2 ? std::stoull(argv[2]) : std::random_device{}();
  std::printf("npy_mutation_fuzz: seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  int seeds = 0;
  int64_t accepted = 0, refused = 0;
  for (const auto& entry : std::filesystem::directory_iterator(argv[1])) {
    if (entry.path().filename().string().rfind("valid_", 0) != 0) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ++seeds;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(original.data()), original.size());
    if (AttnserveFuzzLastOutcome() != 2) {
      std::fprintf(stderr, "npy_mutation_fuzz: the seed %s is not accepted\n", entry.path().c_str());
      return 1;
    }
    for (int i = 0; i < kMutantsPerSeed; ++i) {
      std::string mutant = Mutate(original, rng);
      // Some mutants get a second mutation on top.
      if (rng() % 3 == 0) mutant = Mutate(mutant, rng);
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(mutant.data()), mutant.size());
      (AttnserveFuzzLastOutcome() == 2 ? accepted : refused) += 1;
    }
  }
  std::printf("npy_mutation_fuzz: %d seeds, %lld mutants accepted, %lld refused\n", seeds,
              static_cast<long long>(accepted), static_cast<long long>(refused));
  // The run covered something: seeds were found and mutants were refused.
  return seeds >= 6 && refused > 0 ? 0 : 1;
}
