#ifndef ATTNSERVE_TESTS_CORE_CPU_FEATURES_H_
#define ATTNSERVE_TESTS_CORE_CPU_FEATURES_H_

// What this machine offers, read apart from the core's own checks (the
// compiler's __builtin_cpu_supports, oneDNN's ISA detection) so that tests can
// hold those checks to it; and the one way a test skips for want of a CPU
// feature: ATTNSERVE_SKIP_UNLESS_AVAILABLE (header-only; the test binaries
// bring GoogleTest).

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "core/attention_inputs.h"
#include "gtest/gtest.h"

namespace attnserve::testing {

// The flags of the first processor in /proc/cpuinfo ("avx512f",
// "avx512_bf16", ...); empty when the file cannot be read.
inline std::set<std::string> CpuInfoFlags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::istringstream words(line.substr(colon + 1));
    std::set<std::string> flags;
    for (std::string flag; words >> flag;) flags.insert(flag);
    return flags;
  }
  return {};
}

// AVX-512 F/BW/DQ/VL: what the core's own AVX-512 kernels need.
inline bool CpuInfoHasAvx512() {
  const std::set<std::string> flags = CpuInfoFlags();
  return flags.count("avx512f") && flags.count("avx512bw") && flags.count("avx512dq") &&
         flags.count("avx512vl");
}

// AVX-512 with AVX512-BF16 (every CPU with AMX-BF16 has it too).
inline bool CpuInfoHasAvx512Bf16() {
  return CpuInfoHasAvx512() && CpuInfoFlags().count("avx512_bf16");
}

// Whether `isa`, a value of ONEDNN_MAX_CPU_ISA (oneDNN 2.x names, any case),
// caps oneDNN below avx512_core_bf16. Unset (nullptr), "ALL", the BF16 and
// AMX ISAs and names oneDNN does not know (it ignores them) do not.
inline bool IsaNameCapsBelowBf16(const char* isa) {
  if (isa == nullptr) return false;
  std::string name(isa);
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  static const std::set<std::string> below = {
      "SSE41",           "AVX", "AVX2", "AVX2_VNNI", "AVX512_MIC", "AVX512_MIC_4OPS", "AVX512_CORE",
      "AVX512_CORE_VNNI"};
  return below.count(name) > 0;
}

// Whether the environment caps oneDNN's ISA below BF16 on purpose
// (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA when the former is unset).
inline bool OneDnnIsaCappedBelowBf16() {
  const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (isa == nullptr) isa = std::getenv("DNNL_MAX_CPU_ISA");
  return IsaNameCapsBelowBf16(isa);
}

// Whether BF16 must run in BF16 here: /proc/cpuinfo shows AVX512-BF16 and the
// ISA is not capped. core::Bf16Supported() must say the same.
inline bool MachineRunsBf16() { return CpuInfoHasAvx512Bf16() && !OneDnnIsaCappedBelowBf16(); }

// For a test that runs BF16 among other cases: whether its BF16 cases run
// (core::Bf16Supported()); adds a failure where they would not although the
// machine runs BF16.
inline bool Bf16CasesRun() {
  const bool supported = core::Bf16Supported();
  EXPECT_TRUE(supported || !MachineRunsBf16())
      << "Bf16Supported() is false although this machine has AVX512-BF16 and no ISA cap";
  return supported;
}

}  // namespace attnserve::testing

// The one way a test skips for want of a CPU feature: skips when `available`
// (the code's own answer) is false and `machine_has` (what /proc/cpuinfo and
// the environment say, above) is false too; FAILS when `available` is false on
// a machine that has what `what` needs -- a skip there would hide lost
// coverage. For TEST bodies and SetUp().
#define ATTNSERVE_SKIP_UNLESS_AVAILABLE(available, machine_has, what)                     \
  do {                                                                                    \
    if (!(available)) {                                                                   \
      ASSERT_FALSE(machine_has) << (what) << " is unavailable although this machine has " \
                                << "what it needs (/proc/cpuinfo, ONEDNN_MAX_CPU_ISA)";   \
      GTEST_SKIP() << (what) << ": this machine lacks what it needs";                     \
    }                                                                                     \
  } while (false)

// For tests of BF16 running in BF16.
#define ATTNSERVE_SKIP_WITHOUT_BF16()                                 \
  ATTNSERVE_SKIP_UNLESS_AVAILABLE(::attnserve::core::Bf16Supported(), \
                                  ::attnserve::testing::MachineRunsBf16(), "BF16")

#endif  // ATTNSERVE_TESTS_CORE_CPU_FEATURES_H_
