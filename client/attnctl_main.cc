// attnctl: the command-line client of attnserve.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"

ABSL_FLAG(std::string, target, "localhost:50051", "attnserve gRPC address");
ABSL_FLAG(double, timeout_seconds, 30, "Deadline of each call");
ABSL_FLAG(std::string, model, "default", "attend/model: the model to use");
ABSL_FLAG(int64_t, batch, 1, "attend: sequences in the request");
ABSL_FLAG(int64_t, seq, 16, "attend: tokens per sequence");
ABSL_FLAG(std::string, maps, "none", "attend: attention maps to return: none, per-head or mean");
ABSL_FLAG(uint64_t, seed, 1, "attend: seed of the random hidden states (normal, std 1)");
ABSL_FLAG(int64_t, repeat, 1,
          "attend: send the request this many times and report latency percentiles");
ABSL_FLAG(std::string, service, "",
          "health: the service to check (\"\" = the whole server, or "
          "attnserve.v1.AttentionService)");

namespace attnserve::client {
namespace {

constexpr char kUsage[] = R"(attnctl: talk to an attnserve server.

Usage: attnctl <command> [--target=host:port] [flags]
Commands:
  models                  list the loaded models and their head configurations
  model --model=M         describe one model
  attend --model=M --batch=B --seq=S [--maps=none|per-head|mean] [--repeat=N]
                          send random hidden states, print shapes, timing, a few
                          output values and per-head map row sums; with --repeat,
                          latency percentiles of N calls
  health [--service=S]    print the server's health (exit 0 only when SERVING)
)";

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "attnctl: %s\n", status.ToString().c_str());
  return 1;
}

std::string DurationText(const google::protobuf::Duration& d) {
  return absl::FormatDuration(absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos()));
}

void PrintModel(const v1::ModelInfo& model) {
  const v1::HeadConfig& h = model.head_config();
  std::printf("%s\n  d_model %d, heads %d, kv heads %d, head_dim %d, scale %.6g\n",
              model.name().c_str(), h.d_model(), h.num_heads(), h.num_kv_heads(), h.head_dim(),
              h.scale());
  std::printf("  limits: batch <= %lld, seq <= %lld, maps <= %lld bytes\n",
              static_cast<long long>(model.limits().max_batch()),
              static_cast<long long>(model.limits().max_seq_len()),
              static_cast<long long>(model.limits().max_attention_map_bytes()));
  if (!model.description().empty()) std::printf("  %s\n", model.description().c_str());
}

int RunModels(const AttentionClient& client) {
  absl::StatusOr<v1::ListModelsResponse> models = client.ListModels();
  if (!models.ok()) return Fail(models.status());
  if (models->models().empty()) std::printf("(no models loaded)\n");
  for (const v1::ModelInfo& model : models->models()) PrintModel(model);
  return 0;
}

int RunModel(const AttentionClient& client) {
  absl::StatusOr<v1::ModelInfo> model = client.GetModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  PrintModel(*model);
  return 0;
}

int RunHealth(const AttentionClient& client) {
  auto status = client.CheckHealth(absl::GetFlag(FLAGS_service));
  if (!status.ok()) return Fail(status.status());
  std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

absl::StatusOr<v1::AttentionMapMode> ParseMaps(const std::string& text) {
  if (text == "none") return v1::ATTENTION_MAP_MODE_NONE;
  if (text == "per-head") return v1::ATTENTION_MAP_MODE_PER_HEAD;
  if (text == "mean") return v1::ATTENTION_MAP_MODE_MEAN;
  return absl::InvalidArgumentError(
      absl::StrCat("--maps: '", text, "' is not one of none, per-head, mean"));
}

// Per-head summary of map rows: each row should sum to 1.
void PrintMapSummary(const v1::Tensor& maps) {
  absl::StatusOr<std::vector<float>> values = TensorValues(maps);
  if (!values.ok()) {
    std::printf("maps: cannot decode: %s\n", values.status().ToString().c_str());
    return;
  }
  const auto& shape = maps.shape();
  const int64_t seq_kv = shape[shape.size() - 1];
  const int64_t seq_q = shape[shape.size() - 2];
  const int64_t heads = shape.size() == 4 ? shape[1] : 1;
  const int64_t batch = shape[0];
  std::printf("attention maps [%s]: row sums per %s (min .. max over rows)\n",
              absl::StrJoin(shape, ", ").c_str(), heads > 1 ? "head" : "map");
  for (int64_t h = 0; h < heads; ++h) {
    double lo = INFINITY, hi = -INFINITY, max_weight = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < seq_q; ++i) {
        const float* row = values->data() + ((b * heads + h) * seq_q + i) * seq_kv;
        double sum = 0;
        for (int64_t j = 0; j < seq_kv; ++j) {
          sum += row[j];
          max_weight = std::max<double>(max_weight, row[j]);
        }
        lo = std::min(lo, sum);
        hi = std::max(hi, sum);
      }
    }
    std::printf("  %s %2lld: %.7f .. %.7f   largest weight %.4f\n",
                shape.size() == 4 ? "head" : "mean", static_cast<long long>(h), lo, hi, max_weight);
  }
}

