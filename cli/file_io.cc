#include "cli/file_io.h"

#include <cerrno>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"

namespace attnserve::cli {
namespace {

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};
using FilePtr = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  FilePtr file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot open"));
  std::string bytes;
  char buffer[1 << 16];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file.get())) > 0) bytes.append(buffer, n);
  if (std::ferror(file.get()))
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot read"));
  return bytes;
}

absl::Status WriteFileBytes(const std::string& path, absl::string_view bytes) {
  FilePtr file(std::fopen(path.c_str(), "wb"));
  if (file == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot create"));
  }
  if (std::fwrite(bytes.data(), 1, bytes.size(), file.get()) != bytes.size()) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot write"));
  }
  // fclose flushes: its failure (e.g. a full disk) is a failed write too.
  if (std::fclose(file.release()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat(path, ": cannot write"));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::cli
