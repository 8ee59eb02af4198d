#ifndef ATTNSERVE_CLI_FILE_IO_H_
#define ATTNSERVE_CLI_FILE_IO_H_

// Whole-file reads and writes for attnctl's .npy and .png files.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::cli {

// The contents of the file at `path`. On failure the errno-derived code
// (NOT_FOUND for a missing file, PERMISSION_DENIED, ...) with a message that
// names the path.
absl::StatusOr<std::string> ReadFileBytes(const std::string& path);

// Replaces the file at `path` with `bytes`. On failure the errno-derived code
// with a message that names the path.
absl::Status WriteFileBytes(const std::string& path, absl::string_view bytes);

}  // namespace attnserve::cli

#endif  // ATTNSERVE_CLI_FILE_IO_H_
