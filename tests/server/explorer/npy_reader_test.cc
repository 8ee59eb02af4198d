// ReadNpy on files written by NumPy (the fuzz corpus' valid_* seeds, made by
// tests/fuzz/make_npy_corpus.py) and by hand here: every version (1.0, 2.0,
// 3.0), dtype ('<f4', '<f8') and shape the explorer takes, header variants
// NumPy writes; and each malformed case refused with INVALID_ARGUMENT naming
// the field and the part. WriteNpyFloat32's files read back.
#include "server/explorer/npy_reader.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/explorer/npy_writer.h"
#include "tests/core/status_matchers.h"

namespace attnserve::server {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

// A .npy file: magic, version, a length field of the version's width, the
// header as given (the caller adds the newline), then the data.
std::string File(int major, const std::string& header, const std::string& data) {
  std::string out = absl::StrCat("\x93NUMPY", std::string(1, static_cast<char>(major)),
                                 std::string(1, '\0'));
  const uint32_t length = static_cast<uint32_t>(header.size());
  const int width = major == 1 ? 2 : 4;
  for (int i = 0; i < width; ++i) out += static_cast<char>((length >> (8 * i)) & 0xff);
  return out + header + data;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

std::string Header(const std::string& descr, const std::string& shape, bool fortran = false) {
  return absl::StrCat("{'descr': '", descr, "', 'fortran_order': ", fortran ? "True" : "False",
                      ", 'shape': ", shape, ", }\n");
}

void ExpectRefused(const std::string& file, const std::string& part_and_text) {
  EXPECT_THAT(ReadNpy(file, "inputs.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument, absl::StrCat("inputs.npy: ", part_and_text)));
}

TEST(NpyReader, ReadsEveryVersionAndDtypeAsFloat32) {
  const std::vector<float> f4 = {1.5f, -2.25f, 3.0f, 0.0f, 1e-20f, -7.0f};
  const std::vector<double> f8 = {0.1, -2.5, 1e30, 3.0, -0.0, 6.25};
  for (int major : {1, 2, 3}) {
    SCOPED_TRACE(major);
    absl::StatusOr<NpyArray> a = ReadNpy(File(major, Header("<f4", "(2, 3)"), Bytes(f4)), "x");
    ASSERT_THAT(a, IsOk());
    EXPECT_THAT(a->shape, ElementsAre(2, 3));
    EXPECT_EQ(a->descr, "<f4");
    EXPECT_THAT(a->values, ElementsAreArray(f4));

    absl::StatusOr<NpyArray> b = ReadNpy(File(major, Header("<f8", "(1, 3, 2)"), Bytes(f8)), "x");
    ASSERT_THAT(b, IsOk());
    EXPECT_THAT(b->shape, ElementsAre(1, 3, 2));
    EXPECT_EQ(b->descr, "<f8");
    for (size_t i = 0; i < f8.size(); ++i) EXPECT_EQ(b->values[i], static_cast<float>(f8[i]));
  }
}

TEST(NpyReader, AcceptsTheHeaderForms) {
  const std::string four = Bytes(std::vector<float>{1, 2, 3, 4});
  // Double quotes, no trailing comma, another key order, padding, 1-D.
  for (const std::string& header :
       {std::string("{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (4,)}\n"),
        std::string("{'shape': (2, 2), 'fortran_order': False, 'descr': '<f4'}          \n"),
        std::string("{'descr':'<f4','fortran_order':False,'shape':(1,4,),}\n"),
        std::string("{'descr': '<f4', 'fortran_order': False, 'shape': (4L,), }\n")}) {
    SCOPED_TRACE(header);
    absl::StatusOr<NpyArray> a = ReadNpy(File(1, header, four), "x");
    ASSERT_THAT(a, IsOk());
    EXPECT_THAT(a->values, ElementsAre(1, 2, 3, 4));
  }
  absl::StatusOr<NpyArray> scalar = ReadNpy(File(1, Header("<f4", "()"), Bytes(std::vector<float>{9})), "x");
  ASSERT_THAT(scalar, IsOk());
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_THAT(scalar->values, ElementsAre(9));
}

TEST(NpyReader, ReadsTheFilesNumPyWrote) {
  int read = 0;
  for (const auto& entry : std::filesystem::directory_iterator(ATTNSERVE_NPY_CORPUS)) {
    const std::string name = entry.path().filename().string();
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    SCOPED_TRACE(name);
    if (name.rfind("valid_", 0) == 0) {
      EXPECT_THAT(ReadNpy(bytes, "inputs.npy"), IsOk());
      ++read;
    } else if (name.rfind("invalid_", 0) == 0) {
      EXPECT_THAT(ReadNpy(bytes, "inputs.npy"), StatusIs(absl::StatusCode::kInvalidArgument, "inputs.npy: "));
    }
  }
  EXPECT_GE(read, 8);
}

TEST(NpyReader, WrittenFilesReadBack) {
  const std::vector<float> values = {0.5f, -1.0f, 2.0f, 3.5f, -4.0f, 5.0f};
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{6}, std::vector<int64_t>{2, 3}, std::vector<int64_t>{1, 3, 2}}) {
    const std::string file = WriteNpyFloat32(shape, values);
    EXPECT_EQ((file.size() - values.size() * 4) % 64, 0u);
    absl::StatusOr<NpyArray> a = ReadNpy(file, "x");
    ASSERT_THAT(a, IsOk());
    EXPECT_EQ(a->shape, shape);
    EXPECT_THAT(a->values, ElementsAreArray(values));
  }
}

TEST(NpyReader, RefusesEachMalformedPartNamingIt) {
  const std::string six = Bytes(std::vector<float>{1, 2, 3, 4, 5, 6});
  ExpectRefused("", "magic: ");
  ExpectRefused("PK\x03\x04 a zip file", "magic: ");
  ExpectRefused(std::string("\x93NUMPY\x01", 7), "version: ");
  ExpectRefused(File(4, Header("<f4", "(2, 3)"), six), "version: 4.0 is not supported, expected 1.0, 2.0 or 3.0");
  ExpectRefused(std::string("\x93NUMPY\x01\x00\x10", 9), "header length: ");
  ExpectRefused(File(1, Header("<f4", "(2, 3)"), six).substr(0, 30), "header length: ");
  // A 4 GiB header length in a version 2.0 file.
  ExpectRefused(std::string("\x93NUMPY\x02\x00\xff\xff\xff\xff", 12), "header length: 4294967295 bytes is over the limit");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", six),
                "header: expected it to end with a newline");
  ExpectRefused(File(1, "['descr', '<f4']\n", six), "header: expected '{'");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': False}\n", six), "header: the key 'shape' is missing");
  ExpectRefused(File(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (6,)}\n", six),
                "header: the key 'descr' appears twice");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}\n", six),
                "header: unknown key 'x'");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (6,)}\n", six),
                "header: fortran_order: expected True or False");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (6,)} x\n", six),
                "header: text after the closing '}'");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-6,)}\n", six), "header: shape: ");
  ExpectRefused(File(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2.5,)}\n", six), "header: shape: ");
  ExpectRefused(File(1, "{'descr': '\xe9', 'fortran_order': False, 'shape': (6,)}\n", six),
                "header: expected ASCII text");
  ExpectRefused(File(1, Header(">f4", "(2, 3)"), six), "descr: '>f4' is not supported, expected '<f4'");
  ExpectRefused(File(1, Header("<f2", "(2, 3)"), six), "descr: '<f2' is not supported");
  ExpectRefused(File(1, Header("|b1", "(2, 3)"), six), "descr: '|b1' is not supported");
  ExpectRefused(File(1, Header("<f4", "(2, 3)", /*fortran=*/true), six),
                "fortran_order: True is not supported, expected False");
  ExpectRefused(File(1, Header("<f4", "(2, 3)"), six.substr(1)), "data: 23 bytes, expected 24 for shape (2, 3) of <f4");
  ExpectRefused(File(1, Header("<f4", "(2, 3)"), six + "x"), "data: 25 bytes, expected 24");
  ExpectRefused(File(1, Header("<f4", "(3,)"), six), "data: 24 bytes, expected 12 for shape (3,)");
}

