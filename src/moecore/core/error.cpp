#include "moecore/core/error.h"

namespace moecore {

std::string Error::with_location() const {
  return std::string(what()) + " (at " + file_ + ":" + std::to_string(line_) + ")";
}

namespace detail {
void raise(const char* file, int line, const std::string& message) { throw Error(message, file, line); }
}  // namespace detail

}  // namespace moecore
