#ifndef ATTNSERVE_SERVER_API_REPLICA_HEADER_H_
#define ATTNSERVE_SERVER_API_REPLICA_HEADER_H_

#include <memory>
#include <string>

#include <grpcpp/support/server_interceptor.h>

namespace attnserve::server {

// The response header (initial metadata) that names the replica answering a
// call. Behind a proxy, a client learns from it where a call ran: a decode
// session lives on one replica, and its steps must all reach that one
// (README, "Sessions across replicas").
inline constexpr char kReplicaHeader[] = "attnserve-replica";

// The request header a client routes a session by: the shipped proxy hashes
// it consistently onto a replica (deploy/haproxy/haproxy.cfg). The server
// itself does not read it.
inline constexpr char kRoutingKeyHeader[] = "attnserve-routing-key";

// A server interceptor factory adding `kReplicaHeader: replica_name` to the
// initial metadata of every call of every service on the server (health and
// reflection included), and to the trailing metadata of every failed call
// (a call that fails before sending anything gets it there only, so that its
// answer stays one a client may retry elsewhere). Thread-safe; each call gets
// its own interceptor.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeReplicaHeaderInterceptorFactory(std::string replica_name);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_API_REPLICA_HEADER_H_
