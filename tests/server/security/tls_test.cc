// TLS and mutual TLS on the gRPC port: certificates made here with the openssl
// command line, the real server on an ephemeral port, the real client.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "gtest/gtest.h"
#include "server/attn_server.h"

namespace attnserve::server {
namespace {

// A CA, a server certificate for localhost / 127.0.0.1, a client certificate
// from that CA and one from a foreign CA, in a fresh directory.
class Certificates {
 public:
  static const Certificates& Get() {
    static const Certificates* certificates = new Certificates();
    return *certificates;
  }
  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }
  bool ok() const { return ok_; }

 private:
  // One directory per process: CTest runs the tests of this file in
  // processes of their own, side by side.
  Certificates()
      : dir_(absl::StrCat(::testing::TempDir(), "/attnserve_tls_test_certs_", getpid())) {
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::vector<std::string> commands = {
        absl::StrCat("rm -rf '", dir_, "' && mkdir -p '", dir_, "'"),
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' "
        "> server.ext",
        "printf 'extendedKeyUsage=clientAuth\\n' > client.ext",
        absl::StrCat("openssl req -x509 ", key,
                     " -keyout ca.key -out ca.pem -days 1 -subj /CN=attnserve-test-ca"),
        absl::StrCat("openssl req -x509 ", key,
                     " -keyout foreign-ca.key -out foreign-ca.pem -days 1 -subj /CN=foreign-ca"),
        absl::StrCat("openssl req ", key, " -keyout server.key -out server.csr -subj /CN=localhost"),
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 1 -extfile server.ext",
        absl::StrCat("openssl req ", key, " -keyout client.key -out client.csr -subj /CN=client"),
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 1 -extfile client.ext",
        absl::StrCat("openssl req ", key,
                     " -keyout foreign-client.key -out foreign-client.csr -subj /CN=intruder"),
        "openssl x509 -req -in foreign-client.csr -CA foreign-ca.pem -CAkey foreign-ca.key "
        "-CAcreateserial -out foreign-client.pem -days 1 -extfile client.ext",
    };
    ok_ = true;
    for (size_t i = 0; i < commands.size() && ok_; ++i) {
      const std::string command =
          i == 0 ? commands[i] : absl::StrCat("cd '", dir_, "' && ", commands[i], " 2>/dev/null");
      ok_ = std::system(command.c_str()) == 0;
      EXPECT_TRUE(ok_) << command;
    }
  }

