#include "core/attention_inputs.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/kernels/simd.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core {
namespace {

#ifdef ATTNSERVE_X86_INTRINSICS
// Whether oneDNN's effective ISA includes avx512_core_bf16 (cpu_isa values
// are bit sets: an ISA includes those whose bits it has). It is the lesser of
// the CPU's and a cap (ONEDNN_MAX_CPU_ISA, dnnl::set_max_cpu_isa).
bool OneDnnIsaIncludesBf16() {
  const auto effective = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
  return (effective & bf16) == bf16;
}
#endif

}  // namespace

absl::StatusOr<SequenceLayout> SequenceLayout::Padded(int64_t batch, int64_t padded_len,
                                                      std::vector<int64_t> lengths) {
  if (batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch: must be at least 1, got ", batch));
  }
  if (padded_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("padded_len: must be at least 1, got ", padded_len));
  }
  const std::optional<int64_t> rows = CheckedMul(batch, padded_len);
  if (!rows) {
    return absl::InvalidArgumentError(absl::StrCat("padded_len: batch ", batch, " * padded_len ",
                                                   padded_len, " overflows int64"));
  }
  if (lengths.empty()) {
    lengths.assign(static_cast<size_t>(batch), padded_len);
  } else if (static_cast<int64_t>(lengths.size()) != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("lengths: ", lengths.size(), " lengths for a batch of ", batch));
  }
  SequenceLayout layout;
  layout.offsets_.resize(lengths.size());
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1 || lengths[b] > padded_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "lengths[", b, "]: ", lengths[b], " is outside [1, padded_len ", padded_len, "]"));
    }
    layout.offsets_[b] = static_cast<int64_t>(b) * padded_len;
  }
  layout.lengths_ = std::move(lengths);
  layout.rows_ = *rows;
  layout.max_length_ = padded_len;
  layout.padded_ = true;
  return layout;
}

absl::StatusOr<SequenceLayout> SequenceLayout::Packed(std::vector<int64_t> lengths) {
  if (lengths.empty()) {
    return absl::InvalidArgumentError("lengths: a packed layout needs at least one sequence");
  }
  SequenceLayout layout;
  layout.offsets_.resize(lengths.size());
  int64_t rows = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", b, "]: must be at least 1, got ", lengths[b]));
    }
    layout.offsets_[b] = rows;
    if (__builtin_add_overflow(rows, lengths[b], &rows)) {
      return absl::InvalidArgumentError("lengths: the total length overflows int64");
    }
    layout.max_length_ = std::max(layout.max_length_, lengths[b]);
  }
  layout.lengths_ = std::move(lengths);
  layout.rows_ = rows;
  layout.padded_ = false;
  return layout;
}

bool SequenceLayout::is_uniform() const {
  return std::all_of(lengths_.begin(), lengths_.end(),
                     [this](int64_t length) { return length == max_length_; });
}

std::string PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
  }
  return absl::StrCat("unknown precision ", static_cast<int>(precision));
}

std::string BlockKernelsName(BlockKernels kernels) {
  switch (kernels) {
    case BlockKernels::kAuto:
      return "auto";
    case BlockKernels::kOneDnn:
      return "onednn";
  }
  return absl::StrCat("unknown block kernels ", static_cast<int>(kernels));
}

absl::StatusOr<BlockKernels> ParseBlockKernels(absl::string_view name) {
  for (BlockKernels kernels : {BlockKernels::kAuto, BlockKernels::kOneDnn}) {
    if (name == BlockKernelsName(kernels)) return kernels;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("block kernels: \"", name, "\" is neither \"auto\" nor \"onednn\""));
}

bool Bf16Supported() {
#ifdef ATTNSERVE_X86_INTRINSICS
  static const bool supported = internal::CpuHasAvx512Bf16() && OneDnnIsaIncludesBf16();
  return supported;
#else
  return false;
#endif
}

}  // namespace attnserve::core
