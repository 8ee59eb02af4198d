// grpc_floor: what gRPC itself costs to carry a request's and a response's
// bytes over loopback on this machine -- the floor under any gRPC service's
// transport, attnserve's included. transport_benchmark.py prints it beside
// the loopback socket and attnserve's own round trip.
//
// Both ends do as little as gRPC allows: the server answers every unary call
// with the number of bytes the call's "response-bytes" metadata asks for,
// taken from one buffer made at start (slices that point into it: no copy,
// no allocation of payload per call), and never reads the request's bytes;
// the client sends its request from one buffer the same way and keeps the
// response as gRPC's slices (no copy into a message). The call styles are
// attnserve's: the server's callback API (attnserve's methods are callback
// methods on raw bytes), the client's call waited for on a completion queue of
// its own (attnctl's Attend). Linked with attnserve's allocator and settings:
// without them each call's read buffers are fresh pages, and the floor is
// not one (docs/measurements.md, "gRPC's own floor under the transport").
//
// A call may ask the server to hold its answer (--hold_us): the handler's
// thread then sleeps or, by default, reads memory on two threads for that
// long before answering -- the cost of a call that waits for a compute. It
// blocks one of gRPC's callback threads meanwhile, which is fine for one call
// at a time, the only way the client calls.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/command_line.h"

ABSL_FLAG(std::string, listen_address, "127.0.0.1:0",
          "serve: address to listen on (port 0: any free port, printed on stdout)");
ABSL_FLAG(std::string, target, "", "call: the grpc_floor server's host:port");
ABSL_FLAG(int64_t, request_bytes, 1 << 20, "call: bytes each request carries");
ABSL_FLAG(int64_t, response_bytes, 1 << 20, "call: bytes each response carries");
ABSL_FLAG(int64_t, calls, 20, "call: timed calls, one at a time on one connection");
ABSL_FLAG(int64_t, warm_up_calls, 5, "call: untimed calls before them");
ABSL_FLAG(int64_t, hold_us, 0,
          "call: ask the server to hold each answer this long (a stand-in for compute; "
          "the figures printed are then the round trip less it)");
ABSL_FLAG(std::string, hold_mode, "busy",
          "call: how the server holds: busy (two threads reading memory, as a compute "
          "would) or sleep (idle)");
ABSL_FLAG(int64_t, max_response_bytes, int64_t{256} << 20,
          "serve: the largest response served (the buffer made at start)");
ABSL_FLAG(std::vector<std::string>, int_arg, {},
          "serve and call: gRPC integer channel arguments, name=value, comma-separated "
          "(grpc.http2.max_frame_size=1048576): to try what a setting would change");

namespace {

constexpr char kUsage[] = R"(grpc_floor: gRPC's own cost of carrying bytes over loopback.

Usage: grpc_floor serve [--listen_address=127.0.0.1:0] [--int_arg=...]
         prints "grpc_floor: port N" once it serves; stops on SIGTERM/SIGINT.
       grpc_floor call --target=127.0.0.1:N --request_bytes=B --response_bytes=B
         [--calls=20] [--warm_up_calls=5] [--hold_us=0 [--hold_mode=busy|sleep]]
         [--int_arg=...]
         prints one line of JSON: the calls' median and minimum round trip, ms
         (less the hold).
)";

constexpr char kMethod[] = "/attnserve.floor.Floor/Carry";
constexpr char kResponseBytesKey[] = "response-bytes";
// Optional: how long the server holds the answer, in microseconds, standing in
// for a service's compute, and how: "sleep" (the handler's thread sleeps,
// the machine idles) or "busy" (two threads read through a buffer larger than
// the last-level cache for that long, as attnserve's two compute threads keep
// both cores and the memory busy while gRPC's threads wait).
constexpr char kHoldKey[] = "hold-us";
constexpr char kHoldModeKey[] = "hold-mode";
constexpr size_t kBusyBufferBytes = size_t{256} << 20;

