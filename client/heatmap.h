#ifndef ATTNSERVE_CLIENT_HEATMAP_H_
#define ATTNSERVE_CLIENT_HEATMAP_H_

// Heatmap pictures of attention maps: one tile per head (or one for the mean
// map) in a grid, queries down and keys across, coloured on a perceptual
// colour map, with a colour scale bar and labels.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/png.h"

namespace attnserve::client {

// The colour of t in [0, 1] (clamped) on attnctl's colour map: dark violet
// through blue, teal and green to yellow, with CIE lightness rising evenly
// (about 15 to 90), so brighter always means more weight, also in greyscale.
Rgb ColormapColor(double t);

// One tile: a [rows, cols] block of weights, row-major.
struct HeatmapTile {
  std::string label;  // e.g. "head 3"
  std::vector<float> values;
};

// What to draw. Every tile has the same rows x cols.
struct HeatmapSpec {
  std::string title;
  std::string subtitle;  // lines separated by '\n'
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<HeatmapTile> tiles;
  // The query position of each row, for the row labels (e.g. the rows asked
  // for with --rows); empty: 0 .. rows - 1.
  std::vector<int64_t> row_labels;
  // The longer side of a tile is at most this many pixels; maps larger than
  // that are max-pooled so that no peak disappears.
  int max_tile_pixels = 256;
};

struct PixelRect {
  int x = 0, y = 0, width = 0, height = 0;
};

// Where RenderHeatmap put things (for tests and callers that annotate).
struct HeatmapLayout {
  std::vector<PixelRect> tiles;  // the cells' area of each tile
  int cell_width = 0;            // pixels per (pooled) cell
  int cell_height = 0;
  int pool = 1;         // each cell shows the max of pool x pool map entries
  PixelRect scale_bar;  // top row: the colour of `scale_max`; bottom: of 0
  float scale_max = 0;  // the top of the colour scale (1 when all values are <= 0)
  float max_value = 0;  // the largest value drawn
  // True when a few outliers were clipped: scale_max is then the 99th
  // percentile of the positive cells, not max_value (the label says "+").
  bool clipped = false;
};

struct RenderedHeatmap {
  RgbImage image;
  HeatmapLayout layout;
};

// Draws `spec`: values from 0 to the largest value over all tiles map onto
// the colour map (one shared scale, so tiles compare); when a few cells
// dwarf the rest (under 1% of them above 4x the 99th percentile), the scale
// ends at the 99th percentile and the outliers take the top colour. INVALID_ARGUMENT when
// there are no tiles, rows or cols are < 1, or a tile's size is not
// rows x cols.
absl::StatusOr<RenderedHeatmap> RenderHeatmap(const HeatmapSpec& spec);

// Which part of an AttendResponse's maps to draw.
struct MapsPictureOptions {
  int64_t sequence = 0;  // the batch entry
  // The heads the maps hold, in order (AttentionMapRequest.heads); empty: all.
  std::vector<int32_t> heads;
  // The query positions the rows are (AttentionMapRequest.query_rows); empty:
  // all, 0 .. seq_q - 1.
  std::vector<int32_t> query_rows;
  // The sequence's query and key lengths, to crop the padding away; 0: the
  // map's full size. Ignored for rows when query_rows is given.
  int64_t query_length = 0;
  int64_t key_length = 0;
};

// The heatmap of one sequence of `maps`, whose shape is [batch, heads, seq_q,
// seq_kv] (per-head) or [batch, seq_q, seq_kv] (mean over heads).
// INVALID_ARGUMENT for another rank, values.size() != product(shape), a
// sequence outside [0, batch), or heads/query_rows of the wrong count.
absl::StatusOr<HeatmapSpec> HeatmapFromMaps(absl::Span<const float> values,
                                            absl::Span<const int64_t> shape,
                                            const MapsPictureOptions& options);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_HEATMAP_H_
