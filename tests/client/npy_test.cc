#include "client/npy.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_files.h"
#include "tests/core/status_matchers.h"

namespace attnserve::client {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A .npy file by hand: magic, version 1.0, a header padded to 64 bytes, data.
std::string NpyBytes(const std::string& header, const std::string& data, char major = 1) {
  std::string text = header;
  const size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + text.size() + 1) % 64 != 0) text.push_back(' ');
  text.push_back('\n');
  std::string bytes("\x93NUMPY", 6);
  bytes.push_back(major);
  bytes.push_back('\0');
  bytes.push_back(static_cast<char>(text.size() & 0xff));
  bytes.push_back(static_cast<char>(text.size() >> 8));
  if (major != 1) bytes.append(2, '\0');
  return bytes + text + data;
}

std::string FloatBytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

bool NumpyAvailable() {
  return std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0;
}

TEST(Npy, WrittenFloatsReadBackExactly) {
  const std::vector<float> values = {1.0f, -2.5f, 3.25e-7f, 0.0f, 1e30f, -0.0f};
  const std::string path = TempPath("round_trip.npy");
  ASSERT_THAT(WriteNpyFile(path, {2, 1, 3}, values), IsOk());
  absl::StatusOr<NpyArray> array = ReadNpyFile(path);
  ASSERT_THAT(array, IsOk());
  EXPECT_EQ(array->dtype, NpyDtype::kFloat32);
  EXPECT_THAT(array->shape, ElementsAre(2, 1, 3));
  EXPECT_EQ(array->ToFloats(), values);
}

TEST(Npy, WrittenHeaderIsPaddedTo64BytesAndEndsWithNewline) {
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{}, {5}, {2, 3}, {1234567, 0, 89}}) {
    const std::string bytes = EncodeNpyFloat32(shape, {});
    const size_t header_len =
        static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    EXPECT_EQ((10 + header_len) % 64, 0u);
    EXPECT_EQ(bytes[10 + header_len - 1], '\n');
  }
  EXPECT_THAT(EncodeNpyFloat32({5}, std::vector<float>(5)), HasSubstr("'shape': (5,)"));
  EXPECT_THAT(EncodeNpyFloat32({}, std::vector<float>(1)), HasSubstr("'shape': ()"));
}

TEST(Npy, ScalarAndEmptyArraysRoundTrip) {
  absl::StatusOr<NpyArray> scalar = ParseNpy(EncodeNpyFloat32({}, {{4.5f}}), "scalar");
  ASSERT_THAT(scalar, IsOk());
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_THAT(scalar->ToFloats(), ElementsAre(4.5f));
  absl::StatusOr<NpyArray> empty = ParseNpy(EncodeNpyFloat32({3, 0}, {}), "empty");
  ASSERT_THAT(empty, IsOk());
  EXPECT_THAT(empty->shape, ElementsAre(3, 0));
  EXPECT_EQ(empty->num_elements(), 0);
}

TEST(Npy, WriteRejectsAValueCountThatDoesNotMatchTheShape) {
  EXPECT_THAT(WriteNpyFile(TempPath("bad.npy"), {2, 2}, std::vector<float>(3)),
              StatusIs(absl::StatusCode::kInvalidArgument, "needs 4 values, got 3"));
}

TEST(Npy, WriteToAMissingDirectoryNamesThePath) {
  EXPECT_THAT(WriteNpyFile("/nonexistent-dir/x.npy", {1}, {{1.0f}}),
              StatusIs(absl::StatusCode::kNotFound, "/nonexistent-dir/x.npy"));
}

TEST(Npy, ReadsNumpysFloat32File) {
  absl::StatusOr<NpyArray> array = ReadNpyFile(TestData("float32_2x3.npy"));
  ASSERT_THAT(array, IsOk());
  EXPECT_EQ(array->dtype, NpyDtype::kFloat32);
  EXPECT_THAT(array->shape, ElementsAre(2, 3));
  EXPECT_THAT(array->ToFloats(), ElementsAre(-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f));
}

