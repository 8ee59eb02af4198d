#include "client/heatmap.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/bitmap_font.h"

namespace attnserve::client {
namespace {

// Anchors of the colour map at t = 0, 1/8, ..., 1, picked so that CIE L*
// climbs in near-equal steps (15, 24, 33, 43, 52, 61, 70, 80, 90) while the
// hue turns violet -> blue -> teal -> green -> yellow.
constexpr Rgb kColormapAnchors[] = {
    {62, 12, 86},   {70, 40, 120},  {62, 72, 138},  {48, 106, 142}, {34, 136, 141},
    {36, 166, 130}, {82, 192, 104}, {160, 216, 66}, {250, 230, 40},
};
constexpr int kNumAnchors = sizeof(kColormapAnchors) / sizeof(kColormapAnchors[0]);

constexpr Rgb kBackground{255, 255, 255};
constexpr Rgb kInk{33, 33, 33};
constexpr Rgb kFaintInk{110, 110, 110};
constexpr Rgb kFrame{150, 150, 150};

// Text sizes: titles and tile labels at 2x, tick labels at 1x.
constexpr int kLabelScale = 2;
constexpr int kTickScale = 1;
constexpr int kSubtitleScale = 2;
constexpr int kMargin = 16;
constexpr int kTileGap = 20;      // between tiles of the grid
constexpr int kMinTileSide = 64;  // the short side of a tile, where cells allow it
constexpr int kMaxCellPixels = 32;
constexpr int kScaleBarWidth = 18;
constexpr int kMinScaleBarHeight = 160;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string ValueText(float value) { return absl::StrFormat("%.3g", value); }

}  // namespace

Rgb ColormapColor(double t) {
  if (!(t > 0)) return kColormapAnchors[0];  // also NaN
  if (t >= 1) return kColormapAnchors[kNumAnchors - 1];
  const double x = t * (kNumAnchors - 1);
  const int i = static_cast<int>(x);
  const double f = x - i;
  const Rgb& a = kColormapAnchors[i];
  const Rgb& b = kColormapAnchors[i + 1];
  auto mix = [f](uint8_t u, uint8_t v) {
    return static_cast<uint8_t>(std::lround(u + (static_cast<double>(v) - u) * f));
  };
  return Rgb{mix(a.r, b.r), mix(a.g, b.g), mix(a.b, b.b)};
}

absl::StatusOr<RenderedHeatmap> RenderHeatmap(const HeatmapSpec& spec) {
  if (spec.tiles.empty()) return absl::InvalidArgumentError("heatmap: no tiles to draw");
  if (spec.rows < 1 || spec.cols < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("heatmap: a tile of ", spec.rows, " x ", spec.cols, " has nothing to draw"));
  }
  for (const HeatmapTile& tile : spec.tiles) {
    if (static_cast<int64_t>(tile.values.size()) != spec.rows * spec.cols) {
      return absl::InvalidArgumentError(absl::StrCat("heatmap: tile '", tile.label, "' has ",
                                                     tile.values.size(), " values, not ", spec.rows,
                                                     " x ", spec.cols));
    }
  }
  if (!spec.row_labels.empty() && static_cast<int64_t>(spec.row_labels.size()) != spec.rows) {
    return absl::InvalidArgumentError("heatmap: row_labels must label every row");
  }
  const int max_tile = std::max(spec.max_tile_pixels, 16);

  // Cells: max-pool maps bigger than a tile, then scale cells up to fill it.
  HeatmapLayout layout;
  layout.pool = static_cast<int>(CeilDiv(std::max(spec.rows, spec.cols), max_tile));
  const int pooled_rows = static_cast<int>(CeilDiv(spec.rows, layout.pool));
  const int pooled_cols = static_cast<int>(CeilDiv(spec.cols, layout.pool));
  const int cell = std::clamp(max_tile / std::max(pooled_rows, pooled_cols), 1, kMaxCellPixels);
  // A map of a few rows (--rows, cross-attention) gets taller cells, so that
  // it is a band, not a line; likewise a map of a few columns.
  layout.cell_height = std::max(
      cell, std::min(kMaxCellPixels, static_cast<int>(CeilDiv(kMinTileSide, pooled_rows))));
  layout.cell_width = std::max(
      cell, std::min(kMaxCellPixels, static_cast<int>(CeilDiv(kMinTileSide, pooled_cols))));
  std::string subtitle = spec.subtitle;
  if (layout.pool > 1) {
    absl::StrAppend(&subtitle, subtitle.empty() ? "" : "\n", "EACH CELL THE MAX OF ", layout.pool,
                    " X ", layout.pool, " ENTRIES");
  }
  const int tile_w = pooled_cols * layout.cell_width;
  const int tile_h = pooled_rows * layout.cell_height;

