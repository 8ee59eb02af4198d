#include "cli/npy.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_files.h"
#include "tests/core/status_matchers.h"

namespace attnserve::cli {
namespace {

using ::attnserve::client::TempPath;
using ::attnserve::client::TestData;
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
  // No buffer to copy from (libFuzzer + UBSan found a memcpy of a null one).
  EXPECT_TRUE(empty->ToFloats().empty());
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

// Both directions against the NumPy installed on this machine.
TEST(Npy, AgreesWithNumpyBothWays) {
  ASSERT_TRUE(NumpyAvailable()) << "/usr/bin/python3 with numpy is a test dependency (deploy/install_deps.sh)";
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

// Little-endian bytes of `values`, each `size` bytes wide (two's complement
// for negative integers).
std::string IntBytes(const std::vector<int64_t>& values, int size, bool big_endian = false) {
  std::string bytes;
  for (int64_t v : values) {
    for (int b = 0; b < size; ++b) {
      const int shift = 8 * (big_endian ? size - 1 - b : b);
      bytes.push_back(static_cast<char>((static_cast<uint64_t>(v) >> shift) & 0xff));
    }
  }
  return bytes;
}

std::string DoubleBytes(const std::vector<double>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(double));
}

std::string Header(const std::string& descr, const std::string& shape, bool fortran = false) {
  return absl::StrCat("{'descr': '", descr, "', 'fortran_order': ", fortran ? "True" : "False",
                      ", 'shape': ", shape, ", }");
}

// IEEE 754 binary16 bit patterns and their values by the format's definition
// (sign, 5-bit exponent with bias 15, 10-bit fraction; subnormals below 2^-14).
TEST(Npy, Float16IsConvertedToItsExactFloat32Values) {
  const std::vector<int64_t> halves = {0x3C00, 0xC000, 0x3555, 0x7BFF, 0x0001, 0x03FF,
                                       0x0400, 0x8000, 0x7C00, 0xFC00, 0x7E00};
  const std::vector<float> expected = {1.0f,
                                       -2.0f,
                                       0.333251953125f,         // 0x155 / 2^10 + 1, * 2^-2
                                       65504.0f,                // the largest half
                                       5.9604644775390625e-8f,  // 2^-24, the smallest subnormal
                                       6.0975551605224609e-5f,  // 1023 * 2^-24
                                       6.103515625e-5f,         // 2^-14, the smallest normal
                                       -0.0f,
                                       std::numeric_limits<float>::infinity(),
                                       -std::numeric_limits<float>::infinity()};
  absl::StatusOr<NpyArray> array =
      ParseNpy(NpyBytes(Header("<f2", "(11,)"), IntBytes(halves, 2)), "half.npy");
  ASSERT_THAT(array, IsOk());
  EXPECT_EQ(array->dtype, NpyDtype::kFloat32);
  EXPECT_EQ(array->converted_from, "float16");
  EXPECT_EQ(NpyConversionNote(*array), "converted float16 -> float32");
  const std::vector<float> values = array->ToFloats();
  ASSERT_EQ(values.size(), 11u);
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(values[i], expected[i]) << i;
    EXPECT_EQ(std::signbit(values[i]), std::signbit(expected[i])) << i;
  }
  EXPECT_TRUE(std::isnan(values[10]));
}

TEST(Npy, Float64IsRoundedToFloat32) {
  // 0.1 is not a float: the nearest float is 0x3DCCCCCD. 2^-150 is half the
  // smallest float subnormal and rounds to even (zero); 2^-149 is that
  // subnormal. Infinities and NaN stay what they are.
  const std::vector<double> doubles = {1.0,
                                       -2.5,
                                       0.1,
                                       std::ldexp(1.0, -150),
                                       std::ldexp(1.0, -149),
                                       -std::numeric_limits<double>::infinity(),
                                       std::numeric_limits<double>::quiet_NaN()};
  absl::StatusOr<NpyArray> array =
      ParseNpy(NpyBytes(Header("<f8", "(7,)"), DoubleBytes(doubles)), "f8.npy");
  ASSERT_THAT(array, IsOk());
  EXPECT_EQ(NpyConversionNote(*array), "converted float64 -> float32");
  const std::vector<float> values = array->ToFloats();
  ASSERT_EQ(values.size(), 7u);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -2.5f);
  EXPECT_EQ(std::bit_cast<uint32_t>(values[2]), 0x3DCCCCCDu);
  EXPECT_EQ(std::bit_cast<uint32_t>(values[3]), 0u);
  EXPECT_EQ(std::bit_cast<uint32_t>(values[4]), 1u);
  EXPECT_EQ(values[5], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(values[6]));
}

