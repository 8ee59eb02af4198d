#include "server/api/replica_header.h"

#include <map>
#include <string>
#include <utility>

#include <grpcpp/support/interceptor.h>

namespace attnserve::server {
namespace {

class ReplicaHeaderInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit ReplicaHeaderInterceptor(const std::string* replica_name)
      : replica_name_(replica_name) {}

  // A call that fails before sending anything answers in one frame of
  // trailers ("trailers-only"), and gRPC clients retry (UNAVAILABLE from a
  // draining replica, on another one) only such answers: headers of ours
  // would commit the call and end the retry. So a failure sent together with
  // the initial metadata names the replica in its trailers instead.
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    const bool sends_failure = methods->QueryInterceptionHookPoint(
                                   InterceptionHookPoints::PRE_SEND_STATUS) &&
                               !methods->GetSendStatus().ok();
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA) &&
        !sends_failure) {
      if (std::multimap<std::string, std::string>* metadata = methods->GetSendInitialMetadata();
          metadata != nullptr) {
        metadata->emplace(kReplicaHeader, *replica_name_);
      }
    }
    if (sends_failure) {
      if (std::multimap<std::string, std::string>* metadata = methods->GetSendTrailingMetadata();
          metadata != nullptr) {
        metadata->emplace(kReplicaHeader, *replica_name_);
      }
    }
    methods->Proceed();
  }

 private:
  const std::string* replica_name_;  // the factory's, which outlives the server
};

class ReplicaHeaderInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReplicaHeaderInterceptorFactory(std::string replica_name)
      : replica_name_(std::move(replica_name)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* /*info*/) override {
    return new ReplicaHeaderInterceptor(&replica_name_);
  }

 private:
  const std::string replica_name_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeReplicaHeaderInterceptorFactory(std::string replica_name) {
  return std::make_unique<ReplicaHeaderInterceptorFactory>(std::move(replica_name));
}

}  // namespace attnserve::server
