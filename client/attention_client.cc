#include "client/attention_client.h"

#include <arpa/inet.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include <grpcpp/create_channel.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/client_callback.h>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/file_io.h"
#include "client/map_assembler.h"

namespace attnserve::client {

using ::attnserve::cli::ReadFileBytes;

namespace {

// The generic stub's calls keep a pointer to the method's name in the call's
// ClientRpcInfo (for interceptors) for as long as the call lives: a string
// that outlives every call.
const std::string& AttendMethod() {
  static const std::string* const method = new std::string("/attnserve.v1.AttentionService/Attend");
  return *method;
}

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// The call's deadline: --timeout_seconds from now.
void SetCallDeadline(const ClientOptions& options, grpc::ClientContext& context) {
  context.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::microseconds(static_cast<int64_t>(options.timeout_seconds * 1e6)));
}

// One blocking unary call with a deadline `timeout_seconds` from now.
template <typename Response, typename Stub, typename Request>
absl::StatusOr<Response> Call(Stub& stub,
                              grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                           Response*),
                              const Request& request, const ClientOptions& options,
                              bool with_token = true) {
  grpc::ClientContext context;
  if (with_token) AddCallMetadata(options, context);
  SetCallDeadline(options, context);
  Response response;
  grpc::Status status = (stub.*method)(&context, request, &response);
  if (!status.ok()) {
    return ExplainMessageSizeError(FromGrpc(status), static_cast<int64_t>(request.ByteSizeLong()),
                                   options.max_receive_message_bytes);
  }
  return response;
}

// gRPC's words for a message over a receive limit (message_size filter).
constexpr absl::string_view kLargerThanMax = "Received message larger than max (";

// Requests up to this size stay retryable: the server's default
// --max_receive_message_bytes. The buffer holds a call's request only while
// the call is in flight.
constexpr int kRetryBufferBytes = 64 << 20;

enum class AddressFamily { kIpv4, kIpv6 };

// The family of "a.b.c.d:port" or "[v6]:port" (a port in 1..65535), or none.
std::optional<AddressFamily> IpAddressWithPort(absl::string_view entry) {
  const size_t colon = entry.rfind(':');
  if (colon == absl::string_view::npos) return std::nullopt;
  absl::string_view host = entry.substr(0, colon);
  int port = 0;
  if (!absl::SimpleAtoi(entry.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return std::nullopt;
  }
  unsigned char address[sizeof(in6_addr)];
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    const std::string v6(host.substr(1, host.size() - 2));
    if (inet_pton(AF_INET6, v6.c_str(), address) == 1) return AddressFamily::kIpv6;
    return std::nullopt;
  }
  if (inet_pton(AF_INET, std::string(host).c_str(), address) == 1) return AddressFamily::kIpv4;
  return std::nullopt;
}

// A service config duration: decimal seconds with an "s" ("0.050000s").
std::string JsonDuration(double seconds) { return absl::StrFormat("\"%.6fs\"", seconds); }