TEST(Npy, Float64BeyondFloat32sRangeIsRefusedNamingTheFileAndElement) {
  // FLT_MAX's next double up still rounds to FLT_MAX; 1e39 cannot.
  const std::vector<double> doubles = {3.4028234663852886e38, 1e39};
  EXPECT_THAT(ParseNpy(NpyBytes(Header("<f8", "(2,)"), DoubleBytes(doubles)), "/data/big.npy"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "/data/big.npy: element 1 (1e+39) is outside float32's range"));
  absl::StatusOr<NpyArray> fits =
      ParseNpy(NpyBytes(Header("<f8", "(1,)"), DoubleBytes({3.4028234663852886e38})), "max.npy");
  ASSERT_THAT(fits, IsOk());
  EXPECT_EQ(fits->ToFloats()[0], std::numeric_limits<float>::max());
}

TEST(Npy, IntegersAndBigEndianDataAreConverted) {
  struct Case {
    std::string descr;
    std::string data;
    std::vector<float> expected;
    std::string note;
  };
  const std::vector<Case> cases = {
      {"|i1", IntBytes({-128, 127, -1}, 1), {-128, 127, -1}, "converted int8 -> float32"},
      {"<i2", IntBytes({-2, 300, 0}, 2), {-2, 300, 0}, "converted int16 -> float32"},
      {">i2", IntBytes({-2, 300, 0}, 2, true), {-2, 300, 0}, "converted int16 (big-endian) -> float32"},
      {"<i4", IntBytes({-70000, 1, 2}, 4), {-70000, 1, 2}, "converted int32 -> float32"},
      {"<i8", IntBytes({-3, int64_t{1} << 40, 5}, 8), {-3, 1099511627776.0f, 5},
       "converted int64 -> float32"},
      {"<u2", IntBytes({65535, 0, 7}, 2), {65535, 0, 7}, "converted uint16 -> float32"},
      {">u4", IntBytes({4000000000, 1, 2}, 4, true), {4e9f, 1, 2},
       "converted uint32 (big-endian) -> float32"},
      // 1.5f is 0x3FC00000; -0.25f is 0xBE800000.
      {">f4", IntBytes({0x3FC00000, 0xBE800000, 0}, 4, true), {1.5f, -0.25f, 0},
       "converted float32 (big-endian) -> float32"},
      // 2.5 is 0x4004000000000000.
      {">f8", IntBytes({0x4004000000000000, 0, 0}, 8, true), {2.5f, 0, 0},
       "converted float64 (big-endian) -> float32"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.descr);
    absl::StatusOr<NpyArray> array = ParseNpy(NpyBytes(Header(c.descr, "(3,)"), c.data), "i.npy");
    ASSERT_THAT(array, IsOk());
    EXPECT_EQ(array->dtype, NpyDtype::kFloat32);
    EXPECT_EQ(array->ToFloats(), c.expected);
    EXPECT_EQ(NpyConversionNote(*array), c.note);
  }
}

TEST(Npy, FloatsBoolsAndBytesInCOrderAreReadAsStored) {
  for (const auto& [descr, size] : std::vector<std::pair<std::string, int>>{
           {"<f4", 4}, {"|b1", 1}, {"|u1", 1}}) {
    absl::StatusOr<NpyArray> array =
        ParseNpy(NpyBytes(Header(descr, "(2,)"), std::string(2 * size, '\x01')), "a.npy");
    ASSERT_THAT(array, IsOk()) << descr;
    EXPECT_EQ(array->converted_from, "") << descr;
    EXPECT_EQ(NpyConversionNote(*array), "") << descr;
    EXPECT_EQ(array->data, std::string(2 * size, '\x01')) << descr;
  }
}

