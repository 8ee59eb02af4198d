#ifndef ATTNSERVE_CORE_RUNTIME_INFO_H_
#define ATTNSERVE_CORE_RUNTIME_INFO_H_

#include <string>

namespace attnserve::core {

// What the attention engine runs on, for build-info metrics and logs.
struct RuntimeInfo {
  // oneDNN's version as loaded at run time, "major.minor.patch" (e.g. "2.6.3").
  std::string onednn_version;
  // The instruction set oneDNN dispatches to on this CPU, in oneDNN's names
  // (e.g. "avx512_core_bf16", "avx2"); "unknown" for an ISA this build does
  // not name. ONEDNN_MAX_CPU_ISA lowers it.
  std::string cpu_isa;
};

// Thread-safe; cheap after the first call.
RuntimeInfo GetRuntimeInfo();

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_RUNTIME_INFO_H_