TEST(Npy, ReadsNumpysVersion2File) {
  absl::StatusOr<NpyArray> array = ReadNpyFile(TestData("float32_3_v2.npy"));
  ASSERT_THAT(array, IsOk());
  EXPECT_THAT(array->shape, ElementsAre(3));
  EXPECT_THAT(array->ToFloats(), ElementsAre(1.5f, -2.0f, 0.25f));
}

TEST(Npy, ReadsNumpysBooleanAndByteMasks) {
  absl::StatusOr<NpyArray> bools = ReadNpyFile(TestData("mask_bool_1x2x3.npy"));
  ASSERT_THAT(bools, IsOk());
  EXPECT_EQ(bools->dtype, NpyDtype::kBool);
  EXPECT_THAT(bools->shape, ElementsAre(1, 2, 3));
  EXPECT_THAT(bools->ToFloats(), ElementsAre(1, 0, 1, 0, 1, 1));
  absl::StatusOr<NpyArray> bytes = ReadNpyFile(TestData("mask_uint8_2x1x3.npy"));
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(bytes->dtype, NpyDtype::kUint8);
  EXPECT_THAT(bytes->shape, ElementsAre(2, 1, 3));
  EXPECT_THAT(bytes->ToFloats(), ElementsAre(0, 1, 2, 255, 0, 1));
}

// Both directions against the NumPy installed on this machine, when there is one.
TEST(Npy, AgreesWithNumpyBothWays) {
  if (!NumpyAvailable()) GTEST_SKIP() << "/usr/bin/python3 with numpy is not available";
  const std::string from_numpy = TempPath("from_numpy.npy");
  const std::string from_us = TempPath("from_us.npy");
  const std::string script = absl::StrCat(
      "/usr/bin/python3 -c \"import numpy as np; "
      "np.save('",
      from_numpy,
      "', (np.arange(24, dtype='<f4').reshape(2, 3, 4) / 8 - 1)); "
      "a = np.load('",
      from_us,
      "'); "
      "assert a.dtype == np.dtype('<f4') and a.shape == (3, 2), (a.dtype, a.shape); "
      "assert (a == np.array([[0.5, -1], [2.25, 1e-3], [7, -8]], '<f4')).all(), a\"");
  ASSERT_THAT(WriteNpyFile(from_us, {3, 2}, {0.5f, -1.0f, 2.25f, 1e-3f, 7.0f, -8.0f}), IsOk());
  ASSERT_EQ(std::system(script.c_str()), 0) << script;
  absl::StatusOr<NpyArray> array = ReadNpyFile(from_numpy);
  ASSERT_THAT(array, IsOk());
  EXPECT_THAT(array->shape, ElementsAre(2, 3, 4));
  const std::vector<float> values = array->ToFloats();
  ASSERT_EQ(values.size(), 24u);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(values[i], i / 8.0f - 1.0f) << i;
}

TEST(Npy, MissingFileIsNotFoundAndNamesThePath) {
  EXPECT_THAT(ReadNpyFile("/nonexistent/missing.npy"),
              StatusIs(absl::StatusCode::kNotFound, "/nonexistent/missing.npy"));
}

struct MalformedCase {
  std::string name;
  std::string bytes;
  std::string message;
};

