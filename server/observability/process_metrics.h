#ifndef ATTNSERVE_SERVER_OBSERVABILITY_PROCESS_METRICS_H_
#define ATTNSERVE_SERVER_OBSERVABILITY_PROCESS_METRICS_H_

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <string>
#include <vector>

namespace attnserve::server {

// The standard `process_*` metrics of this process, read from Linux's /proc at
// every scrape (prometheus-cpp 1.0 has no process collector):
//   process_cpu_seconds_total      user + system CPU time       (self/stat)
//   process_start_time_seconds     start, seconds since the epoch (self/stat, stat's btime)
//   process_resident_memory_bytes  resident set size            (self/status VmRSS)
//   process_virtual_memory_bytes   virtual memory size          (self/status VmSize)
//   process_threads                OS threads                   (self/status Threads)
//   process_open_fds               open file descriptors        (entries of self/fd)
//   process_max_fds                the soft open-files limit    (self/limits)
// A value that cannot be read is left out of that scrape, never reported as 0.
//
// Thread-safe: it keeps no state but its constant proc root.
class ProcessCollector final : public prometheus::Collectable {
 public:
  // `proc_root` is where procfs is mounted: "/proc", or a fake tree in tests.
  explicit ProcessCollector(std::string proc_root = "/proc");

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::string proc_root_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_OBSERVABILITY_PROCESS_METRICS_H_
