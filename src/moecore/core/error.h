// Errors carry the file and line where they were raised, and a message that says what was
// wrong and what was expected. Every failure in moecore is an Error (or a subclass); the
// binary catches it at the top, prints the message and exits non-zero.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moecore {

class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line)
      : std::runtime_error(std::move(message)), file_(file), line_(line) {}
  const char* file() const { return file_; }
  int line() const { return line_; }
  // "message (at src/moecore/core/tensor.cpp:42)"
  std::string with_location() const;

 private:
  const char* file_;
  int line_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void raise(const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace moecore

// MC_CHECK(cond, parts...): raise an Error built from the streamed parts when cond is false.
#define MC_CHECK(cond, ...)                                                          \
  do {                                                                               \
    if (!(cond)) ::moecore::detail::raise(__FILE__, __LINE__,                       \
                                          ::moecore::detail::concat(__VA_ARGS__));   \
  } while (0)

#define MC_FAIL(...) ::moecore::detail::raise(__FILE__, __LINE__, ::moecore::detail::concat(__VA_ARGS__))
