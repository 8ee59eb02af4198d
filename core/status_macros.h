#ifndef ATTNSERVE_CORE_STATUS_MACROS_H_
#define ATTNSERVE_CORE_STATUS_MACROS_H_

// Abseil 20220623 has no status macros; these are ours.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTNSERVE_CONCAT_INNER_(a, b) a##b
#define ATTNSERVE_CONCAT_(a, b) ATTNSERVE_CONCAT_INNER_(a, b)

// Returns `expr` from the enclosing function when it is not OK.
#define ATTNSERVE_RETURN_IF_ERROR(expr)           \
  do {                                            \
    ::absl::Status attnserve_status_ = (expr);    \
    if (!attnserve_status_.ok()) return attnserve_status_; \
  } while (false)

// `lhs = value of expr`, or returns its status when `expr` is not OK.
#define ATTNSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  ATTNSERVE_ASSIGN_OR_RETURN_IMPL_(ATTNSERVE_CONCAT_(attnserve_or_, __LINE__), lhs, expr)

#define ATTNSERVE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return std::move(tmp).status();         \
  lhs = std::move(tmp).value()

#endif  // ATTNSERVE_CORE_STATUS_MACROS_H_
