#include "server/api/call_observer.h"

#include <utility>

#include "server/observability/access_log.h"

namespace attnserve::server {
namespace {

std::optional<absl::string_view> ClientRequestId(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(grpc::string_ref(kRequestIdKey.data(), kRequestIdKey.size()));
  if (it == metadata.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

}  // namespace

CallObserver::CallObserver(grpc::CallbackServerContext* context, RpcMethod method,
                           absl::string_view model, Metrics* metrics, bool access_log)
    : context_(context),
      method_(method),
      metrics_(metrics),
      access_log_(access_log),
      arrival_(absl::Now()),
      model_label_(metrics->ModelLabel(model)) {
  metrics_->OnRequestStarted();
  if (access_log_) {
    model_ = std::string(model);
    request_id_ = RequestIdOrNew(ClientRequestId(*context));
  }
}

void CallObserver::Dequeued(absl::Duration queue_wait) {
  queue_wait_ = queue_wait;
  metrics_->OnDequeued(model_label_, queue_wait);
}

void CallObserver::AddRequestIdToHeaders() {
  if (!access_log_ || request_id_in_headers_) return;
  context_->AddInitialMetadata(std::string(kRequestIdKey), request_id_);
  request_id_in_headers_ = true;
}

void CallObserver::Report(const grpc::Status& status) {
  const absl::Time end = absl::Now();
  // absl::StatusCode and grpc::StatusCode share their numbering.
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  metrics_->OnRequestDone(method_, model_label_, code, end - arrival_);
  if (!access_log_) return;
  WriteAccessLog({.time = end,
                  .request_id = request_id_,
                  .method = method_,
                  .model = model_,
                  .peer = context_->peer(),
                  .shapes = std::move(shapes_),
                  .code = code,
                  .message = status.error_message(),
                  .duration = end - arrival_,
                  .queue = queue_wait_,
                  .compute = compute_});
  // The id goes back in the headers of a success but in the trailers of an
  // error: a response with headers counts as committed, and gRPC would not
  // retry an UNAVAILABLE refusal from a draining replica.
  if (status.ok()) {
    AddRequestIdToHeaders();
  } else {
    context_->AddTrailingMetadata(std::string(kRequestIdKey), request_id_);
  }
}

}  // namespace attnserve::server
