#include "client/png.h"

#include <zlib.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/file_io.h"
#include "client/bitmap_font.h"
#include "client/heatmap.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_files.h"
#include "tests/core/status_matchers.h"

namespace attnserve::client {

using ::attnserve::cli::ReadFileBytes;

namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;

uint32_t BigEndian32(const std::string& bytes, size_t at) {
  return uint32_t{static_cast<unsigned char>(bytes[at])} << 24 |
         uint32_t{static_cast<unsigned char>(bytes[at + 1])} << 16 |
         uint32_t{static_cast<unsigned char>(bytes[at + 2])} << 8 |
         uint32_t{static_cast<unsigned char>(bytes[at + 3])};
}

// An independent reader of 8-bit RGB PNGs: checks the signature, every
// chunk's CRC and the chunk order, inflates the IDAT data with zlib and undoes
// the scanline filters (all five kinds).
struct DecodedPng {
  int width = 0, height = 0;
  int bit_depth = 0, colour_type = 0, interlace = 0;
  std::vector<uint8_t> rgb;
  std::vector<std::string> chunk_types;

  Rgb Pixel(int x, int y) const {
    const uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
    return Rgb{p[0], p[1], p[2]};
  }
};

int Paeth(int a, int b, int c) {
  const int p = a + b - c;
  const int pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  if (pa <= pb && pa <= pc) return a;
  return pb <= pc ? b : c;
}

::testing::AssertionResult DecodePng(const std::string& png, DecodedPng* out) {
  if (png.substr(0, 8) != std::string("\x89PNG\r\n\x1a\n", 8)) {
    return ::testing::AssertionFailure() << "bad signature";
  }
  std::string idat;
  size_t at = 8;
  while (at < png.size()) {
    if (at + 12 > png.size()) return ::testing::AssertionFailure() << "truncated chunk at " << at;
    const uint32_t length = BigEndian32(png, at);
    if (at + 12 + length > png.size()) return ::testing::AssertionFailure() << "chunk past the end";
    const std::string type = png.substr(at + 4, 4);
    const std::string data = png.substr(at + 8, length);
    const uint32_t crc = BigEndian32(png, at + 8 + length);
    const uLong expected = crc32(crc32(0L, Z_NULL, 0),
                                 reinterpret_cast<const Bytef*>(png.data() + at + 4), 4 + length);
    if (crc != expected) return ::testing::AssertionFailure() << "bad CRC in " << type;
    out->chunk_types.push_back(type);
    if (type == "IHDR") {
      if (length != 13) return ::testing::AssertionFailure() << "IHDR length " << length;
      out->width = static_cast<int>(BigEndian32(data, 0));
      out->height = static_cast<int>(BigEndian32(data, 4));
      out->bit_depth = static_cast<unsigned char>(data[8]);
      out->colour_type = static_cast<unsigned char>(data[9]);
      out->interlace = static_cast<unsigned char>(data[12]);
    } else if (type == "IDAT") {
      idat += data;
    }
    at += 12 + length;
  }
  if (out->chunk_types.empty() || out->chunk_types.front() != "IHDR" ||
      out->chunk_types.back() != "IEND") {
    return ::testing::AssertionFailure() << "IHDR must come first and IEND last";
  }
  if (out->bit_depth != 8 || out->colour_type != 2 || out->interlace != 0) {
    return ::testing::AssertionFailure() << "not 8-bit non-interlaced RGB";
  }
  const size_t stride = static_cast<size_t>(out->width) * 3;
  std::vector<uint8_t> raw((stride + 1) * out->height);
  uLongf raw_size = raw.size();
  if (uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(idat.data()), idat.size()) !=
          Z_OK ||
      raw_size != raw.size()) {
    return ::testing::AssertionFailure() << "IDAT does not inflate to height x (1 + 3 x width)";
  }
  out->rgb.assign(stride * out->height, 0);
  for (int y = 0; y < out->height; ++y) {
    const int filter = raw[y * (stride + 1)];
    const uint8_t* line = &raw[y * (stride + 1) + 1];
    uint8_t* row = &out->rgb[y * stride];
    const uint8_t* up = y > 0 ? &out->rgb[(y - 1) * stride] : nullptr;
    for (size_t i = 0; i < stride; ++i) {
      const int a = i >= 3 ? row[i - 3] : 0, b = up ? up[i] : 0, c = up && i >= 3 ? up[i - 3] : 0;
      int predictor = 0;
      switch (filter) {
        case 0:
          predictor = 0;
          break;
        case 1:
          predictor = a;
          break;
        case 2:
          predictor = b;
          break;
        case 3:
          predictor = (a + b) / 2;
          break;
        case 4:
          predictor = Paeth(a, b, c);
          break;
        default:
          return ::testing::AssertionFailure() << "filter type " << filter;
      }
      row[i] = static_cast<uint8_t>(line[i] + predictor);
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(Png, EncodedImageDecodesToTheSamePixels) {
  RgbImage image(7, 5, Rgb{10, 20, 30});
  image.Set(0, 0, Rgb{255, 0, 0});
  image.Set(6, 4, Rgb{0, 255, 0});
  image.FillRect(2, 1, 3, 2, Rgb{1, 2, 3});
  image.Set(-1, 2, Rgb{9, 9, 9});  // clipped, not a crash
  absl::StatusOr<std::string> png = EncodePng(image);
  ASSERT_THAT(png, IsOk());
  DecodedPng decoded;
  ASSERT_TRUE(DecodePng(*png, &decoded));
  EXPECT_EQ(decoded.width, 7);
  EXPECT_EQ(decoded.height, 5);
  EXPECT_EQ(decoded.rgb, image.pixels());
  EXPECT_EQ(decoded.Pixel(0, 0), (Rgb{255, 0, 0}));
  EXPECT_EQ(decoded.Pixel(6, 4), (Rgb{0, 255, 0}));
  EXPECT_EQ(decoded.Pixel(3, 2), (Rgb{1, 2, 3}));
  EXPECT_EQ(decoded.Pixel(5, 1), (Rgb{10, 20, 30}));
}

TEST(Png, EmptyImageIsRejected) {
  EXPECT_THAT(EncodePng(RgbImage(0, 3, Rgb{})),
              StatusIs(absl::StatusCode::kInvalidArgument, "empty"));
}

TEST(Colormap, EndsAreDarkVioletAndYellowAndLightnessRisesMonotonically) {
  auto lightness = [](Rgb c) {
    auto linear = [](uint8_t v) {
      const double s = v / 255.0;
      return s <= 0.04045 ? s / 12.92 : std::pow((s + 0.055) / 1.055, 2.4);
    };
    const double y = 0.2126 * linear(c.r) + 0.7152 * linear(c.g) + 0.0722 * linear(c.b);
    return y > 0.008856 ? 116 * std::cbrt(y) - 16 : 903.3 * y;
  };
  const Rgb low = ColormapColor(0), high = ColormapColor(1);
  EXPECT_GT(low.b, low.g);    // violet-blue at the bottom
  EXPECT_GT(high.r, high.b);  // yellow at the top
  EXPECT_GT(high.g, high.b);
  double previous = -1;
  for (int i = 0; i <= 256; ++i) {
    const double l = lightness(ColormapColor(i / 256.0));
    EXPECT_GE(l, previous - 0.2) << "at " << i << "/256";  // rounding to bytes wobbles a little
    previous = l;
  }
  EXPECT_LT(lightness(low), 20);
  EXPECT_GT(lightness(high), 85);
  EXPECT_EQ(ColormapColor(-3), low);
  EXPECT_EQ(ColormapColor(7), high);
  EXPECT_EQ(ColormapColor(std::nan("")), low);
}

TEST(BitmapFont, DrawsGlyphsInTheirCellsAndMeasuresText) {
  EXPECT_EQ(TextWidth("", 2), 0);
  EXPECT_EQ(TextWidth("A", 1), 5);
  EXPECT_EQ(TextWidth("HEAD 3", 2), (6 * 6 - 1) * 2);
  RgbImage image(20, 10, Rgb{255, 255, 255});
  DrawText(image, 1, 1, "1-", Rgb{0, 0, 0}, 1);
  // '1' has ink in the middle of its top row; '-' only in its middle row.
  EXPECT_EQ(image.Get(1 + 2, 1), (Rgb{0, 0, 0}));
  EXPECT_EQ(image.Get(1 + 0, 1), (Rgb{255, 255, 255}));
  EXPECT_EQ(image.Get(7 + 2, 1 + 3), (Rgb{0, 0, 0}));
  EXPECT_EQ(image.Get(7 + 2, 1), (Rgb{255, 255, 255}));
}

// Two 4 x 6 heads; the largest weight (0.9) sits in head 1, row 2, column 5.
HeatmapSpec TwoHeads() {
  HeatmapSpec spec;
  spec.title = "ATTENTION MAPS";
  spec.rows = 4;
  spec.cols = 6;
  for (int h = 0; h < 2; ++h) {
    HeatmapTile tile;
    tile.label = absl::StrCat("HEAD ", h);
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 6; ++j) tile.values.push_back(0.01f * (i + j + h));
    }
    spec.tiles.push_back(tile);
  }
  spec.tiles[1].values[2 * 6 + 5] = 0.9f;
  return spec;
}

TEST(Heatmap, WrittenPngShowsTheMaxCellInTheScalesTopColour) {
  const HeatmapSpec spec = TwoHeads();
  absl::StatusOr<RenderedHeatmap> rendered = RenderHeatmap(spec);
  ASSERT_THAT(rendered, IsOk());
  const HeatmapLayout& layout = rendered->layout;
  const std::string path = TempPath("heatmap.png");
  ASSERT_THAT(WritePngFile(path, rendered->image), IsOk());
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  ASSERT_THAT(bytes, IsOk());
  DecodedPng png;
  ASSERT_TRUE(DecodePng(*bytes, &png));
  EXPECT_EQ(png.width, rendered->image.width());
  EXPECT_EQ(png.height, rendered->image.height());

  // Cells are scaled up: a 6-column map gets 256 / 6 = 42 -> 32-pixel cells.
  EXPECT_EQ(layout.cell_width, 32);
  EXPECT_EQ(layout.cell_height, 32);
  EXPECT_EQ(layout.pool, 1);
  ASSERT_EQ(layout.tiles.size(), 2u);
  EXPECT_EQ(layout.tiles[0].width, 6 * 32);
  EXPECT_EQ(layout.tiles[0].height, 4 * 32);
  EXPECT_FLOAT_EQ(layout.scale_max, 0.9f);

  const PixelRect& tile = layout.tiles[1];
  const Rgb max_cell = png.Pixel(tile.x + 5 * 32 + 16, tile.y + 2 * 32 + 16);
  const Rgb scale_top =
      png.Pixel(layout.scale_bar.x + layout.scale_bar.width / 2, layout.scale_bar.y);
  const Rgb scale_bottom = png.Pixel(layout.scale_bar.x + layout.scale_bar.width / 2,
                                     layout.scale_bar.y + layout.scale_bar.height - 1);
  EXPECT_EQ(max_cell, scale_top);
  EXPECT_EQ(scale_top, ColormapColor(1));
  EXPECT_EQ(scale_bottom, ColormapColor(0));
  // Every pixel of a cell has the cell's colour: head 0's (0, 0) is 0.
  const PixelRect& first = layout.tiles[0];
  for (int dy = 0; dy < 32; ++dy) {
    for (int dx = 0; dx < 32; ++dx) {
      ASSERT_EQ(png.Pixel(first.x + dx, first.y + dy), ColormapColor(0));
    }
  }
  // A middle cell, (1, 3) = 0.04: 0.04 / 0.9 of the way up the scale.
  EXPECT_EQ(png.Pixel(first.x + 3 * 32 + 5, first.y + 1 * 32 + 5),
            ColormapColor(static_cast<double>(spec.tiles[0].values[1 * 6 + 3]) / layout.scale_max));
  EXPECT_NE(png.Pixel(first.x + 3 * 32 + 5, first.y + 1 * 32 + 5), ColormapColor(0));
  // The tiles sit side by side (two tiles: one row is closest to 3:2).
  EXPECT_EQ(layout.tiles[0].y, layout.tiles[1].y);
  EXPECT_GT(layout.tiles[1].x, layout.tiles[0].x + layout.tiles[0].width);
  EXPECT_GT(layout.scale_bar.x, layout.tiles[1].x + layout.tiles[1].width);
  EXPECT_LE(layout.scale_bar.x + layout.scale_bar.width, png.width);
}

TEST(Heatmap, AFewDominantCellsAreClippedSoTheRestStaysVisible) {
  // 20 x 20 weights between 0.01 and 0.05, and one 1 (like a causal map's
  // first row): a linear scale to 1 would draw everything else nearly black.
  HeatmapSpec spec;
  spec.rows = spec.cols = 20;
  HeatmapTile tile;
  tile.label = "HEAD 0";
  for (int k = 0; k < 400; ++k) tile.values.push_back(0.01f + 0.0001f * k);
  tile.values[0] = 1.0f;
  spec.tiles.push_back(tile);
  absl::StatusOr<RenderedHeatmap> rendered = RenderHeatmap(spec);
  ASSERT_THAT(rendered, IsOk());
  const HeatmapLayout& layout = rendered->layout;
  EXPECT_TRUE(layout.clipped);
  EXPECT_EQ(layout.max_value, 1.0f);
  // The 99th percentile: sorted, index 400 * 99 / 100 = 396 holds value 397.
  EXPECT_FLOAT_EQ(layout.scale_max, spec.tiles[0].values[397]);
  const PixelRect& t = layout.tiles[0];
  const int cell = layout.cell_width;
  // The outlier takes the top colour, like the scale bar's top row.
  EXPECT_EQ(rendered->image.Get(t.x + cell / 2, t.y + cell / 2), ColormapColor(1));
  EXPECT_EQ(rendered->image.Get(layout.scale_bar.x, layout.scale_bar.y), ColormapColor(1));
  // Cell (10, 0) = 0.03 sits about halfway up the scale.
  EXPECT_EQ(rendered->image.Get(t.x + cell / 2, t.y + 10 * cell + cell / 2),
            ColormapColor(static_cast<double>(spec.tiles[0].values[200]) / layout.scale_max));

  // Evenly spread weights are not clipped.
  EXPECT_FALSE(RenderHeatmap(TwoHeads())->layout.clipped);
}

TEST(Heatmap, LargeMapsAreMaxPooledSoPeaksSurvive) {
  HeatmapSpec spec;
  spec.rows = spec.cols = 600;
  HeatmapTile tile;
  tile.label = "HEAD 0";
  tile.values.assign(600 * 600, 0.0f);
  tile.values[599 * 600 + 1] = 0.5f;  // one lone peak
  spec.tiles.push_back(tile);
  absl::StatusOr<RenderedHeatmap> rendered = RenderHeatmap(spec);
  ASSERT_THAT(rendered, IsOk());
  const HeatmapLayout& layout = rendered->layout;
  EXPECT_EQ(layout.pool, 3);
  EXPECT_LE(layout.tiles[0].width, 256);
  EXPECT_EQ(layout.tiles[0].width, 200 * layout.cell_width);
  // The pooled cell (599 / 3, 1 / 3) = (199, 0) holds the peak.
  EXPECT_EQ(rendered->image.Get(layout.tiles[0].x, layout.tiles[0].y + 199 * layout.cell_height),
            ColormapColor(1));
}

TEST(Heatmap, FewRowsStillMakeAVisibleBand) {
  HeatmapSpec spec;
  spec.rows = 1;
  spec.cols = 128;
  spec.tiles.push_back(HeatmapTile{"HEAD 0", std::vector<float>(128, 1.0f / 128)});
  absl::StatusOr<RenderedHeatmap> rendered = RenderHeatmap(spec);
  ASSERT_THAT(rendered, IsOk());
  EXPECT_EQ(rendered->layout.cell_width, 2);
  EXPECT_EQ(rendered->layout.cell_height, 32);
}

TEST(Heatmap, RejectsTilesOfTheWrongSize) {
  HeatmapSpec spec = TwoHeads();
  spec.tiles[1].values.pop_back();
  EXPECT_THAT(RenderHeatmap(spec), StatusIs(absl::StatusCode::kInvalidArgument, "HEAD 1"));
  EXPECT_THAT(RenderHeatmap(HeatmapSpec{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "no tiles"));
}

TEST(HeatmapFromMaps, TakesOneSequenceCropsPaddingAndLabelsHeads) {
  // [batch 2, heads 2, seq_q 3, seq_kv 4]: value = b * 1000 + h * 100 + i * 10 + j.
  std::vector<float> maps;
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 4; ++j) maps.push_back(b * 1000 + h * 100 + i * 10 + j);
  MapsPictureOptions options;
  options.sequence = 1;
  options.heads = {5, 2};
  options.query_length = 2;
  options.key_length = 3;
  absl::StatusOr<HeatmapSpec> spec = HeatmapFromMaps(maps, {2, 2, 3, 4}, options);
  ASSERT_THAT(spec, IsOk());
  EXPECT_EQ(spec->rows, 2);
  EXPECT_EQ(spec->cols, 3);
  ASSERT_EQ(spec->tiles.size(), 2u);
  EXPECT_EQ(spec->tiles[0].label, "HEAD 5");
  EXPECT_EQ(spec->tiles[1].label, "HEAD 2");
  EXPECT_THAT(spec->tiles[1].values, ::testing::ElementsAre(1100, 1101, 1102, 1110, 1111, 1112));
  EXPECT_THAT(spec->title, ::testing::HasSubstr("SEQUENCE 1 OF 2"));

  // Mean maps: one tile; query rows label the rows and are not cropped.
  MapsPictureOptions mean;
  mean.query_rows = {7, 1};
  mean.query_length = 1;
  absl::StatusOr<HeatmapSpec> mean_spec =
      HeatmapFromMaps(absl::MakeSpan(maps).subspan(0, 16), {2, 2, 4}, mean);
  ASSERT_THAT(mean_spec, IsOk());
  ASSERT_EQ(mean_spec->tiles.size(), 1u);
  EXPECT_EQ(mean_spec->rows, 2);
  EXPECT_THAT(mean_spec->row_labels, ::testing::ElementsAre(7, 1));

  MapsPictureOptions past_the_batch;
  past_the_batch.sequence = 2;
  EXPECT_THAT(HeatmapFromMaps(maps, {2, 2, 3, 4}, past_the_batch),
              StatusIs(absl::StatusCode::kInvalidArgument, "--png_sequence: 2 is outside [0, 2)"));
  EXPECT_THAT(HeatmapFromMaps(maps, {2, 2, 5}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "48 values for 20 entries"));
  EXPECT_THAT(HeatmapFromMaps(maps, {48}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "rank 1"));
}

}  // namespace
}  // namespace attnserve::client
