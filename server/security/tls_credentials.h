#ifndef ATTNSERVE_SERVER_SECURITY_TLS_CREDENTIALS_H_
#define ATTNSERVE_SERVER_SECURITY_TLS_CREDENTIALS_H_

#include <memory>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "server/common/server_options.h"

namespace attnserve::server {

// The gRPC server credentials for `options`: TLS (mutual with
// tls_client_ca_file) or, without a certificate, plaintext. INVALID_ARGUMENT
// naming the flag for a file that cannot be read or parsed, a key that does
// not match the certificate, or a flag set without the one it needs. gRPC
// itself would only fail to listen, naming no file. Thread-safe.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerOptions& options);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SECURITY_TLS_CREDENTIALS_H_