// Integer channel arguments from --int_arg, for either end.
bool ParseIntArgs(std::vector<std::pair<std::string, int>>& out) {
  for (const std::string& item : absl::GetFlag(FLAGS_int_arg)) {
    const std::vector<std::string> parts = absl::StrSplit(item, absl::MaxSplits('=', 1));
    int value = 0;
    if (parts.size() != 2 || parts[0].empty() || !absl::SimpleAtoi(parts[1], &value)) {
      std::fprintf(stderr, "grpc_floor: --int_arg: '%s' is not name=integer\n", item.c_str());
      return false;
    }
    out.emplace_back(parts[0], value);
  }
  return true;
}

// A ByteBuffer of `bytes` bytes pointing into `source` (gRPC's static slices:
// no copy, no reference count; source outlives every call).
grpc::ByteBuffer BufferOver(const std::vector<char>& source, int64_t bytes) {
  const grpc::Slice slice(source.data(), static_cast<size_t>(bytes), grpc::Slice::STATIC_SLICE);
  return grpc::ByteBuffer(&slice, 1);
}

// Two threads (this one and one started here) sum their halves of a buffer
// larger than the last-level cache, over and over, until `hold` has passed.
void HoldBusy(std::chrono::microseconds hold) {
  static const std::vector<int64_t> buffer(kBusyBufferBytes / sizeof(int64_t), 1);
  const auto end = std::chrono::steady_clock::now() + hold;
  auto read = [&](size_t part) {
    const size_t half = buffer.size() / 2;
    const int64_t* data = buffer.data() + part * half;
    int64_t sum = 0;
    size_t i = 0;
    while (std::chrono::steady_clock::now() < end) {
      for (size_t stop = std::min(half, i + 8192); i < stop; ++i) sum += data[i];
      if (i == half) i = 0;
    }
    return sum;
  };
  int64_t other_sum = 0;
  std::thread other([&] { other_sum = read(1); });
  const int64_t sum = read(0);
  other.join();
  if (sum + other_sum == -1) std::fputs("", stderr);  // keeps the reads
}

class CarryReactor final : public grpc::ServerGenericBidiReactor {
 public:
  CarryReactor(grpc::GenericCallbackServerContext* context, const std::vector<char>& payload)
      : context_(context), payload_(payload) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    const auto& metadata = context_->client_metadata();
    const auto found = metadata.find(kResponseBytesKey);
    int64_t bytes = -1;
    if (found == metadata.end() ||
        !absl::SimpleAtoi(absl::string_view(found->second.data(), found->second.size()),
                          &bytes) ||
        bytes < 0 || bytes > static_cast<int64_t>(payload_.size())) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("metadata '", kResponseBytesKey, "': want 0..",
                                       payload_.size(), " bytes")));
      return;
    }
    if (const auto hold = metadata.find(kHoldKey); hold != metadata.end()) {
      int64_t us = 0;
      if (absl::SimpleAtoi(absl::string_view(hold->second.data(), hold->second.size()), &us) &&
          us > 0 && us < 10'000'000) {
        const auto mode = metadata.find(kHoldModeKey);
        if (mode != metadata.end() && mode->second == "busy") {
          HoldBusy(std::chrono::microseconds(us));
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(us));
        }
      }
    }
    response_ = BufferOver(payload_, bytes);
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  grpc::GenericCallbackServerContext* const context_;
  const std::vector<char>& payload_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
};

class CarryService final : public grpc::CallbackGenericService {
 public:
  explicit CarryService(int64_t max_response_bytes)
      : payload_(static_cast<size_t>(max_response_bytes), 'r') {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    return new CarryReactor(context, payload_);
  }

 private:
  const std::vector<char> payload_;
};

int Serve() {
  std::vector<std::pair<std::string, int>> int_args;
  if (!ParseIntArgs(int_args)) return attnserve::cli::kExitUsage;
  CarryService service(absl::GetFlag(FLAGS_max_response_bytes));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen_address), grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  for (const auto& [name, value] : int_args) builder.AddChannelArgument(name, value);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "grpc_floor: cannot listen on %s\n",
                 absl::GetFlag(FLAGS_listen_address).c_str());
    return attnserve::cli::kExitFailure;
  }
  std::printf("grpc_floor: port %d\n", port);
  std::fflush(stdout);
  server->Wait();  // until the process is stopped
  return attnserve::cli::kExitOk;
}

