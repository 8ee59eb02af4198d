#include "server/common/message_text.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve::server {

std::string Abbreviate(absl::string_view text, size_t max_chars) {
  if (text.size() <= max_chars) return std::string(text);
  // Cut before a UTF-8 continuation byte's character, not inside it.
  size_t end = max_chars;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return absl::StrCat(text.substr(0, end), "...");
}

std::string ShapeText(absl::Span<const int64_t> shape) {
  constexpr size_t kShown = 6;
  if (shape.size() <= kShown) return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(shape.subspan(0, kShown), ", "), ", ... (", shape.size(),
                      " dims)]");
}

}  // namespace attnserve::server
