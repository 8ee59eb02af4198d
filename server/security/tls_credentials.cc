#include "server/security/tls_credentials.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"

namespace attnserve::server {
namespace {

// The contents of the PEM file named by --`flag`. INVALID_ARGUMENT naming the
// flag when it cannot be read.
absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

struct BioDeleter {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Deleter {
  void operator()(X509* x509) const { X509_free(x509); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};

std::unique_ptr<BIO, BioDeleter> PemBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

std::unique_ptr<X509, X509Deleter> FirstCertificate(const std::string& pem) {
  auto bio = PemBio(pem);
  return std::unique_ptr<X509, X509Deleter>(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerOptions& options) {
  if (options.tls_cert_file.empty()) {
    if (!options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("--tls_key: needs --tls_cert");
    }
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca: needs --tls_cert");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_key: required with --tls_cert");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(std::string cert, ReadPemFile("tls_cert", options.tls_cert_file));
  ATTNSERVE_ASSIGN_OR_RETURN(std::string key, ReadPemFile("tls_key", options.tls_key_file));
  auto x509 = FirstCertificate(cert);
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert: '", options.tls_cert_file, "' holds no PEM certificate"));
  }
  auto key_bio = PemBio(key);
  std::unique_ptr<EVP_PKEY, KeyDeleter> pkey(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key: '", options.tls_key_file, "' holds no unencrypted PEM private key"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key: the key does not match the certificate of --tls_cert"));
  }
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({.private_key = key, .cert_chain = cert});
  if (!options.tls_client_ca_file.empty()) {
    ATTNSERVE_ASSIGN_OR_RETURN(std::string ca,
                               ReadPemFile("tls_client_ca", options.tls_client_ca_file));
    if (FirstCertificate(ca) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls_client_ca: '", options.tls_client_ca_file, "' holds no PEM certificate"));
    }
    ssl.pem_root_certs = ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace attnserve::server
