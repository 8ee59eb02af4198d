#ifndef ATTNSERVE_CLIENT_ATTEND_REPORT_H_
#define ATTNSERVE_CLIENT_ATTEND_REPORT_H_

// What attnctl makes of an AttendResponse: the printed summary and the files
// asked for with --save_output, --save_maps and --maps_png.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "client/request_builder.h"

namespace attnserve::client {

// The summary of one call: what ran (model or ad-hoc layer, kernel, the
// precision that ran), the inputs (shapes, per-sequence lengths when ragged or
// packed, context, options), the output's shape and first values, the maps'
// row sums per head, and the head statistics table when asked for. Ends with
// a newline. Lines that cannot be decoded say so instead of failing.
std::string FormatAttendSummary(const AttendCall& call, const v1::AttendResponse& response);

// Per map (head, or the mean map): min .. max of the row sums over the
// sequences' real query rows (padding rows are 0 and skipped) and the largest
// weight. INVALID_ARGUMENT when the maps cannot be decoded.
absl::StatusOr<std::string> FormatMapSummary(const AttendCall& call, const v1::Tensor& maps);

// A table of entropy, maximum weight and contribution per head: one per
// sequence for up to 4 sequences, else the mean over the batch.
// INVALID_ARGUMENT when the statistics are not [batch, num_heads].
absl::StatusOr<std::string> FormatHeadStatistics(const AttendCall& call,
                                                 const v1::HeadStatistics& stats);

// Writes the files `options` asks for (output and maps as '<f4' .npy, the
// maps' heatmap as .png) and returns a line per file written. The first error
// (naming the file or the flag) otherwise.
absl::StatusOr<std::vector<std::string>> SaveAttendFiles(const AttendOptions& options,
                                                         const AttendCall& call,
                                                         const v1::AttendResponse& response);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_ATTEND_REPORT_H_
