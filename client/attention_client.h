#ifndef ATTNSERVE_CLIENT_ATTENTION_CLIENT_H_
#define ATTNSERVE_CLIENT_ATTENTION_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/extend_stream.h"
#include "client/wire_request.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnserve::client {

// How a call that failed with UNAVAILABLE (a replica stopping, draining or
// unreachable) is tried again, on whichever backend the load-balancing policy
// picks next. Becomes the retryPolicy of the channel's service config; every
// attempt falls within the call's one deadline.
struct RetryOptions {
  // Attempts in all, first included: 1 turns retries off; gRPC caps it at 5.
  int max_attempts = 4;
  // Backoff before attempt n+1: random in [0, min(initial * multiplier^(n-1), max)].
  double initial_backoff_seconds = 0.05;
  double max_backoff_seconds = 1;
  double backoff_multiplier = 2;
};

// TLS to the server. Files are PEM.
struct TlsOptions {
  bool enabled = false;
  // CA bundle that signed the server's certificate; empty: the system roots.
  std::string ca_file;
  // For mutual TLS: the client's certificate chain and its key (both or none).
  std::string cert_file;
  std::string key_file;
  // Overrides the name checked against the server's certificate (tests,
  // connecting by IP to a certificate for a DNS name); empty: the target's host.
  std::string server_name;
};

struct ClientOptions {
  // Where the server is: "host:port"; a comma-separated list of IP
  // "address:port" replicas ("127.0.0.1:5001,127.0.0.1:5002", or "[::1]:5001,...")
  // that becomes an ipv4:/ipv6: target; or any gRPC target URI
  // ("dns:///attnserve:50051", "ipv4:10.0.0.1:50051,10.0.0.2:50051").
  std::string target = "localhost:50051";
  // The channel's load-balancing policy: "" (gRPC's default, pick_first: every
  // call to the first address that answers), "pick_first" or "round_robin"
  // (calls spread over every address the target resolves to).
  std::string lb_policy;
  // With round_robin: the grpc.health.v1 service the client watches on each
  // backend, sending calls only to those that report SERVING (a replica that
  // is loading or draining gets none). "" turns client-side health checking off.
  std::string health_check_service = "attnserve.v1.AttentionService";
  RetryOptions retry;
  // Deadline of each call, retries included.
  double timeout_seconds = 30;
  // Largest response accepted (outputs and maps can be large), in (0, 2^31).
  int64_t max_receive_message_bytes = int64_t{256} << 20;
  TlsOptions tls;
  // Sent as "authorization: Bearer <token>" on AttentionService calls (not on
  // health checks); empty: none.
  std::string bearer_token;
  // Sent as "attnserve-routing-key: <key>" on AttentionService calls (not on
  // health checks): the shipped proxy sends every call with one key to one
  // replica, so that a decode session's calls reach the replica holding it
  // (README, "Sessions across replicas"). Printable ASCII; empty: none.
  std::string routing_key;
};

// The request header the shipped proxy routes by (deploy/haproxy/haproxy.cfg).
inline constexpr char kRoutingKeyHeader[] = "attnserve-routing-key";

// Adds what every AttentionService call of a client with `options` carries:
// the bearer token and the routing key, each when set.
void AddCallMetadata(const ClientOptions& options, grpc::ClientContext& context);

// The gRPC target for options.target: a comma-separated list of IP
// address:port replicas becomes "ipv4:a:p,b:q" (or "ipv6:[a]:p,..."); a
// single address or a URI is returned as it is. INVALID_ARGUMENT (naming
// "target") for an empty target or entry, a list that mixes IPv4 and IPv6,
// or a list entry that is not an IP address with a port (gRPC resolves a list
// of names no other way: use one DNS name that resolves to every replica).
absl::StatusOr<std::string> ChannelTarget(absl::string_view target);

// The channel's service config (JSON): the load-balancing policy, client-side
// health checking (round_robin only) and the retry policy for UNAVAILABLE on
// attnserve.v1.AttentionService and grpc.health.v1.Health. INVALID_ARGUMENT
// (naming the field) for an unknown lb_policy, or retry settings outside
// max_attempts in [1, 5] or positive backoffs (multiplier >= 1).
absl::StatusOr<std::string> ServiceConfigJson(const ClientOptions& options);

// gRPC fails a message over a receive limit, on either side, with
// RESOURCE_EXHAUSTED "Received message larger than max (<size> vs. <limit>)",
// which names no limit. This says which one and how to get past it: the
// request (`request_bytes` serialized) over the server's limit (attnserve
// --max_receive_message_bytes), or the response over this client's
// (`client_limit`, ClientOptions::max_receive_message_bytes, attnctl
// --max_receive_message_bytes); it tells them apart by the sizes. The code
// stays RESOURCE_EXHAUSTED and gRPC's text stays at the end. Any other status
// is returned as it is.
absl::Status ExplainMessageSizeError(const absl::Status& status, int64_t request_bytes,
                                     int64_t client_limit);