// A one-line progress bar on stderr, redrawn in place when it is a terminal.
void ShowProgress(int64_t done, int64_t total) {
  if (!isatty(STDERR_FILENO) || total < 2) return;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / total);
  std::fprintf(stderr, "\r[%s%s] %lld/%lld", std::string(filled, '=').c_str(),
               std::string(kWidth - filled, ' ').c_str(), static_cast<long long>(done),
               static_cast<long long>(total));
  if (done == total) std::fprintf(stderr, "\n");
}

int RunAttend(const AttentionClient& client) {
  absl::StatusOr<v1::AttentionMapMode> maps = ParseMaps(absl::GetFlag(FLAGS_maps));
  if (!maps.ok()) return Fail(maps.status());
  const int64_t batch = absl::GetFlag(FLAGS_batch), seq = absl::GetFlag(FLAGS_seq);
  const int64_t repeat = absl::GetFlag(FLAGS_repeat);
  if (batch <= 0 || seq <= 0 || repeat <= 0) {
    return Fail(absl::InvalidArgumentError("--batch, --seq and --repeat must be positive"));
  }
  absl::StatusOr<v1::ModelInfo> model = client.GetModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  const int64_t d_model = model->head_config().d_model();

  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> input(batch * seq * d_model);
  for (float& x : input) x = normal(rng);
  const v1::AttendRequest request =
      MakeAttendRequest(model->name(), input, batch, seq, d_model, *maps);

  std::vector<double> latencies_ms;
  absl::StatusOr<v1::AttendResponse> response;
  for (int64_t i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    response = client.Attend(request);
    latencies_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    if (!response.ok()) return Fail(response.status());
    ShowProgress(i + 1, repeat);
  }

  std::printf("model %s, kernel %s\n", response->model().c_str(), response->kernel_path().c_str());
  std::printf("input  [%lld, %lld, %lld] FP32 (seed %llu)\n", static_cast<long long>(batch),
              static_cast<long long>(seq), static_cast<long long>(d_model),
              static_cast<unsigned long long>(absl::GetFlag(FLAGS_seed)));
  std::printf("output [%s] %s\n", absl::StrJoin(response->output().shape(), ", ").c_str(),
              response->output().dtype() == v1::DATA_TYPE_FP32 ? "FP32" : "?");
  absl::StatusOr<std::vector<float>> output = TensorValues(response->output());
  if (!output.ok()) return Fail(output.status());
  std::printf("output[0, 0, :6] =");
  for (int64_t j = 0; j < std::min<int64_t>(6, d_model); ++j) std::printf(" %+.5f", (*output)[j]);
  std::printf("\n");
  if (response->has_attention_maps()) PrintMapSummary(response->attention_maps());
  std::printf("server: queue %s, compute %s\n", DurationText(response->timing().queue()).c_str(),
              DurationText(response->timing().compute()).c_str());

  std::sort(latencies_ms.begin(), latencies_ms.end());
  auto percentile = [&](double p) {
    const size_t index = static_cast<size_t>(std::ceil(p / 100.0 * latencies_ms.size())) - 1;
    return latencies_ms[std::min(index, latencies_ms.size() - 1)];
  };
  if (repeat == 1) {
    std::printf("round trip %.3f ms\n", latencies_ms[0]);
  } else {
    std::printf("round trip over %lld calls: p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, max %.3f ms\n",
                static_cast<long long>(repeat), percentile(50), percentile(90), percentile(99),
                latencies_ms.back());
  }
  return 0;
}

}  // namespace
}  // namespace attnserve::client

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(attnserve::client::kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s", attnserve::client::kUsage);
    return 2;
  }
  const std::string command = args[1];
  attnserve::client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout_seconds = absl::GetFlag(FLAGS_timeout_seconds);
  auto client = attnserve::client::AttentionClient::Create(options);
  if (!client.ok()) return attnserve::client::Fail(client.status());
  if (command == "models") return attnserve::client::RunModels(**client);
  if (command == "model") return attnserve::client::RunModel(**client);
  if (command == "attend") return attnserve::client::RunAttend(**client);
  if (command == "health") return attnserve::client::RunHealth(**client);
  std::fprintf(stderr, "attnctl: unknown command '%s'\n\n%s", command.c_str(),
               attnserve::client::kUsage);
  return 2;
}
