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
#include "google/protobuf/message.h"

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

// `message` as one line of JSON in protobuf's JSON mapping: fields under their
// proto names (snake_case), default values included, enums by name, int64 as
// strings. The one JSON writer of attnctl's --json outputs. INTERNAL if
// protobuf cannot print it.
absl::StatusOr<std::string> JsonLine(const google::protobuf::Message& message);

// A protobuf Duration in milliseconds.
double DurationMillis(const google::protobuf::Duration& d);
// A protobuf Duration as absl::FormatDuration writes it ("1.5ms", "30s").
std::string DurationText(const google::protobuf::Duration& d);

// `attnctl attend --json`: one JSON object (one line) of what the server
// returned -- model, kernel_path, precision (enum name); output and
// attention_maps as dtype and shape (their values go to --save_output and
// --save_maps); head_statistics decoded, [batch][num_heads] each; the last
// call's timing as "server" {queue_ms, compute_ms, batch_size, batch_tokens}
// -- and of the calls: input_source, "calls", their round trips as
// "latency_ms" {p50, p90, p99, max, mean} (the names bench --json uses), each
// call's round trip minus the compute its response reports as "transport_ms"
// {p50, mean} (what the wire and both ends' gRPC cost), and "files"
// (SaveAttendFiles' lines). `latencies_ms`: one per call, ascending;
// `transports_ms`: one per call, ascending. INTERNAL if the JSON cannot be
// printed.
absl::StatusOr<std::string> FormatAttendJson(const AttendCall& call,
                                             const v1::AttendResponse& response,
                                             const std::vector<double>& latencies_ms,
                                             const std::vector<double>& transports_ms,
                                             const std::vector<std::string>& files);

// Writes the files `options` asks for (output and maps as '<f4' .npy, the
// maps' heatmap as .png) and returns a line per file written. The first error
// (naming the file or the flag) otherwise.
absl::StatusOr<std::vector<std::string>> SaveAttendFiles(const AttendOptions& options,
                                                         const AttendCall& call,
                                                         const v1::AttendResponse& response);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_ATTEND_REPORT_H_
