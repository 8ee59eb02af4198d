#include "core/kernels/primitives.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "core/fork_grain.h"
#include "core/kernels/row_linear.h"
#include "core/kernels/workspace_state.h"
#include "core/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core::internal {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;

}  // namespace

dnnl::primitive_attr UserScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

absl::Status RunStep(WorkspaceState& workspace, const Step& step, Args args) {
  if (const size_t bytes = step.scratchpad.get_size(); bytes != 0) {
    ATTNSERVE_RETURN_IF_ERROR(workspace.scratchpad.Reserve(static_cast<int64_t>(bytes)));
    args.emplace(DNNL_ARG_SCRATCHPAD,
                 memory(step.scratchpad, workspace.engine, workspace.scratchpad.data()));
  }
  step.primitive.execute(workspace.stream, args);
  return absl::OkStatus();
}

memory Memory(const WorkspaceState& workspace, const memory::desc& desc, const void* data) {
  // oneDNN takes non-const handles; inputs are only read.
  return memory(desc, workspace.engine, const_cast<void*>(data));
}

absl::Status Linear(WorkspaceState& workspace, int64_t rows, int64_t in, int64_t out,
                    int64_t w_stride, bool bf16, const void* x, const void* w, const float* b,
                    void* y, int64_t y_stride, bool y_bf16) {
  if (rows == 1 && !bf16 && !y_bf16 && RowLinearTakes(in, out)) {
    const int64_t partials = static_cast<int64_t>(omp_get_max_threads() - 1) * out;
    ATTNSERVE_RETURN_IF_ERROR(
        workspace.scratchpad.Reserve(partials * static_cast<int64_t>(sizeof(float))));
    RowLinear(static_cast<const float*>(x), in, out, static_cast<const float*>(w), w_stride, b,
              static_cast<float*>(y), workspace.scratchpad.floats());
    return absl::OkStatus();
  }
  const memory::desc x_desc({rows, in}, OperandType(bf16), Tag::ab);
  const memory::desc w_desc({in, out}, OperandType(bf16), memory::dims{w_stride, 1});
  const memory::desc b_desc({1, out}, memory::data_type::f32, Tag::ab);
  const memory::desc y_desc({rows, out}, OperandType(y_bf16), memory::dims{y_stride, 1});
  const Step step = workspace.primitives.Get<dnnl::matmul>(
      {PrimitiveCache::kLinear, rows, in, out, w_stride, y_stride, bf16, y_bf16}, [&] {
        return dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_desc, w_desc, b_desc, y_desc),
                                            UserScratchpad(), workspace.engine);
      });
  return RunStep(workspace, step,
                 {{DNNL_ARG_SRC, Memory(workspace, x_desc, x)},
                  {DNNL_ARG_WEIGHTS, Memory(workspace, w_desc, w)},
                  {DNNL_ARG_BIAS, Memory(workspace, b_desc, b)},
                  {DNNL_ARG_DST, Memory(workspace, y_desc, y)}});
}

void ConvertToBf16(const float* from, int64_t n, Bf16* to) {
  constexpr int64_t kPiece = int64_t{1} << 14;  // small enough to share out evenly
  const int64_t pieces = (n + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static) if (n > kCopyForkGrain)
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t begin = piece * kPiece;
    FloatsToBf16(from + begin, std::min(kPiece, n - begin), to + begin);
  }
}

}  // namespace attnserve::core::internal