// The resolvers gRPC 1.51 registers; a target starting with one is a URI.
constexpr absl::string_view kUriSchemes[] = {
    "dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "xds:"};

// The PEM file of `field`, INVALID_ARGUMENT naming the field if unreadable.
absl::StatusOr<std::string> ReadPem(absl::string_view field, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadFileBytes(path);
  if (!pem.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tls.", field, ": ", pem.status().message()));
  }
  return pem;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TlsOptions& tls, grpc::ChannelArguments& args) {
  if (!tls.enabled) return grpc::InsecureChannelCredentials();
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError("tls.cert_file, tls.key_file: give both or neither");
  }
  grpc::SslCredentialsOptions ssl;
  if (!tls.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("ca_file", tls.ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem("cert_file", tls.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem("key_file", tls.key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  if (!tls.server_name.empty()) {
    args.SetSslTargetNameOverride(tls.server_name);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

void AddCallMetadata(const ClientOptions& options, grpc::ClientContext& context) {
  if (!options.bearer_token.empty()) {
    context.AddMetadata("authorization", "Bearer " + options.bearer_token);
  }
  if (!options.routing_key.empty()) context.AddMetadata(kRoutingKeyHeader, options.routing_key);
}

namespace {

// The bearer token, the routing key and the deadline of a call.
void PrepareCall(const ClientOptions& options, grpc::ClientContext& context) {
  AddCallMetadata(options, context);
  SetCallDeadline(options, context);
}

}  // namespace

absl::Status ExplainMessageSizeError(const absl::Status& status, int64_t request_bytes,
                                     int64_t client_limit) {
  if (status.code() != absl::StatusCode::kResourceExhausted) return status;
  // "Received message larger than max (<size> vs. <limit>)"
  const absl::string_view message = status.message();
  const size_t at = message.find(kLargerThanMax);
  if (at == absl::string_view::npos) return status;
  absl::string_view numbers = message.substr(at + kLargerThanMax.size());
  numbers = numbers.substr(0, numbers.find(')'));
  const std::vector<absl::string_view> parts = absl::StrSplit(numbers, " vs. ");
  int64_t size = 0, limit = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &size) ||
      !absl::SimpleAtoi(parts[1], &limit)) {
    return status;
  }
  // The request's own size names the server's limit; a limit equal to ours
  // (with another size) names this client's.
  const bool request = size == request_bytes;
  const bool response = limit == client_limit && !request;
  std::string explained;
  if (request) {
    explained = absl::StrCat(
        "the request (", size, " bytes) is over the server's limit of ", limit,
        " bytes (attnserve --max_receive_message_bytes): send less per call (fewer or shorter "
        "sequences) or raise the server's --max_receive_message_bytes");
  } else if (response) {
    explained = absl::StrCat(
        "the response (", size, " bytes) is over this client's limit of ", limit,
        " bytes (--max_receive_message_bytes): ask for less per call (fewer or shorter "
        "sequences, fewer attention maps: --heads, --rows, --maps=mean) or raise this client's "
        "--max_receive_message_bytes");
  } else {
    explained = absl::StrCat(
        "a message (", size, " bytes) is over a limit of ", limit,
        " bytes: the request over the server's (attnserve --max_receive_message_bytes) or the "
        "response over this client's (--max_receive_message_bytes); send or ask for less per "
        "call, or raise the limit");
  }
  return absl::ResourceExhaustedError(absl::StrCat(explained, " (gRPC: ", message, ")"));
}

absl::StatusOr<std::string> ChannelTarget(absl::string_view target) {
  target = absl::StripAsciiWhitespace(target);
  if (target.empty()) return absl::InvalidArgumentError("target: required");
  for (absl::string_view scheme : kUriSchemes) {
    if (absl::StartsWith(target, scheme)) return std::string(target);
  }
  if (!absl::StrContains(target, ',')) return std::string(target);
  std::vector<std::string> entries;
  std::optional<AddressFamily> family;
  for (absl::string_view entry : absl::StrSplit(target, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("target: empty entry in '", target, "'"));
    }
    const std::optional<AddressFamily> entry_family = IpAddressWithPort(entry);
    if (!entry_family.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target: '", entry,
          "' is not an IP address with a port; a list of replicas takes IP addresses "
          "(a.b.c.d:port or [v6]:port), for names use one DNS name that resolves to every "
          "replica (dns:///name:port)"));
    }
    if (family.has_value() && *family != *entry_family) {
      return absl::InvalidArgumentError("target: a list mixes IPv4 and IPv6 addresses");
    }
    family = entry_family;
    entries.emplace_back(entry);
  }
  return absl::StrCat(*family == AddressFamily::kIpv4 ? "ipv4:" : "ipv6:",
                      absl::StrJoin(entries, ","));
}

absl::StatusOr<std::string> ServiceConfigJson(const ClientOptions& options) {
  const std::string& policy = options.lb_policy;
  if (!policy.empty() && policy != "pick_first" && policy != "round_robin") {
    return absl::InvalidArgumentError(
        absl::StrCat("lb_policy: '", policy, "' is not one of pick_first, round_robin (or empty)"));
  }
  for (char c : options.health_check_service) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_') {
      return absl::InvalidArgumentError(
          "health_check_service: a service name is letters, digits, '.' and '_'");
    }
  }
  const RetryOptions& retry = options.retry;
  if (retry.max_attempts < 1 || retry.max_attempts > 5) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_attempts: ", retry.max_attempts, " is outside [1, 5] (1: no retries)"));
  }
  if (!(retry.initial_backoff_seconds > 0 && retry.initial_backoff_seconds <= 3600) ||
      !(retry.max_backoff_seconds > 0 && retry.max_backoff_seconds <= 3600)) {
    return absl::InvalidArgumentError("backoff: seconds must be in (0, 3600]");
  }
  if (!(retry.backoff_multiplier > 0 && retry.backoff_multiplier <= 100)) {
    return absl::InvalidArgumentError("backoff_multiplier: must be in (0, 100]");
  }

  std::vector<std::string> fields;
  if (!policy.empty()) {
    fields.push_back(absl::StrCat("\"loadBalancingConfig\": [{\"", policy, "\": {}}]"));
  }
  // pick_first ignores health checking; round_robin sends calls only to
  // backends whose Watch says SERVING.
  if (policy == "round_robin" && !options.health_check_service.empty()) {
    fields.push_back(absl::StrCat("\"healthCheckConfig\": {\"serviceName\": \"",
                                  options.health_check_service, "\"}"));
  }
  if (retry.max_attempts > 1) {
    // UNAVAILABLE is what a replica that stops, drains or cannot be reached
    // answers; Attend is a pure function of its request, so running it again
    // elsewhere is safe. Other codes are the request's own fault or final.
    fields.push_back(absl::StrCat(
        "\"methodConfig\": [{\"name\": [{\"service\": \"",
        v1::AttentionService::service_full_name(), "\"}, {\"service\": \"",
        grpc::health::v1::Health::service_full_name(), "\"}], \"retryPolicy\": {\"maxAttempts\": ",
        retry.max_attempts, ", \"initialBackoff\": ", JsonDuration(retry.initial_backoff_seconds),
        ", \"maxBackoff\": ", JsonDuration(retry.max_backoff_seconds),
        ", \"backoffMultiplier\": ", absl::StrFormat("%g", retry.backoff_multiplier),
        ", \"retryableStatusCodes\": [\"UNAVAILABLE\"]}}]"));
  }
  return absl::StrCat("{", absl::StrJoin(fields, ", "), "}");
}

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Create(
    const ClientOptions& options) {
  absl::StatusOr<std::string> target = ChannelTarget(options.target);
  if (!target.ok()) return target.status();
  if (!(options.timeout_seconds > 0)) {
    return absl::InvalidArgumentError("timeout_seconds: must be positive");
  }
  if (options.max_receive_message_bytes <= 0 ||
      options.max_receive_message_bytes > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_receive_message_bytes: ", options.max_receive_message_bytes,
                     " is outside [1, ", std::numeric_limits<int>::max(), "]"));
  }
  if (!options.routing_key.empty() &&
      !absl::c_all_of(options.routing_key, [](char c) { return c >= ' ' && c <= '~'; })) {
    return absl::InvalidArgumentError(
        "routing_key: printable ASCII only (it travels as a header value)");
  }
  absl::StatusOr<std::string> service_config = ServiceConfigJson(options);
  if (!service_config.ok()) return service_config.status();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_receive_message_bytes));
  args.SetMaxSendMessageSize(-1);
  args.SetServiceConfigJSON(*service_config);
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, options.retry.max_attempts > 1 ? 1 : 0);
  // A call is retried only while its request fits the retry buffer (256 KiB
  // by default); Attend requests are often larger.
  args.SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE, kRetryBufferBytes);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentials(options.tls, args);
  if (!credentials.ok()) return credentials.status();
  auto channel = grpc::CreateCustomChannel(*target, *credentials, args);
  return std::unique_ptr<AttentionClient>(new AttentionClient(options, std::move(channel)));
}

