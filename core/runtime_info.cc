#include "core/runtime_info.h"

#include "absl/strings/str_cat.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core {
namespace {

const char* IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::all:
      return "all";
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
  }
  return "unknown";
}

}  // namespace

RuntimeInfo GetRuntimeInfo() {
  // Neither call can fail or throw: dnnl_version() reads a static, and
  // get_effective_cpu_isa() caches its CPUID probe.
  static const RuntimeInfo* const info = [] {
    const dnnl::version_t* version = dnnl::version();
    return new RuntimeInfo{
        .onednn_version = absl::StrCat(version->major, ".", version->minor, ".", version->patch),
        .cpu_isa = IsaName(dnnl::get_effective_cpu_isa()),
    };
  }();
  return *info;
}

}  // namespace attnserve::core