TEST(Npy, MalformedFilesAreRejectedWithAClearMessage) {
  const std::string header_2x2 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
  const std::string data_2x2 = FloatBytes({1, 2, 3, 4});
  const std::string good = NpyBytes(header_2x2, data_2x2);
  const std::vector<MalformedCase> cases = {
      {"empty", "", "not a .npy file"},
      {"text", "hello, world\n", "not a .npy file"},
      {"magic only", std::string("\x93NUMPY", 6), "no version"},
      {"no header length", std::string("\x93NUMPY\x01\x00\x10", 9), "no header length"},
      {"version 3", NpyBytes(header_2x2, data_2x2).replace(6, 1, "\x03"), "version 3.0"},
      {"header past the end", good.substr(0, 40), "truncated .npy file (the header says"},
      {"truncated data", good.substr(0, good.size() - 3), "truncated .npy file: shape (2, 2)"},
      {"trailing data", good + "xyz", "size mismatch: shape (2, 2) of <f4 needs 16"},
      {"fortran order",
       NpyBytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", data_2x2),
       "fortran_order is True"},
      {"float64", NpyBytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", data_2x2),
       "dtype '<f8' is not supported"},
      {"big-endian",
       NpyBytes("{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }", data_2x2),
       "big-endian"},
      {"structured",
       NpyBytes("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (4,), }", data_2x2),
       "structured dtypes"},
      {"no shape", NpyBytes("{'descr': '<f4', 'fortran_order': False, }", data_2x2), "no 'shape'"},
      {"no descr", NpyBytes("{'fortran_order': False, 'shape': (4,), }", data_2x2), "no 'descr'"},
      {"extra key",
       NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), 'x': 1, }", data_2x2),
       "unexpected key 'x'"},
      {"duplicate key",
       NpyBytes("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (4,), }",
                data_2x2),
       "'descr' appears twice"},
      {"not a dict", NpyBytes("['<f4', False, (4,)]", data_2x2), "not a Python dict"},
      {"negative dimension",
       NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-1, 4), }", data_2x2),
       "negative dimension"},
      {"shape not a tuple",
       NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': 4, }", data_2x2), "not a tuple"},
      {"overflowing dimension",
       NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
                data_2x2),
       "overflows int64"},
      {"overflowing size",
       NpyBytes("{'descr': '<f4', 'fortran_order': False, "
                "'shape': (4294967296, 4294967296), }",
                data_2x2),
       "too large"},
      {"unterminated string", NpyBytes("{'descr: '<f4', 'fortran_order': False}", data_2x2),
       "expected ':'"},
      {"text after the dict",
       NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), } x", data_2x2),
       "unexpected text after the header dict"},
      {"bad fortran_order",
       NpyBytes("{'descr': '<f4', 'fortran_order': 0, 'shape': (4,), }", data_2x2),
       "not True or False"},
  };
  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<NpyArray> array = ParseNpy(c.bytes, "/data/bad.npy");
    EXPECT_THAT(array, StatusIs(absl::StatusCode::kInvalidArgument, c.message));
    // Every message names the file.
    EXPECT_THAT(array.status().message(), HasSubstr("/data/bad.npy: "));
  }
  EXPECT_THAT(ParseNpy(good, "good.npy"), IsOk());
}

TEST(Npy, AcceptsHeadersWithOtherSpacingAndKeyOrder) {
  const std::string data = FloatBytes({1, 2, 3});
  for (const std::string& header : {
           std::string("{'shape': (3,), 'fortran_order': False, 'descr': '<f4'}"),
           std::string("{\"descr\":\"<f4\",\"fortran_order\":False,\"shape\":(3L,)}"),
           std::string("  { 'descr' : '<f4' , 'fortran_order' : False , 'shape' : ( 3 , ) , }  "),
       }) {
    SCOPED_TRACE(header);
    absl::StatusOr<NpyArray> array = ParseNpy(NpyBytes(header, data), "spaced.npy");
    ASSERT_THAT(array, IsOk());
    EXPECT_THAT(array->ToFloats(), ElementsAre(1, 2, 3));
  }
  // Version 2.0's 4-byte header length.
  absl::StatusOr<NpyArray> v2 = ParseNpy(
      NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", data, 2), "v2.npy");
  ASSERT_THAT(v2, IsOk());
  EXPECT_THAT(v2->shape, ElementsAre(3));
}

TEST(FileIo, WritesAndReadsBytes) {
  const std::string path = TempPath("bytes.bin");
  ASSERT_THAT(WriteFileBytes(path, std::string("a\0b", 3)), IsOk());
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(*bytes, std::string("a\0b", 3));
}

}  // namespace
}  // namespace attnserve::client
