#include "server/security/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include <grpcpp/support/status.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnserve::server {
namespace {

constexpr absl::string_view kAdminPrefix = "admin:";
constexpr absl::string_view kBearer = "bearer ";

bool HasWhitespace(absl::string_view s) {
  for (char c : s) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<TokenSet> TokenSet::Parse(absl::string_view contents) {
  TokenSet set;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    Entry entry;
    if (absl::StartsWith(line, kAdminPrefix)) {
      entry.is_admin = true;
      line.remove_prefix(kAdminPrefix.size());
    }
    if (line.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_tokens_file: line ", line_number, ": empty admin token"));
    }
    if (HasWhitespace(line)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_tokens_file: line ", line_number, ": a token may not contain whitespace"));
    }
    SHA256(reinterpret_cast<const unsigned char*>(line.data()), line.size(), entry.digest.data());
    set.entries_.push_back(entry);
  }
  if (set.entries_.empty()) {
    return absl::InvalidArgumentError("--auth_tokens_file: the file holds no token");
  }
  return set;
}

absl::StatusOr<TokenSet> TokenSet::Load(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file: cannot read '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  return Parse(contents.str());
}

absl::StatusOr<Principal> TokenSet::Authenticate(
    std::optional<absl::string_view> authorization) const {
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  absl::string_view value = absl::StripAsciiWhitespace(*authorization);
  if (value.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kBearer.size()), kBearer)) {
    return absl::UnauthenticatedError("authorization: expected 'Bearer <token>'");
  }
  value = absl::StripLeadingAsciiWhitespace(value.substr(kBearer.size()));
  Digest presented;
  SHA256(reinterpret_cast<const unsigned char*>(value.data()), value.size(), presented.data());
  // Every entry is compared, so the time does not say which one matched.
  int matched = -1;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const bool equal =
        CRYPTO_memcmp(presented.data(), entries_[i].digest.data(), presented.size()) == 0;
    if (equal && matched < 0) matched = static_cast<int>(i);
  }
  if (matched < 0) return absl::UnauthenticatedError("authorization: invalid bearer token");
  const Digest& digest = entries_[matched].digest;
  return Principal{.is_admin = entries_[matched].is_admin,
                   .id = absl::BytesToHexString(absl::string_view(
                       reinterpret_cast<const char*>(digest.data()), 16))};
}

absl::StatusOr<Principal> TokenSet::Authenticate(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  const auto found = metadata.find("authorization");
  if (found == metadata.end()) return Authenticate(std::nullopt);
  return Authenticate(absl::string_view(found->second.data(), found->second.size()));
}

namespace {

class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  TokenAuthProcessor(TokenSet tokens, std::vector<std::string> guarded,
                     std::vector<std::string> open)
      : tokens_(std::move(tokens)), guarded_(std::move(guarded)), open_(std::move(open)) {}

  // A SHA-256 and a few comparisons: cheap enough for gRPC's own threads.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext* /*context*/,
                       OutputMetadata* /*consumed*/, OutputMetadata* /*response*/) override {
    const auto path = metadata.find(":path");
    if (path != metadata.end()) {
      const absl::string_view called(path->second.data(), path->second.size());
      bool guarded = false;
      for (const std::string& prefix : guarded_) guarded = guarded || absl::StartsWith(called, prefix);
      for (const std::string& exempt : open_) guarded = guarded && called != exempt;
      if (!guarded) return grpc::Status::OK;
    }
    const absl::StatusOr<Principal> caller = tokens_.Authenticate(metadata);
    if (!caller.ok()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(caller.status().message()));
    }
    return grpc::Status::OK;
  }

 private:
  const TokenSet tokens_;
  const std::vector<std::string> guarded_;
  const std::vector<std::string> open_;
};

}  // namespace

std::shared_ptr<grpc::AuthMetadataProcessor> MakeTokenAuthProcessor(
    TokenSet tokens, std::vector<std::string> guarded, std::vector<std::string> open) {
  return std::make_shared<TokenAuthProcessor>(std::move(tokens), std::move(guarded),
                                              std::move(open));
}

}  // namespace attnserve::server