int Call() {
  std::vector<std::pair<std::string, int>> int_args;
  if (!ParseIntArgs(int_args)) return attnserve::cli::kExitUsage;
  const int64_t request_bytes = absl::GetFlag(FLAGS_request_bytes);
  const int64_t response_bytes = absl::GetFlag(FLAGS_response_bytes);
  const int64_t calls = absl::GetFlag(FLAGS_calls);
  const int64_t warm_up = absl::GetFlag(FLAGS_warm_up_calls);
  const int64_t hold_us = absl::GetFlag(FLAGS_hold_us);
  const std::string hold_mode = absl::GetFlag(FLAGS_hold_mode);
  if (absl::GetFlag(FLAGS_target).empty() || request_bytes < 0 || response_bytes < 0 ||
      calls < 1 || warm_up < 0 || hold_us < 0 || (hold_mode != "busy" && hold_mode != "sleep")) {
    return attnserve::cli::UsageError(
        "grpc_floor",
        "call needs --target, byte counts >= 0, --calls >= 1, --warm_up_calls >= 0, "
        "--hold_us >= 0 and --hold_mode busy or sleep");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  for (const auto& [name, value] : int_args) args.SetInt(name, value);
  const std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  const std::vector<char> payload(static_cast<size_t>(request_bytes), 'q');
  const grpc::ByteBuffer request = BufferOver(payload, request_bytes);
  const std::string asked = std::to_string(response_bytes);
  std::vector<double> ms;
  for (int64_t c = 0; c < warm_up + calls; ++c) {
    const auto start = std::chrono::steady_clock::now();
    grpc::ClientContext context;
    context.AddMetadata(kResponseBytesKey, asked);
    if (hold_us > 0) {
      context.AddMetadata(kHoldKey, std::to_string(hold_us));
      context.AddMetadata(kHoldModeKey, hold_mode);
    }
    grpc::CompletionQueue queue;
    grpc::ByteBuffer response;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&context, kMethod, request, &queue);
    call->StartCall();
    call->Finish(&response, &status, /*tag=*/&status);
    void* tag = nullptr;
    bool ok = false;
    const bool answered = queue.Next(&tag, &ok) && tag == &status && ok;
    const auto end = std::chrono::steady_clock::now();
    queue.Shutdown();
    while (queue.Next(&tag, &ok)) {
    }
    if (!answered || !status.ok()) {
      std::fprintf(stderr, "grpc_floor: call failed: %s\n", status.error_message().c_str());
      return attnserve::cli::kExitFailure;
    }
    if (static_cast<int64_t>(response.Length()) != response_bytes) {
      std::fprintf(stderr, "grpc_floor: response of %zu bytes, asked for %lld\n",
                   response.Length(), static_cast<long long>(response_bytes));
      return attnserve::cli::kExitFailure;
    }
    if (c >= warm_up) {
      ms.push_back(std::chrono::duration<double, std::milli>(end - start).count() -
                   static_cast<double>(hold_us) * 1e-3);
    }
  }
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  const double median = n % 2 == 1 ? ms[n / 2] : (ms[n / 2 - 1] + ms[n / 2]) / 2;
  std::printf("{\"median_ms\": %.4f, \"min_ms\": %.4f, \"calls\": %zu}\n", median, ms.front(), n);
  return attnserve::cli::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  const absl::StatusOr<attnserve::cli::CommandLine> command_line =
      attnserve::cli::ParseCommandLine(argc, argv);
  if (!command_line.ok()) {
    return attnserve::cli::UsageError("grpc_floor", command_line.status().message());
  }
  if (command_line->action != attnserve::cli::CommandLine::Action::kRun) {
    std::fputs(attnserve::cli::HelpText(kUsage).c_str(), stdout);
    return attnserve::cli::kExitOk;
  }
  const std::vector<std::string>& words = command_line->positional;
  if (words.size() == 1 && words[0] == "serve") return Serve();
  if (words.size() == 1 && words[0] == "call") return Call();
  return attnserve::cli::UsageError("grpc_floor", "say 'serve' or 'call'");
}