TEST(Npy, FortranOrderIsReorderedToCOrder) {
  // a = [[1, 2, 3], [4, 5, 6]] stored column by column.
  absl::StatusOr<NpyArray> floats = ParseNpy(
      NpyBytes(Header("<f4", "(2, 3)", /*fortran=*/true), FloatBytes({1, 4, 2, 5, 3, 6})), "f.npy");
  ASSERT_THAT(floats, IsOk());
  EXPECT_THAT(floats->shape, ElementsAre(2, 3));
  EXPECT_THAT(floats->ToFloats(), ElementsAre(1, 2, 3, 4, 5, 6));
  EXPECT_EQ(NpyConversionNote(*floats), "converted Fortran order -> float32, C order");
  // A mask stays a mask: booleans, reordered.
  absl::StatusOr<NpyArray> mask = ParseNpy(
      NpyBytes(Header("|b1", "(2, 2)", /*fortran=*/true), std::string("\x01\x00\x01\x01", 4)),
      "m.npy");
  ASSERT_THAT(mask, IsOk());
  EXPECT_EQ(mask->dtype, NpyDtype::kBool);
  EXPECT_THAT(mask->ToFloats(), ElementsAre(1, 1, 0, 1));
  EXPECT_EQ(NpyConversionNote(*mask), "converted Fortran order -> bool, C order");
  // Both at once: [[1, 2], [3, 4]] as float64, column by column.
  absl::StatusOr<NpyArray> both = ParseNpy(
      NpyBytes(Header("<f8", "(2, 2)", /*fortran=*/true), DoubleBytes({1, 3, 2, 4})), "b.npy");
  ASSERT_THAT(both, IsOk());
  EXPECT_THAT(both->ToFloats(), ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(NpyConversionNote(*both), "converted float64, Fortran order -> float32, C order");
}

TEST(Npy, HeaderAloneGivesWhatReadingWouldWithoutReadingTheData) {
  const std::string path = TempPath("header_only.npy");
  // Data one element short: the whole read fails, the header read does not.
  ASSERT_THAT(WriteFileBytes(path, NpyBytes(Header("<f8", "(4, 5)"), DoubleBytes({1, 2, 3}))),
              IsOk());
  absl::StatusOr<NpyArray> header = ReadNpyHeader(path);
  ASSERT_THAT(header, IsOk());
  EXPECT_EQ(header->dtype, NpyDtype::kFloat32);
  EXPECT_THAT(header->shape, ElementsAre(4, 5));
  EXPECT_TRUE(header->data.empty());
  EXPECT_EQ(NpyConversionNote(*header), "converted float64 -> float32");
  EXPECT_THAT(ReadNpyFile(path), StatusIs(absl::StatusCode::kInvalidArgument, "truncated"));
  // Version 2.0's 4-byte header length.
  const std::string v2 = TempPath("header_only_v2.npy");
  ASSERT_THAT(WriteFileBytes(v2, NpyBytes(Header("<f2", "(3,)"), "", 2)), IsOk());
  absl::StatusOr<NpyArray> v2_header = ReadNpyHeader(v2);
  ASSERT_THAT(v2_header, IsOk());
  EXPECT_THAT(v2_header->shape, ElementsAre(3));
  EXPECT_EQ(v2_header->converted_from, "float16");
  EXPECT_THAT(ReadNpyHeader("/nonexistent/h.npy"),
              StatusIs(absl::StatusCode::kNotFound, "/nonexistent/h.npy"));
}

// NumPy writes float64 (its default), float16, int64 and Fortran-order files
// of fresh random values, and the same values converted by its own astype('<f4')
// in C order: ours must equal NumPy's conversion bit for bit.
TEST(Npy, ConversionsEqualNumpysAstypeBitForBit) {
  ASSERT_TRUE(NumpyAvailable()) << "/usr/bin/python3 with numpy is a test dependency (deploy/install_deps.sh)";
  const std::string dir = TempPath("numpy_conversions");
  std::filesystem::create_directories(dir);
  const std::string script = absl::StrCat(
      "/usr/bin/python3 -c \"\n"
      "import numpy as np\n"
      "rng = np.random.default_rng()\n"
      "d = '", dir, "'\n"
      "f8 = rng.standard_normal((3, 4, 5)) * 10.0 ** rng.integers(-30, 30, (3, 4, 5))\n"
      "arrays = {'f8': f8, 'f2': rng.standard_normal((7, 9)).astype('<f2'),\n"
      "          'i8': rng.integers(-2**40, 2**40, (6, 5)),\n"
      "          'fortran': np.asfortranarray(rng.standard_normal((4, 3, 2))),\n"
      "          'big': rng.standard_normal((5,)).astype('>f8')}\n"
      "for name, a in arrays.items():\n"
      "    np.save(f'{d}/{name}.npy', a)\n"
      "    np.save(f'{d}/{name}_f4.npy', np.ascontiguousarray(a.astype('<f4')))\n"
      "\"");
  ASSERT_EQ(std::system(script.c_str()), 0) << script;
  for (const std::string name : {"f8", "f2", "i8", "fortran", "big"}) {
    SCOPED_TRACE(name);
    absl::StatusOr<NpyArray> ours = ReadNpyFile(absl::StrCat(dir, "/", name, ".npy"));
    absl::StatusOr<NpyArray> numpys = ReadNpyFile(absl::StrCat(dir, "/", name, "_f4.npy"));
    ASSERT_THAT(ours, IsOk());
    ASSERT_THAT(numpys, IsOk());
    EXPECT_FALSE(ours->converted_from.empty());
    EXPECT_TRUE(numpys->converted_from.empty());
    EXPECT_EQ(ours->shape, numpys->shape);
    EXPECT_EQ(ours->data, numpys->data);
  }
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

// `bytes` with byte `at` set to `value`. (GCC 12's -Wrestrict misreads
// std::string::replace of one byte at -O3.)
std::string WithByte(std::string bytes, size_t at, char value) {
  bytes[at] = value;
  return bytes;
}

TEST(Npy, MalformedFilesAreRejectedWithAClearMessage) {
  const std::string header_2x2 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
  const std::string data_2x2 = FloatBytes({1, 2, 3, 4});
  const std::string good = NpyBytes(header_2x2, data_2x2);
  const std::vector<MalformedCase> cases = {
      {"empty", "", "not a .npy file"},
      {"text", "hello, world\n", "not a .npy file"},
      {"magic only", std::string("\x93NUMPY", 6), "no version"},
      {"no header length", std::string("\x93NUMPY\x01\x00\x10", 9), "no header length"},
      {"version 4", NpyBytes(header_2x2, data_2x2, 4), "version 4.0 is not supported"},
      {"version 1.1", WithByte(NpyBytes(header_2x2, data_2x2), 7, '\x01'), "version 1.1"},
      {"header past the end", good.substr(0, 40), "truncated .npy file (the header says"},
      {"truncated data", good.substr(0, good.size() - 3), "truncated .npy file: shape (2, 2)"},
      {"trailing data", good + "xyz", "size mismatch: shape (2, 2) of <f4 needs 16"},
      {"complex", NpyBytes("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", data_2x2),
       "dtype '<c8' cannot be converted to float32"},
      {"strings", NpyBytes("{'descr': '<U4', 'fortran_order': False, 'shape': (1,), }", data_2x2),
       "dtype '<U4' cannot be converted"},
      {"datetimes",
       NpyBytes("{'descr': '<M8[s]', 'fortran_order': False, 'shape': (2,), }", data_2x2),
       "dtype '<M8[s]' cannot be converted"},
      {"objects", NpyBytes("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", data_2x2),
       "dtype '|O' cannot be converted"},
      {"float128",
       NpyBytes("{'descr': '<f16', 'fortran_order': False, 'shape': (1,), }", data_2x2),
       "dtype '<f16' cannot be converted"},
      {"float64 data of the wrong size",
       NpyBytes("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", data_2x2),
       "truncated .npy file: shape (3,) of <f8 needs 24 data bytes, the file has 16"},
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
  // Versions 2.0 and 3.0: a 4-byte header length.
  for (char major : {2, 3}) {
    absl::StatusOr<NpyArray> v = ParseNpy(
        NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", data, major), "v.npy");
    ASSERT_THAT(v, IsOk());
    EXPECT_THAT(v->shape, ElementsAre(3));
    EXPECT_THAT(v->ToFloats(), ElementsAre(1, 2, 3));
  }
}

// The attention explorer parses uploads with limits: each is refused before
// anything of the refused size is allocated, naming the file.
TEST(Npy, LimitsRefuseLongHeadersManyDimensionsAndElements) {
  NpyLimits limits;
  limits.max_header_bytes = 128;
  limits.max_dims = 3;
  limits.max_elements = 5;
  const std::string six = FloatBytes({1, 2, 3, 4, 5, 6});
  EXPECT_THAT(ParseNpy(NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", six),
                       "inputs.npy", limits),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "inputs.npy: shape (2, 3) has 6 elements, over the limit of 5"));
  EXPECT_THAT(
      ParseNpy(NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1), }",
                        FloatBytes({1})),
               "inputs.npy", limits),
      StatusIs(absl::StatusCode::kInvalidArgument, "inputs.npy: bad .npy header: more than 3 dimensions"));
  // A version 2.0 file whose header length says 4 GiB: refused from the
  // length alone (the file is 12 bytes).
  EXPECT_THAT(ParseNpy(std::string("\x93NUMPY\x02\x00\xff\xff\xff\xff", 12), "inputs.npy", limits),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "inputs.npy: bad .npy header: 4294967295 bytes long, over the limit of 128"));
  EXPECT_THAT(ParseNpy(NpyBytes(std::string(200, ' ') + "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }",
                                FloatBytes({1})),
                       "inputs.npy", limits),
              StatusIs(absl::StatusCode::kInvalidArgument, "over the limit of 128"));
  // Within every limit the same parser accepts.
  absl::StatusOr<NpyArray> small = ParseNpy(
      NpyBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", FloatBytes({1, 2, 3, 4, 5})),
      "inputs.npy", limits);
  ASSERT_THAT(small, IsOk());
  EXPECT_THAT(small->ToFloats(), ElementsAre(1, 2, 3, 4, 5));
}