  std::vector<std::vector<float>> pooled(spec.tiles.size(),
                                         std::vector<float>(pooled_rows * pooled_cols, 0.0f));
  float max_value = 0;
  for (size_t t = 0; t < spec.tiles.size(); ++t) {
    for (int64_t i = 0; i < spec.rows; ++i) {
      for (int64_t j = 0; j < spec.cols; ++j) {
        const float v = spec.tiles[t].values[i * spec.cols + j];
        if (!(v > 0)) continue;  // weights are >= 0; NaN draws as 0
        float& p = pooled[t][(i / layout.pool) * pooled_cols + j / layout.pool];
        p = std::max(p, v);
        max_value = std::max(max_value, v);
      }
    }
  }
  layout.max_value = max_value;
  layout.scale_max = max_value > 0 && std::isfinite(max_value) ? max_value : 1.0f;
  // A few dominant weights (a causal map's first row is all 1) would leave
  // everything else in the darkest colour. When the 99th percentile of the
  // positive cells is under a quarter of the maximum, the scale tops out there
  // and the few cells above it are clipped to the top colour.
  {
    std::vector<float> positive;
    for (const std::vector<float>& cells : pooled) {
      for (float v : cells) {
        if (v > 0) positive.push_back(v);
      }
    }
    if (positive.size() >= 100) {
      const size_t k = positive.size() * 99 / 100;
      std::nth_element(positive.begin(), positive.begin() + k, positive.end());
      const float p99 = positive[k];
      if (p99 > 0 && p99 < layout.scale_max / 4) {
        layout.scale_max = p99;
        layout.clipped = true;
        absl::StrAppend(&subtitle, subtitle.empty() ? "" : "\n", "COLOURS CLIPPED AT THE 99TH ",
                        "PERCENTILE OF THE NONZERO WEIGHTS (THE LARGEST IS ", ValueText(max_value),
                        ")");
      }
    }
  }

  // Row labels: every row when the cells are tall enough for the text, else
  // the first and the last; likewise the columns.
  auto row_label = [&](int64_t i) {
    return absl::StrCat(spec.row_labels.empty() ? i : spec.row_labels[i]);
  };
  std::vector<std::pair<int, std::string>> row_ticks, col_ticks;  // (pixel offset, text)
  const bool every_row = layout.pool == 1 && layout.cell_height >= TextHeight(kTickScale) + 2;
  for (int r = 0; r < pooled_rows; ++r) {
    if (every_row || r == 0 || r == pooled_rows - 1) {
      const int64_t i = std::min<int64_t>(int64_t{r} * layout.pool, spec.rows - 1);
      const int64_t shown = r == pooled_rows - 1 && !every_row ? spec.rows - 1 : i;
      row_ticks.emplace_back(r * layout.cell_height + layout.cell_height / 2, row_label(shown));
    }
  }
  const bool every_col =
      layout.pool == 1 &&
      layout.cell_width >= TextWidth(absl::StrCat(spec.cols - 1), kTickScale) + 4;
  for (int c = 0; c < pooled_cols; ++c) {
    if (every_col || c == 0 || c == pooled_cols - 1) {
      const int64_t j =
          c == pooled_cols - 1 && !every_col ? spec.cols - 1 : int64_t{c} * layout.pool;
      col_ticks.emplace_back(c * layout.cell_width + layout.cell_width / 2, absl::StrCat(j));
    }
  }
  int row_tick_w = 0;
  for (const auto& [offset, text] : row_ticks) {
    row_tick_w = std::max(row_tick_w, TextWidth(text, kTickScale));
  }
  row_tick_w += 4;

  // One grid block: label, gap, tile (with row ticks on its left), col ticks.
  const int label_h = TextHeight(kLabelScale);
  int max_label_w = 0;
  for (const HeatmapTile& tile : spec.tiles) {
    max_label_w = std::max(max_label_w, TextWidth(tile.label, kLabelScale));
  }
  const int block_w = row_tick_w + std::max(tile_w, max_label_w) + kTileGap;
  const int block_h = label_h + 6 + tile_h + 4 + TextHeight(kTickScale) + kTileGap;