AttentionClient::AttentionClient(const ClientOptions& options,
                                 std::shared_ptr<grpc::Channel> channel)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::AttentionService::NewStub(channel_)),
      attend_bytes_stub_(std::make_unique<BytesToAttendResponseStub>(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

absl::StatusOr<v1::ListModelsResponse> AttentionClient::ListModels() const {
  return Call(*stub_, &v1::AttentionService::Stub::ListModels, v1::ListModelsRequest(), options_);
}

absl::StatusOr<v1::ModelInfo> AttentionClient::GetModel(absl::string_view name) const {
  v1::GetModelRequest request;
  request.set_name(std::string(name));
  return Call(*stub_, &v1::AttentionService::Stub::GetModel, request, options_);
}

absl::StatusOr<v1::LoadModelResponse> AttentionClient::LoadModel(absl::string_view name) const {
  v1::LoadModelRequest request;
  request.set_name(std::string(name));
  return Call(*stub_, &v1::AttentionService::Stub::LoadModel, request, options_);
}

absl::Status AttentionClient::UnloadModel(absl::string_view name) const {
  v1::UnloadModelRequest request;
  request.set_name(std::string(name));
  return Call(*stub_, &v1::AttentionService::Stub::UnloadModel, request, options_).status();
}

absl::StatusOr<v1::AttendResponse> AttentionClient::Attend(const v1::AttendRequest& request) const {
  return Call(*stub_, &v1::AttentionService::Stub::Attend, request, options_);
}

absl::StatusOr<v1::AttendResponse> AttentionClient::Attend(const WireRequest& request) const {
  v1::AttendResponse response;
  if (absl::Status status = Attend(request, &response); !status.ok()) return status;
  return response;
}

absl::Status AttentionClient::Attend(const WireRequest& request,
                                     v1::AttendResponse* response) const {
  grpc::ClientContext context;
  PrepareCall(options_, context);
  const grpc::ByteBuffer bytes = request.Bytes();
  // The request as bytes: gRPC takes the ByteBuffer's slices as they are (no
  // copy). Waited for on this thread, on a queue of the call's own, as the
  // generated stub's blocking calls do.
  grpc::CompletionQueue queue;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::AttendResponse>> call =
      attend_bytes_stub_->PrepareUnaryCall(&context, AttendMethod(), bytes, &queue);
  call->StartCall();
  // gRPC parses into the message as it is (protobuf's parse clears it
  // first, which keeps its strings' capacity).
  call->Finish(response, &status, /*tag=*/&status);
  void* tag = nullptr;
  bool ok = false;
  // Finish's tag always comes back, ok, once the call has ended.
  const bool answered = queue.Next(&tag, &ok) && tag == &status && ok;
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  if (!answered) {
    return absl::InternalError("Attend: the call's completion queue ended without its answer");
  }
  if (!status.ok()) {
    return ExplainMessageSizeError(FromGrpc(status), request.size(),
                                   options_.max_receive_message_bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Session> AttentionClient::OpenSession(
    const v1::OpenSessionRequest& request) const {
  return Call(*stub_, &v1::AttentionService::Stub::OpenSession, request, options_);
}

absl::StatusOr<v1::ExtendResponse> AttentionClient::Extend(const v1::ExtendRequest& request) const {
  return Call(*stub_, &v1::AttentionService::Stub::Extend, request, options_);
}

std::unique_ptr<ExtendStream> AttentionClient::OpenExtendStream(double timeout_seconds) const {
  const absl::Time deadline = timeout_seconds > 0 ? absl::Now() + absl::Seconds(timeout_seconds)
                                                  : absl::InfiniteFuture();
  return std::unique_ptr<ExtendStream>(new ExtendStream(
      *stub_, options_, deadline, options_.max_receive_message_bytes));
}

absl::StatusOr<v1::Session> AttentionClient::GetSession(absl::string_view session_id) const {
  v1::GetSessionRequest request;
  request.set_session_id(std::string(session_id));
  return Call(*stub_, &v1::AttentionService::Stub::GetSession, request, options_);
}

absl::StatusOr<v1::Session> AttentionClient::ForkSession(absl::string_view session_id) const {
  v1::ForkSessionRequest request;
  request.set_session_id(std::string(session_id));
  return Call(*stub_, &v1::AttentionService::Stub::ForkSession, request, options_);
}

absl::StatusOr<v1::Session> AttentionClient::TruncateSession(
    const v1::TruncateSessionRequest& request) const {
  return Call(*stub_, &v1::AttentionService::Stub::TruncateSession, request, options_);
}

absl::Status AttentionClient::CloseSession(absl::string_view session_id) const {
  v1::CloseSessionRequest request;
  request.set_session_id(std::string(session_id));
  return Call(*stub_, &v1::AttentionService::Stub::CloseSession, request, options_).status();
}

absl::StatusOr<v1::LatestAttention> AttentionClient::GetLatestAttention(
    absl::string_view session_id, int layer) const {
  v1::LatestAttentionRequest request;
  request.set_session_id(std::string(session_id));
  request.set_layer(layer);
  return Call(*stub_, &v1::AttentionService::Stub::GetLatestAttention, request, options_);
}

absl::StatusOr<v1::AttendResponse> AttentionClient::AttendStream(
    const v1::AttendRequest& request, int64_t* chunks) const {
  grpc::ClientContext context;
  PrepareCall(options_, context);
  std::unique_ptr<grpc::ClientReader<v1::AttendStreamResponse>> reader =
      stub_->AttendStream(&context, request);
  MapAssembler assembler;
  absl::Status assembled;
  v1::AttendStreamResponse message;
  while (reader->Read(&message)) {
    if (assembled.ok()) assembled = assembler.Add(message);
    if (!assembled.ok()) context.TryCancel();  // read on to the end the cancel brings
  }
  const grpc::Status status = reader->Finish();
  if (!assembled.ok()) return assembled;
  if (!status.ok()) {
    return ExplainMessageSizeError(FromGrpc(status), static_cast<int64_t>(request.ByteSizeLong()),
                                   options_.max_receive_message_bytes);
  }
  if (chunks != nullptr) *chunks = assembler.chunks();
  return assembler.Finish();
}

void AttentionClient::AttendAsync(grpc::ClientContext* context, const v1::AttendRequest* request,
                                  v1::AttendResponse* response,
                                  std::function<void(grpc::Status)> done) const {
  PrepareCall(options_, *context);
  stub_->async()->Attend(context, request, response, std::move(done));
}

void AttentionClient::AttendAsync(grpc::ClientContext* context, const WireRequest* request,
                                  v1::AttendResponse* response,
                                  std::function<void(grpc::Status)> done) const {
  PrepareCall(options_, *context);
  // The slices hold `request`'s bytes; the ByteBuffer lives until done.
  auto bytes = std::make_shared<grpc::ByteBuffer>(request->Bytes());
  attend_bytes_stub_->UnaryCall(
      context, AttendMethod(), grpc::StubOptions(), bytes.get(), response,
      [bytes, done = std::move(done)](grpc::Status status) { done(std::move(status)); });
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> AttentionClient::CheckHealth(
    absl::string_view service) const {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  // Health checks go without the token (the server leaves them open).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      Call(*health_stub_, &grpc::health::v1::Health::Stub::Check, request, options_,
           /*with_token=*/false);
  if (!response.ok()) return response.status();
  return response->status();
}

v1::AttendRequest MakeAttendRequest(absl::string_view model, absl::Span<const float> hidden_states,
                                    int64_t batch, int64_t seq, int64_t d_model,
                                    v1::AttentionMapMode maps) {
  v1::AttendRequest request;
  request.set_model(std::string(model));
  v1::Tensor* tensor = request.mutable_hidden_states();
  tensor->set_dtype(v1::DATA_TYPE_FP32);
  tensor->add_shape(batch);
  tensor->add_shape(seq);
  tensor->add_shape(d_model);
  tensor->set_raw_data(reinterpret_cast<const char*>(hidden_states.data()),
                       hidden_states.size() * sizeof(float));
  request.mutable_attention_maps()->set_mode(maps);
  return request;
}

absl::StatusOr<std::vector<float>> TensorValues(const v1::Tensor& tensor) {
  const bool bf16 = tensor.dtype() == v1::DATA_TYPE_BF16;
  if (tensor.dtype() != v1::DATA_TYPE_FP32 && !bf16) {
    return absl::InvalidArgumentError("tensor: only FP32 and BF16 tensors are decoded");
  }
  int64_t elements = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0 || (d > 0 && elements > INT64_MAX / 4 / d)) {
      return absl::InvalidArgumentError("tensor.shape: invalid");
    }
    elements *= d;
  }
  if (tensor.float_data_size() > 0) {
    if (bf16) return absl::InvalidArgumentError("tensor.float_data: BF16 travels as raw_data");
    if (tensor.float_data_size() != elements) {
      return absl::InvalidArgumentError("tensor.float_data: size does not match shape");
    }
    return std::vector<float>(tensor.float_data().begin(), tensor.float_data().end());
  }
  const int64_t item = bf16 ? 2 : 4;
  if (static_cast<int64_t>(tensor.raw_data().size()) != elements * item) {
    return absl::InvalidArgumentError("tensor.raw_data: size does not match shape");
  }
  std::vector<float> values(elements);
  if (!bf16) {
    std::memcpy(values.data(), tensor.raw_data().data(), tensor.raw_data().size());
    return values;
  }
  // A bfloat16 is the upper half of a binary32.
  const auto* bytes = reinterpret_cast<const unsigned char*>(tensor.raw_data().data());
  for (int64_t i = 0; i < elements; ++i) {
    const uint32_t bits = (uint32_t{bytes[2 * i + 1]} << 24) | (uint32_t{bytes[2 * i]} << 16);
    std::memcpy(&values[i], &bits, sizeof(float));
  }
  return values;
}

}  // namespace attnserve::client
