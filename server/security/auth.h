#ifndef ATTNSERVE_SERVER_SECURITY_AUTH_H_
#define ATTNSERVE_SERVER_SECURITY_AUTH_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/auth_metadata_processor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// Who a bearer token belongs to. LoadModel and UnloadModel need is_admin;
// the other AttentionService RPCs need a valid token.
struct Principal {
  bool is_admin = false;
  // Which token: the same for every call with one token, different for
  // different tokens (the hex of a prefix of the token's digest, never the
  // token); "" with authentication off. Decode sessions belong to it.
  std::string id;
};

// The bearer tokens of --auth_tokens_file. Only SHA-256 digests of the tokens
// are kept, so a token is compared in constant time over equal-length digests
// and never kept in memory as given.
//
// Thread-safe (immutable after Parse).
class TokenSet {
 public:
  // Parses a token file: one token per line; "admin:<token>" marks an admin
  // token; leading and trailing whitespace is trimmed; blank lines and lines
  // starting with '#' are ignored. INVALID_ARGUMENT (naming the line number,
  // never the token) for a token with whitespace inside or an empty admin
  // token, and for a file without any token.
  static absl::StatusOr<TokenSet> Parse(absl::string_view contents);
  // Reads and parses the file at `path`. Errors name --auth_tokens_file.
  static absl::StatusOr<TokenSet> Load(const std::string& path);

  // Checks the value of a call's "authorization" metadata (nullopt: absent).
  // UNAUTHENTICATED when it is absent, not "Bearer <token>", or the token is
  // not in the set; the message never contains the token.
  absl::StatusOr<Principal> Authenticate(std::optional<absl::string_view> authorization) const;
  // The same for a call's metadata (its "authorization" entry), as a handler
  // (ServerContext::client_metadata) or an auth metadata processor sees it.
  absl::StatusOr<Principal> Authenticate(
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

  int size() const { return static_cast<int>(entries_.size()); }

 private:
  using Digest = std::array<uint8_t, 32>;
  struct Entry {
    Digest digest;
    bool is_admin = false;
  };
  TokenSet() = default;

  std::vector<Entry> entries_;
};

// Checks the bearer token of every call whose path (":path",
// "/<service>/<method>") starts with one of `guarded` (e.g.
// "/attnserve.v1.AttentionService/" for a whole service, or one method's
// path) from the call's headers, before its request message is read: a call
// without a valid token ends UNAUTHENTICATED while its body has sent at most a
// flow-control window, instead of being buffered whole for the handler to
// refuse. A path equal to one of `open` passes even under a guarded prefix
// (a whole service guarded but its probes, so that a method added to the
// service later is guarded by default). Other calls (health, reflection, open
// probes) pass. gRPC runs metadata processors only on TLS ports; the handlers
// still authenticate (and check admin rights) on every port.
std::shared_ptr<grpc::AuthMetadataProcessor> MakeTokenAuthProcessor(
    TokenSet tokens, std::vector<std::string> guarded, std::vector<std::string> open = {});

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_SECURITY_AUTH_H_