  // Grid columns: the count that makes the grid closest to 3:2.
  const int n = static_cast<int>(spec.tiles.size());
  int grid_cols = 1;
  double best = 1e30;
  for (int c = 1; c <= n; ++c) {
    const int r = (n + c - 1) / c;
    const double aspect = static_cast<double>(c * block_w) / (r * block_h);
    // Empty grid slots look unfinished: each costs a little.
    const double score = std::abs(std::log(aspect / 1.5)) + 0.25 * (r * c - n);
    if (score < best - 1e-9) {
      best = score;
      grid_cols = c;
    }
  }
  const int grid_rows = (n + grid_cols - 1) / grid_cols;

  // Canvas: title, subtitle, grid, then the scale bar on the right.
  const int title_h = spec.title.empty() ? 0 : label_h + 8;
  const std::vector<std::string> subtitle_lines =
      subtitle.empty() ? std::vector<std::string>() : absl::StrSplit(subtitle, '\n');
  const int line_h = TextHeight(kSubtitleScale) + 5;
  const int subtitle_h = static_cast<int>(subtitle_lines.size()) * line_h + 5;
  int subtitle_w = 0;
  for (const std::string& line : subtitle_lines) {
    subtitle_w = std::max(subtitle_w, TextWidth(line, kSubtitleScale));
  }
  const int grid_x = kMargin, grid_y = kMargin + title_h + subtitle_h + 4;
  const int grid_w = grid_cols * block_w, grid_h = grid_rows * block_h;
  const std::string max_text = absl::StrCat(ValueText(layout.scale_max), layout.clipped ? "+" : "");
  const std::string caption = "WEIGHT";
  const int bar_label_w = std::max({TextWidth(max_text, kLabelScale), TextWidth("0", kLabelScale)});
  layout.scale_bar.x = grid_x + grid_w + 16;
  layout.scale_bar.y = grid_y + label_h + 6;
  layout.scale_bar.width = kScaleBarWidth;
  layout.scale_bar.height = std::max(tile_h, kMinScaleBarHeight);
  const int width =
      std::max({layout.scale_bar.x + kScaleBarWidth + 8 + bar_label_w + kMargin,
                layout.scale_bar.x + TextWidth(caption, kLabelScale) + kMargin,
                2 * kMargin + TextWidth(spec.title, kLabelScale), 2 * kMargin + subtitle_w});
  const int height =
      std::max(grid_y + grid_h, layout.scale_bar.y + layout.scale_bar.height + label_h + kMargin) +
      kMargin / 2;

  RgbImage image(width, height, kBackground);
  if (!spec.title.empty()) DrawText(image, kMargin, kMargin, spec.title, kInk, kLabelScale);
  for (size_t i = 0; i < subtitle_lines.size(); ++i) {
    DrawText(image, kMargin, kMargin + title_h + static_cast<int>(i) * line_h, subtitle_lines[i],
             kFaintInk, kSubtitleScale);
  }

  for (int t = 0; t < n; ++t) {
    const int bx = grid_x + (t % grid_cols) * block_w;
    const int by = grid_y + (t / grid_cols) * block_h;
    DrawText(image, bx + row_tick_w, by, spec.tiles[t].label, kInk, kLabelScale);
    PixelRect rect{bx + row_tick_w, by + label_h + 6, tile_w, tile_h};
    layout.tiles.push_back(rect);
    image.FillRect(rect.x - 1, rect.y - 1, rect.width + 2, rect.height + 2, kFrame);
    for (int r = 0; r < pooled_rows; ++r) {
      for (int c = 0; c < pooled_cols; ++c) {
        const float v = pooled[t][r * pooled_cols + c];
        image.FillRect(rect.x + c * layout.cell_width, rect.y + r * layout.cell_height,
                       layout.cell_width, layout.cell_height,
                       ColormapColor(static_cast<double>(v) / layout.scale_max));
      }
    }
    const int tick_h = TextHeight(kTickScale);
    for (const auto& [offset, text] : row_ticks) {
      DrawText(image, rect.x - 3 - TextWidth(text, kTickScale),
               std::clamp(rect.y + offset - tick_h / 2, rect.y, rect.y + rect.height - tick_h),
               text, kFaintInk, kTickScale);
    }
    for (const auto& [offset, text] : col_ticks) {
      const int w = TextWidth(text, kTickScale);
      DrawText(image, std::clamp(rect.x + offset - w / 2, rect.x, rect.x + rect.width - w),
               rect.y + rect.height + 4, text, kFaintInk, kTickScale);
    }
  }

