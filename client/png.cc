#include "client/png.h"

#include <zlib.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cli/file_io.h"

namespace attnserve::client {

using ::attnserve::cli::WriteFileBytes;

namespace {

void AppendBigEndian32(std::string& out, uint32_t value) {
  out.push_back(static_cast<char>(value >> 24));
  out.push_back(static_cast<char>(value >> 16));
  out.push_back(static_cast<char>(value >> 8));
  out.push_back(static_cast<char>(value));
}

// A chunk: length, type, data, and the CRC-32 of type and data.
void AppendChunk(std::string& out, const char type[4], const std::string& data) {
  AppendBigEndian32(out, static_cast<uint32_t>(data.size()));
  const size_t type_at = out.size();
  out.append(type, 4);
  out += data;
  const uLong crc = crc32(crc32(0L, Z_NULL, 0),
                          reinterpret_cast<const Bytef*>(out.data() + type_at), 4 + data.size());
  AppendBigEndian32(out, static_cast<uint32_t>(crc));
}

}  // namespace

RgbImage::RgbImage(int width, int height, Rgb background)
    : width_(std::max(width, 0)), height_(std::max(height, 0)) {
  pixels_.resize(static_cast<size_t>(width_) * height_ * 3);
  FillRect(0, 0, width_, height_, background);
}

void RgbImage::Set(int x, int y, Rgb color) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  uint8_t* p = &pixels_[(static_cast<size_t>(y) * width_ + x) * 3];
  p[0] = color.r;
  p[1] = color.g;
  p[2] = color.b;
}

Rgb RgbImage::Get(int x, int y) const {
  const uint8_t* p = &pixels_[(static_cast<size_t>(y) * width_ + x) * 3];
  return Rgb{p[0], p[1], p[2]};
}

void RgbImage::FillRect(int x, int y, int w, int h, Rgb color) {
  const int x0 = std::max(x, 0), x1 = std::min(x + w, width_);
  const int y0 = std::max(y, 0), y1 = std::min(y + h, height_);
  for (int yy = y0; yy < y1; ++yy) {
    for (int xx = x0; xx < x1; ++xx) Set(xx, yy, color);
  }
}

absl::StatusOr<std::string> EncodePng(const RgbImage& image) {
  if (image.width() <= 0 || image.height() <= 0) {
    return absl::InvalidArgumentError("png: the image is empty");
  }
  std::string png("\x89PNG\r\n\x1a\n", 8);

  std::string ihdr;
  AppendBigEndian32(ihdr, static_cast<uint32_t>(image.width()));
  AppendBigEndian32(ihdr, static_cast<uint32_t>(image.height()));
  ihdr.push_back(8);  // bits per channel
  ihdr.push_back(2);  // colour type: truecolour (RGB)
  ihdr.push_back(0);  // compression: deflate
  ihdr.push_back(0);  // filter method 0
  ihdr.push_back(0);  // no interlace
  AppendChunk(png, "IHDR", ihdr);

  // Each scanline is a filter-type byte (0: none; flat heatmap cells deflate
  // well without filtering) followed by the row's RGB bytes.
  const size_t row_bytes = static_cast<size_t>(image.width()) * 3;
  std::string raw;
  raw.reserve((row_bytes + 1) * image.height());
  for (int y = 0; y < image.height(); ++y) {
    raw.push_back(0);
    raw.append(reinterpret_cast<const char*>(image.pixels().data()) + y * row_bytes, row_bytes);
  }
  uLongf compressed_size = compressBound(raw.size());
  std::string compressed(compressed_size, '\0');
  const int rc = compress2(reinterpret_cast<Bytef*>(compressed.data()), &compressed_size,
                           reinterpret_cast<const Bytef*>(raw.data()), raw.size(), 9);
  if (rc != Z_OK) return absl::InternalError(absl::StrCat("png: zlib compress2 failed (", rc, ")"));
  compressed.resize(compressed_size);
  AppendChunk(png, "IDAT", compressed);
  AppendChunk(png, "IEND", "");
  return png;
}

absl::Status WritePngFile(const std::string& path, const RgbImage& image) {
  absl::StatusOr<std::string> png = EncodePng(image);
  if (!png.ok()) return png.status();
  return WriteFileBytes(path, *png);
}

}  // namespace attnserve::client