  const std::string dir_;
  bool ok_ = false;
};

ServerOptions TlsOptions(bool mutual) {
  const Certificates& certs = Certificates::Get();
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.lame_duck_seconds = 0;
  options.drain_timeout_seconds = 5;
  options.tls_cert_file = certs.Path("server.pem");
  options.tls_key_file = certs.Path("server.key");
  if (mutual) options.tls_client_ca_file = certs.Path("ca.pem");
  return options;
}

std::unique_ptr<AttnServer> StartServer(const ServerOptions& options) {
  auto server = AttnServer::Create(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  EXPECT_TRUE((*server)->LoadModelsAndServe().ok());
  return *std::move(server);
}

// Client options for `server`: TLS trusting the test CA unless `tls` is
// false, with the client certificate `client` ("client", "foreign-client" or
// "" for none).
client::ClientOptions ClientFor(const AttnServer& server, bool tls, const std::string& client) {
  const Certificates& certs = Certificates::Get();
  client::ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server.port());
  options.retry.max_attempts = 1;
  options.timeout_seconds = 20;
  options.tls.enabled = tls;
  options.tls.ca_file = certs.Path("ca.pem");
  options.tls.server_name = "localhost";
  if (!client.empty()) {
    options.tls.cert_file = certs.Path(client + ".pem");
    options.tls.key_file = certs.Path(client + ".key");
  }
  return options;
}

absl::StatusCode AttendCode(const client::ClientOptions& options) {
  auto client = client::AttentionClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return absl::StatusCode::kUnknown;
  const std::vector<float> hidden(4 * 768, 0.25f);
  absl::StatusOr<v1::AttendResponse> response =
      (*client)->Attend(client::MakeAttendRequest("default", hidden, 1, 4, 768));
  if (response.ok()) {
    EXPECT_TRUE(response->has_output());
  }
  return response.status().code();
}

TEST(Tls, AttendSucceedsThroughATlsChannel) {
  ASSERT_TRUE(Certificates::Get().ok());
  auto server = StartServer(TlsOptions(/*mutual=*/false));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(AttendCode(ClientFor(*server, /*tls=*/true, "")), absl::StatusCode::kOk);
}

TEST(Tls, PlaintextClientOfATlsServerFailsUnavailable) {
  ASSERT_TRUE(Certificates::Get().ok());
  auto server = StartServer(TlsOptions(/*mutual=*/false));
  ASSERT_NE(server, nullptr);
  // The same server serves a trusting TLS client: the refusal is the client's.
  ASSERT_EQ(AttendCode(ClientFor(*server, /*tls=*/true, "")), absl::StatusCode::kOk);
  EXPECT_EQ(AttendCode(ClientFor(*server, /*tls=*/false, "")), absl::StatusCode::kUnavailable);
}

TEST(Tls, ClientThatDoesNotTrustTheServerCaFailsUnavailable) {
  ASSERT_TRUE(Certificates::Get().ok());
  auto server = StartServer(TlsOptions(/*mutual=*/false));
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(AttendCode(ClientFor(*server, /*tls=*/true, "")), absl::StatusCode::kOk);
  client::ClientOptions options = ClientFor(*server, /*tls=*/true, "");
  options.tls.ca_file = Certificates::Get().Path("foreign-ca.pem");
  EXPECT_EQ(AttendCode(options), absl::StatusCode::kUnavailable);
}

TEST(MutualTls, OnlyAClientCertificateFromTheConfiguredCaIsAccepted) {
  ASSERT_TRUE(Certificates::Get().ok());
  auto server = StartServer(TlsOptions(/*mutual=*/true));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(AttendCode(ClientFor(*server, /*tls=*/true, "")), absl::StatusCode::kUnavailable);
  EXPECT_EQ(AttendCode(ClientFor(*server, /*tls=*/true, "foreign-client")),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(AttendCode(ClientFor(*server, /*tls=*/false, "")), absl::StatusCode::kUnavailable);
  EXPECT_EQ(AttendCode(ClientFor(*server, /*tls=*/true, "client")), absl::StatusCode::kOk);
}

void ExpectRefused(const ServerOptions& options, absl::string_view flag) {
  auto server = AttnServer::Create(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(server.status().message(), flag)) << server.status();
}

TEST(Tls, UnreadableMismatchedOrIncompleteFilesRefuseToStartNamingTheFlag) {
  ASSERT_TRUE(Certificates::Get().ok());
  const Certificates& certs = Certificates::Get();
  ServerOptions options = TlsOptions(/*mutual=*/true);
  options.tls_cert_file = certs.Path("missing.pem");
  ExpectRefused(options, "--tls_cert:");

  options = TlsOptions(/*mutual=*/true);
  options.tls_key_file = certs.Path("missing.key");
  ExpectRefused(options, "--tls_key:");

  options = TlsOptions(/*mutual=*/true);
  options.tls_key_file = certs.Path("client.key");  // not the server certificate's key
  ExpectRefused(options, "--tls_key:");

  options = TlsOptions(/*mutual=*/true);
  options.tls_cert_file = certs.Path("server.key");  // no certificate in it
  ExpectRefused(options, "--tls_cert:");

  options = TlsOptions(/*mutual=*/true);
  options.tls_client_ca_file = certs.Path("missing-ca.pem");
  ExpectRefused(options, "--tls_client_ca:");

  options = TlsOptions(/*mutual=*/false);
  options.tls_key_file.clear();
  ExpectRefused(options, "--tls_key:");

  options = TlsOptions(/*mutual=*/true);
  options.tls_cert_file.clear();
  options.tls_key_file.clear();
  ExpectRefused(options, "--tls_client_ca:");
}

}  // namespace
}  // namespace attnserve::server
