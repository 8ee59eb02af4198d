#include "server/observability/process_metrics.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The value of a "Name:  value [kB]" line of /proc/<pid>/status, in bytes
// when the line says kB.
std::optional<double> StatusValue(absl::string_view status, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, name) || !absl::ConsumePrefix(&line, ":")) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    int64_t value = 0;
    if (words.empty() || !absl::SimpleAtoi(words[0], &value)) return std::nullopt;
    const bool kib = words.size() > 1 && words[1] == "kB";
    return static_cast<double>(value) * (kib ? 1024.0 : 1.0);
  }
  return std::nullopt;
}

struct StatTimes {
  double cpu_seconds = 0;
  double start_seconds_after_boot = 0;
};

// /proc/<pid>/stat: "pid (comm) state ppid ...". comm may hold spaces and
// parentheses, so fields are counted after the last ')'. Of the fields
// (numbered from 1, as in proc(5)): 14 utime, 15 stime, 22 starttime, in
// clock ticks.
std::optional<StatTimes> ParseStat(absl::string_view stat, double ticks_per_second) {
  const size_t comm_end = stat.rfind(')');
  if (comm_end == absl::string_view::npos) return std::nullopt;
  std::vector<absl::string_view> fields =
      absl::StrSplit(stat.substr(comm_end + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state).
  constexpr size_t kUtime = 14 - 3, kStime = 15 - 3, kStartTime = 22 - 3;
  uint64_t utime = 0, stime = 0, start = 0;
  if (fields.size() <= kStartTime || !absl::SimpleAtoi(fields[kUtime], &utime) ||
      !absl::SimpleAtoi(fields[kStime], &stime) || !absl::SimpleAtoi(fields[kStartTime], &start)) {
    return std::nullopt;
  }
  return StatTimes{.cpu_seconds = static_cast<double>(utime + stime) / ticks_per_second,
                   .start_seconds_after_boot = static_cast<double>(start) / ticks_per_second};
}

// /proc/stat's "btime <seconds since the epoch>".
std::optional<double> BootTime(absl::string_view proc_stat) {
  for (absl::string_view line : absl::StrSplit(proc_stat, '\n')) {
    if (!absl::ConsumePrefix(&line, "btime ")) continue;
    int64_t seconds = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &seconds)) return std::nullopt;
    return static_cast<double>(seconds);
  }
  return std::nullopt;
}

// /proc/<pid>/limits: "Max open files  <soft>  <hard>  files".
std::optional<double> MaxOpenFiles(absl::string_view limits) {
  for (absl::string_view line : absl::StrSplit(limits, '\n')) {
    if (!absl::ConsumePrefix(&line, "Max open files")) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    int64_t soft = 0;
    if (words.empty() || !absl::SimpleAtoi(words[0], &soft)) return std::nullopt;  // "unlimited"
    return static_cast<double>(soft);
  }
  return std::nullopt;
}

std::optional<double> CountEntries(const std::string& dir) {
  std::error_code error;
  std::filesystem::directory_iterator it(dir, error);
  if (error) return std::nullopt;
  double entries = 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(error)) {
    if (error) return std::nullopt;
    ++entries;
  }
  return entries;
}

void Add(std::vector<prometheus::MetricFamily>& families, std::string name, std::string help,
         prometheus::MetricType type, std::optional<double> value) {
  if (!value) return;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = *value;
  } else {
    metric.gauge.value = *value;
  }
  families.push_back({.name = std::move(name),
                      .help = std::move(help),
                      .type = type,
                      .metric = {std::move(metric)}});
}

}  // namespace

ProcessCollector::ProcessCollector(std::string proc_root) : proc_root_(std::move(proc_root)) {}

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  using prometheus::MetricType;
  const std::string self = proc_root_ + "/self";
  std::optional<StatTimes> times;
  if (std::optional<std::string> stat = ReadFile(self + "/stat")) {
    times = ParseStat(*stat, static_cast<double>(sysconf(_SC_CLK_TCK)));
  }
  std::optional<double> boot_time;
  if (std::optional<std::string> proc_stat = ReadFile(proc_root_ + "/stat")) {
    boot_time = BootTime(*proc_stat);
  }
  const std::string status = ReadFile(self + "/status").value_or("");
  const std::string limits = ReadFile(self + "/limits").value_or("");

  std::vector<prometheus::MetricFamily> families;
  Add(families, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
      MetricType::Counter, times ? std::optional(times->cpu_seconds) : std::nullopt);
  Add(families, "process_start_time_seconds",
      "Start time of the process since unix epoch in seconds.", MetricType::Gauge,
      times && boot_time ? std::optional(*boot_time + times->start_seconds_after_boot)
                         : std::nullopt);
  Add(families, "process_resident_memory_bytes", "Resident memory size in bytes.",
      MetricType::Gauge, StatusValue(status, "VmRSS"));
  Add(families, "process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge,
      StatusValue(status, "VmSize"));
  Add(families, "process_threads", "Number of OS threads in the process.", MetricType::Gauge,
      StatusValue(status, "Threads"));
  Add(families, "process_open_fds", "Number of open file descriptors.", MetricType::Gauge,
      CountEntries(self + "/fd"));
  Add(families, "process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge,
      MaxOpenFiles(limits));
  return families;
}

}  // namespace attnserve::server
