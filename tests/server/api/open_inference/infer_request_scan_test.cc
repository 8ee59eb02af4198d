// ScanInferRequest: the entries of a ModelInferRequest's repeated fields are
// counted on its wire form, before parsing: at the bounds it passes, one over
// is refused naming the field, bytes that are not a message are refused
// naming the request, and a request split over many slices reads the same.
#include "server/api/open_inference/infer_request_scan.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "inference/open_inference.pb.h"
#include "tests/core/status_matchers.h"

namespace attnserve::server::open_inference {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using absl::StatusCode;

// `bytes` as a ByteBuffer of slices of at most `slice_bytes` each.
grpc::ByteBuffer Buffer(const std::string& bytes, size_t slice_bytes = 1 << 20) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice_bytes) {
    slices.emplace_back(bytes.data() + at, std::min(slice_bytes, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A request with `inputs` inputs of 2 parameters each, `outputs` outputs,
// `raw` raw contents and `parameters` request parameters.
inference::ModelInferRequest Request(int inputs, int outputs, int raw, int parameters) {
  inference::ModelInferRequest r;
  r.set_model_name("m");
  r.set_id("id");
  for (int i = 0; i < inputs; ++i) {
    auto* input = r.add_inputs();
    input->set_name(absl::StrCat("in", i));
    input->set_datatype("FP32");
    input->add_shape(1);
    input->mutable_contents()->add_fp32_contents(1.5f);
    (*input->mutable_parameters())["content_type"].set_string_param("np");
    (*input->mutable_parameters())["other"].set_int64_param(i);
  }
  for (int i = 0; i < outputs; ++i) r.add_outputs()->set_name(absl::StrCat("out", i));
  for (int i = 0; i < raw; ++i) r.add_raw_input_contents(std::string(8, 'x'));
  for (int i = 0; i < parameters; ++i) {
    (*r.mutable_parameters())[absl::StrCat("p", i)].set_bool_param(true);
  }
  return r;
}

TEST(ScanInferRequest, AtTheBoundsPassesInOneSliceOrMany) {
  const std::string bytes =
      Request(kMaxInferInputs, kMaxInferOutputs, kMaxInferRawContents, kMaxInferParameters)
          .SerializeAsString();
  EXPECT_THAT(ScanInferRequest(Buffer(bytes)), IsOk());
  EXPECT_THAT(ScanInferRequest(Buffer(bytes, 3)), IsOk());
  EXPECT_THAT(ScanInferRequest(Buffer("")), IsOk());  // the empty request
}

TEST(ScanInferRequest, OneOverABoundIsRefusedNamingTheField) {
  struct Case {
    inference::ModelInferRequest request;
    std::string message;
  };
  std::vector<Case> cases = {
      {Request(kMaxInferInputs + 1, 0, 0, 0), "inputs: more than 16 entries"},
      {Request(0, kMaxInferOutputs + 1, 0, 0), "outputs: more than 16 entries"},
      {Request(0, 0, kMaxInferRawContents + 1, 0), "raw_input_contents: more than 16 entries"},
      {Request(0, 0, 0, kMaxInferParameters + 1), "parameters: more than 64 entries"},
  };
  inference::ModelInferRequest r = Request(3, 2, 0, 0);
  for (int i = 0; i <= kMaxInferTensorParameters; ++i) {
    (*r.mutable_inputs(2)->mutable_parameters())[absl::StrCat("k", i)].set_bool_param(true);
  }
  cases.push_back({r, "inputs[2].parameters: more than 16 entries"});
  r = Request(1, 2, 0, 0);
  for (int i = 0; i <= kMaxInferTensorParameters; ++i) {
    (*r.mutable_outputs(1)->mutable_parameters())[absl::StrCat("k", i)].set_bool_param(true);
  }
  cases.push_back({r, "outputs[1].parameters: more than 16 entries"});
  r = Request(2, 0, 0, 0);
  r.mutable_inputs(1)->mutable_contents()->add_bytes_contents("");
  cases.push_back({r, "inputs[1].contents.bytes_contents: attnserve takes no BYTES tensors"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    const std::string bytes = c.request.SerializeAsString();
    EXPECT_THAT(ScanInferRequest(Buffer(bytes)), StatusIs(StatusCode::kInvalidArgument, c.message));
    EXPECT_THAT(ScanInferRequest(Buffer(bytes, 5)),
                StatusIs(StatusCode::kInvalidArgument, c.message));
  }
}

// Millions of empty inputs (2 bytes each on the wire) are refused at the
// 17th, whatever follows.
TEST(ScanInferRequest, MillionsOfEmptyEntriesAreRefusedAtTheBound) {
  for (const char tag : {'\x2a', '\x32', '\x3a', '\x22'}) {  // fields 5, 6, 7, 4: empty entries
    std::string bytes;
    for (int i = 0; i < 2'000'000; ++i) bytes.append({tag, '\0'});
    const absl::Status status = ScanInferRequest(Buffer(bytes));
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("more than"));
  }
}

TEST(ScanInferRequest, BytesThatAreNotAMessageAreRefusedNamingTheRequest) {
  const std::string good = Request(2, 1, 2, 1).SerializeAsString();
  std::vector<std::string> bad = {
      good.substr(0, good.size() - 1),          // cut inside the last field
      std::string("\x2a\x10\x0a\x01", 4),       // an input longer than the bytes
      std::string("\x00\x01", 2),               // a zero tag
      std::string("\x0f", 1),                   // wire type 7
      std::string("\x2a\xff\xff\xff\xff\x0f", 6),  // a length over 2^31
      std::string("\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),  // a 11-byte varint
      // An input whose parameters entry is cut: its own length is right, the
      // entry inside it is not.
      std::string("\x2a\x03\x22\x05\x0a", 5),
      // Contents inside an input with a bad tag.
      std::string("\x2a\x04\x2a\x02\x00\x00", 6),
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_THAT(ScanInferRequest(Buffer(bad[i])),
                StatusIs(StatusCode::kInvalidArgument,
                         "request: not a valid inference.ModelInferRequest"));
    EXPECT_THAT(ScanInferRequest(Buffer(bad[i], 1)),
                StatusIs(StatusCode::kInvalidArgument,
                         "request: not a valid inference.ModelInferRequest"));
  }
}

}  // namespace
}  // namespace attnserve::server::open_inference
