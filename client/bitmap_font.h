#ifndef ATTNSERVE_CLIENT_BITMAP_FONT_H_
#define ATTNSERVE_CLIENT_BITMAP_FONT_H_

// A tiny built-in 5x7 pixel font for labels in attnctl's pictures: A-Z (lower
// case is drawn as upper case), 0-9 and . , - + : / ( ) [ ] = _ | and space.
// Any other character is drawn as '?'.

#include "absl/strings/string_view.h"
#include "client/png.h"

namespace attnserve::client {

constexpr int kGlyphWidth = 5;
constexpr int kGlyphHeight = 7;
// Glyph width plus one pixel of space.
constexpr int kGlyphAdvance = 6;

// Width in pixels of `text` drawn at `scale` (each font pixel a scale x scale
// square), without the space after the last glyph.
int TextWidth(absl::string_view text, int scale);
inline int TextHeight(int scale) { return kGlyphHeight * scale; }

// Draws `text` with its top-left corner at (x, y); pixels outside the image
// are clipped.
void DrawText(RgbImage& image, int x, int y, absl::string_view text, Rgb color, int scale);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_BITMAP_FONT_H_
