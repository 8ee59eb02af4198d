#ifndef ATTNSERVE_CLIENT_PNG_H_
#define ATTNSERVE_CLIENT_PNG_H_

// An 8-bit RGB image and a PNG encoder for it (zlib does the deflate).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attnserve::client {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  friend bool operator==(const Rgb&, const Rgb&) = default;
};

// A width x height picture, row-major, 3 bytes per pixel, top row first.
class RgbImage {
 public:
  RgbImage(int width, int height, Rgb background);

  int width() const { return width_; }
  int height() const { return height_; }
  // Pixels outside the image are ignored by Set and FillRect.
  void Set(int x, int y, Rgb color);
  // The pixel at (x, y); requires 0 <= x < width, 0 <= y < height.
  Rgb Get(int x, int y) const;
  // The w x h rectangle whose top-left corner is (x, y), clipped.
  void FillRect(int x, int y, int w, int h, Rgb color);
  const std::vector<uint8_t>& pixels() const { return pixels_; }

 private:
  int width_;
  int height_;
  std::vector<uint8_t> pixels_;
};

// The bytes of a PNG file (8-bit truecolour, no interlace) of `image`.
// INVALID_ARGUMENT for an empty image; INTERNAL if zlib fails.
absl::StatusOr<std::string> EncodePng(const RgbImage& image);

// Writes EncodePng(image) to `path`; its errors, or an errno-derived code
// naming the path when the file cannot be written.
absl::Status WritePngFile(const std::string& path, const RgbImage& image);

}  // namespace attnserve::client

#endif  // ATTNSERVE_CLIENT_PNG_H_