  // The scale bar: the top row is the colour of scale_max, the bottom of 0.
  const PixelRect& bar = layout.scale_bar;
  DrawText(image, bar.x, grid_y, caption, kInk, kLabelScale);
  image.FillRect(bar.x - 1, bar.y - 1, bar.width + 2, bar.height + 2, kFrame);
  for (int y = 0; y < bar.height; ++y) {
    const double t = bar.height == 1 ? 1.0 : 1.0 - static_cast<double>(y) / (bar.height - 1);
    image.FillRect(bar.x, bar.y + y, bar.width, 1, ColormapColor(t));
  }
  const int label_x = bar.x + bar.width + 6;
  DrawText(image, label_x, bar.y, max_text, kInk, kLabelScale);
  DrawText(image, label_x, bar.y + bar.height - label_h, "0", kInk, kLabelScale);
  // A middle label when the bar has room for it.
  if (bar.height >= 4 * label_h) {
    DrawText(image, label_x, bar.y + (bar.height - label_h) / 2, ValueText(layout.scale_max / 2),
             kFaintInk, kLabelScale);
  }

  return RenderedHeatmap{std::move(image), std::move(layout)};
}

absl::StatusOr<HeatmapSpec> HeatmapFromMaps(absl::Span<const float> values,
                                            absl::Span<const int64_t> shape,
                                            const MapsPictureOptions& options) {
  if (shape.size() != 3 && shape.size() != 4) {
    return absl::InvalidArgumentError(absl::StrCat("maps: rank ", shape.size(),
                                                   "; expected [batch, heads, seq_q, seq_kv] or "
                                                   "[batch, seq_q, seq_kv]"));
  }
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 1) return absl::InvalidArgumentError("maps: a dimension is < 1");
    elements *= d;
  }
  if (static_cast<int64_t>(values.size()) != elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("maps: ", values.size(), " values for ", elements, " entries"));
  }
  const bool per_head = shape.size() == 4;
  const int64_t batch = shape[0];
  const int64_t heads = per_head ? shape[1] : 1;
  const int64_t seq_q = shape[shape.size() - 2];
  const int64_t seq_kv = shape[shape.size() - 1];
  if (options.sequence < 0 || options.sequence >= batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("--png_sequence: ", options.sequence, " is outside [0, ", batch, ")"));
  }
  if (!options.heads.empty() && static_cast<int64_t>(options.heads.size()) != heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("maps: ", heads, " heads, but ", options.heads.size(), " head numbers"));
  }
  if (!options.query_rows.empty() && static_cast<int64_t>(options.query_rows.size()) != seq_q) {
    return absl::InvalidArgumentError(
        absl::StrCat("maps: ", seq_q, " rows, but ", options.query_rows.size(), " query rows"));
  }

  HeatmapSpec spec;
  spec.rows = seq_q;
  if (options.query_rows.empty() && options.query_length > 0) {
    spec.rows = std::min(seq_q, options.query_length);
  }
  spec.cols = options.key_length > 0 ? std::min(seq_kv, options.key_length) : seq_kv;
  spec.row_labels.assign(options.query_rows.begin(), options.query_rows.end());
  for (int64_t h = 0; h < heads; ++h) {
    HeatmapTile tile;
    tile.label = per_head ? absl::StrCat("HEAD ", options.heads.empty() ? h : options.heads[h])
                          : "MEAN OVER HEADS";
    tile.values.reserve(spec.rows * spec.cols);
    const float* map = values.data() + (options.sequence * heads + h) * seq_q * seq_kv;
    for (int64_t i = 0; i < spec.rows; ++i) {
      tile.values.insert(tile.values.end(), map + i * seq_kv, map + i * seq_kv + spec.cols);
    }
    spec.tiles.push_back(std::move(tile));
  }
  spec.title = batch > 1
                   ? absl::StrCat("ATTENTION MAPS, SEQUENCE ", options.sequence, " OF ", batch)
                   : "ATTENTION MAPS";
  spec.subtitle = absl::StrCat("ROWS: QUERY POSITIONS, COLUMNS: KEY POSITIONS (", spec.rows, " X ",
                               spec.cols, ")");
  return spec;
}

}  // namespace attnserve::client