TEST(NpyReader, RefusesHugeAndOverflowingShapesBeforeAllocating) {
  ExpectRefused(File(1, Header("<f4", "(4294967296, 4294967296)"), ""), "shape: (4294967296, 4294967296) has more than int64 elements");
  ExpectRefused(File(1, Header("<f4", "(99999999999999999999,)"), ""), "shape: a dimension is larger than int64");
  ExpectRefused(File(1, Header("<f8", "(1048576, 1048576)"), ""), "shape: (1048576, 1048576) has 1099511627776 elements, over the limit");
  ExpectRefused(File(1, Header("<f4", "(1, 1, 1, 1, 1, 1, 1, 1, 1)"), "\0\0\0\0"), "shape: more than 8 dimensions");
  NpyReadLimits small;
  small.max_elements = 5;
  EXPECT_THAT(ReadNpy(File(1, Header("<f4", "(2, 3)"), std::string(24, '\0')), "inputs.npy", small),
              StatusIs(absl::StatusCode::kInvalidArgument, "inputs.npy: shape: (2, 3) has 6 elements, over the limit of 5"));
}

TEST(NpyReader, RefusesValuesThatAreNotFinite) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ExpectRefused(File(1, Header("<f4", "(3,)"), Bytes(std::vector<float>{1, nan, 2})), "data: element 1 is nan");
  ExpectRefused(File(1, Header("<f8", "(2,)"), Bytes(std::vector<double>{1, -INFINITY})), "data: element 1 is -inf");
  ExpectRefused(File(1, Header("<f8", "(2,)"), Bytes(std::vector<double>{1e300, 1})),
                "data: element 0 is 1e+300 (beyond float32's range)");
}

}  // namespace
}  // namespace attnserve::server