// A thin C++ client of attnserve.v1.AttentionService and grpc.health.v1.
// Calls return the server's status as an absl::Status with the same code and
// message, except that a message over a size limit is explained
// (ExplainMessageSizeError). Thread-safe (gRPC channels and stubs are).
class AttentionClient {
 public:
  // INVALID_ARGUMENT for an empty target or a non-positive timeout, a
  // max_receive_message_bytes outside (0, 2^31), a TLS file that cannot be
  // read (naming the field) or a client cert without key, and as
  // ChannelTarget and ServiceConfigJson say.
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Create(const ClientOptions& options);

  absl::StatusOr<v1::ListModelsResponse> ListModels() const;
  absl::StatusOr<v1::ModelInfo> GetModel(absl::string_view name) const;
  // Admin RPCs (an admin token when the server has tokens).
  absl::StatusOr<v1::LoadModelResponse> LoadModel(absl::string_view name) const;
  absl::Status UnloadModel(absl::string_view name) const;
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& request) const;
  // The same call with a request prepared once (WireRequest): its tensors go
  // to gRPC without a copy. For a request sent many times, or whose tensors
  // are large.
  absl::StatusOr<v1::AttendResponse> Attend(const WireRequest& request) const;
  // The same into `response`, whose memory is reused: called again with the
  // same message, the answer's tensors are read into the buffers the last
  // answer left (no allocation, and on a virtual machine no page faults, for
  // each call's megabytes). On an error `response` holds nothing of use.
  absl::Status Attend(const WireRequest& request, v1::AttendResponse* response) const;
  // Attend through AttendStream: the maps come in chunks (each a message
  // under gRPC's usual 4 MiB) and are put back in place (MapAssembler), so
  // maps larger than one message arrive whole. `chunks`, when given, gets the
  // number of map chunks received.
  absl::StatusOr<v1::AttendResponse> AttendStream(const v1::AttendRequest& request,
                                                  int64_t* chunks = nullptr) const;
  // Decode sessions (see the proto): each returns the server's answer.
  absl::StatusOr<v1::Session> OpenSession(const v1::OpenSessionRequest& request) const;
  absl::StatusOr<v1::ExtendResponse> Extend(const v1::ExtendRequest& request) const;
  // Opens an ExtendStream call: Extend messages answered one at a time over
  // one stream (see ExtendStream). `timeout_seconds` is the deadline of the
  // whole stream (0: none; a long-lived decoder ends it with Close). Errors
  // come from the stream's first Extend, not from here. This client must
  // outlive the stream.
  std::unique_ptr<ExtendStream> OpenExtendStream(double timeout_seconds) const;
  absl::StatusOr<v1::Session> GetSession(absl::string_view session_id) const;
  absl::StatusOr<v1::Session> ForkSession(absl::string_view session_id) const;
  absl::StatusOr<v1::Session> TruncateSession(const v1::TruncateSessionRequest& request) const;
  absl::Status CloseSession(absl::string_view session_id) const;
  // What layer `layer`'s latest token attends to (GetLatestAttention).
  absl::StatusOr<v1::LatestAttention> GetLatestAttention(absl::string_view session_id,
                                                         int layer) const;

  // Starts an Attend call and returns at once; `done` runs on a gRPC thread
  // with the call's status when it ends. `context` (fresh), `request` and
  // `response` must live until then. The context gets the deadline
  // (timeout_seconds) and the bearer token, like Attend's.
  void AttendAsync(grpc::ClientContext* context, const v1::AttendRequest* request,
                   v1::AttendResponse* response, std::function<void(grpc::Status)> done) const;
  // The same with a prepared request (see Attend(const WireRequest&)); the
  // call holds the request's bytes, so `request` need not outlive it.
  void AttendAsync(grpc::ClientContext* context, const WireRequest* request,
                   v1::AttendResponse* response, std::function<void(grpc::Status)> done) const;
  // The health of `service` ("" for the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      absl::string_view service) const;

 private:
  AttentionClient(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel);

  // Constant after construction.
  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  // Calls that send a WireRequest's bytes as they are (the response is
  // received and parsed as the generated stub does). Thread-safe; held by
  // pointer because its calls are not const.
  using BytesToAttendResponseStub = grpc::TemplatedGenericStub<grpc::ByteBuffer, v1::AttendResponse>;
  std::unique_ptr<BytesToAttendResponseStub> attend_bytes_stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

// An Attend request for `model` with FP32 hidden states [batch, seq, d_model]
// in raw_data.
v1::AttendRequest MakeAttendRequest(absl::string_view model, absl::Span<const float> hidden_states,
                                    int64_t batch, int64_t seq, int64_t d_model,
                                    v1::AttentionMapMode maps = v1::ATTENTION_MAP_MODE_NONE);

// The values of an FP32 tensor (raw_data or float_data) or a BF16 one
// (raw_data), as floats. INVALID_ARGUMENT for another dtype or a size that
// does not match the shape.
absl::StatusOr<std::vector<float>> TensorValues(const v1::Tensor& tensor);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_ATTENTION_CLIENT_H_
