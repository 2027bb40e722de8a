// RETURN_IF_ERROR / ASSIGN_OR_RETURN: Debian's Abseil (20220623) ships no
// status_macros.h, so tandem defines these once, here.
#ifndef TANDEM_NN_STATUS_MACROS_H_
#define TANDEM_NN_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TANDEM_STATUS_CONCAT_INNER_(a, b) a##b
#define TANDEM_STATUS_CONCAT_(a, b) TANDEM_STATUS_CONCAT_INNER_(a, b)

// Evaluates expr (an absl::Status); returns it from the caller when not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status _tandem_status = (expr);          \
    if (!_tandem_status.ok()) return _tandem_status; \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): expr is an absl::StatusOr<T>; on error returns
// its status, otherwise assigns (moves) its value to lhs (which may declare it).
#define ASSIGN_OR_RETURN(lhs, expr) \
  TANDEM_ASSIGN_OR_RETURN_IMPL_(TANDEM_STATUS_CONCAT_(_tandem_statusor_, __LINE__), lhs, expr)
#define TANDEM_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return statusor.status();            \
  lhs = std::move(statusor).value()

#endif  // TANDEM_NN_STATUS_MACROS_H_