// The fuzz corpus' seeds (tests/fuzz/make_npy_corpus.py: valid_* written by
// NumPy in versions 1.0-3.0; invalid_* malformed) read as their names say.
TEST(Npy, ReadsTheFuzzCorpusSeedsAsTheirNamesSay) {
  int valid = 0, invalid = 0;
  for (const auto& entry : std::filesystem::directory_iterator(ATTNSERVE_NPY_CORPUS)) {
    const std::string name = entry.path().filename().string();
    absl::StatusOr<std::string> bytes = ReadFileBytes(entry.path().string());
    ASSERT_THAT(bytes, IsOk());
    SCOPED_TRACE(name);
    if (name.rfind("valid_", 0) == 0) {
      EXPECT_THAT(ParseNpy(*bytes, "inputs.npy"), IsOk());
      ++valid;
    } else if (name.rfind("invalid_", 0) == 0) {
      EXPECT_THAT(ParseNpy(*bytes, "inputs.npy"),
                  StatusIs(absl::StatusCode::kInvalidArgument, "inputs.npy: "));
      ++invalid;
    }
  }
  EXPECT_GE(valid, 8);
  EXPECT_GE(invalid, 3);
}

TEST(FileIo, WritesAndReadsBytes) {
  const std::string path = TempPath("bytes.bin");
  ASSERT_THAT(WriteFileBytes(path, std::string("a\0b", 3)), IsOk());
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(*bytes, std::string("a\0b", 3));
}

}  // namespace
}  // namespace attnserve::cli
