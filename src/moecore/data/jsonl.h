// JSON Lines input for `moecore preprocess`.
//
// JsonlLineReader yields the lines of a file (read in 4 MiB chunks) or of a buffer:
//   - lines end at '\n'; a trailing '\r' is dropped (CRLF files); the last line may lack '\n';
//   - a UTF-8 byte-order mark at the start of the first line is dropped;
//   - blank lines (only spaces, tabs, '\r') are skipped but still counted, so line numbers
//     are the 1-based physical line numbers an editor shows;
//   - a line longer than max_line_bytes (default 1 GiB) is an Error naming its number.
// parse_jsonl_fields parses one line as a JSON object and extracts string fields by key;
// problems are returned as a message (no exception) so that --skip-bad-lines can count them:
// "not valid JSON: ...", "not a JSON object", "missing key 'text'",
// "key 'text' is a number, expected a string".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

class JsonlLineReader {
 public:
  explicit JsonlLineReader(const std::string& path);             // Error if it cannot be opened
  static JsonlLineReader from_buffer(std::string_view data);      // tests, fuzzing
  ~JsonlLineReader();
  JsonlLineReader(JsonlLineReader&& other) noexcept;
  JsonlLineReader(const JsonlLineReader&) = delete;
  JsonlLineReader& operator=(const JsonlLineReader&) = delete;
  JsonlLineReader& operator=(JsonlLineReader&&) = delete;

  // The next non-blank line (without its terminator) and its 1-based line number; false at the end.
  bool next(std::string& line, int64_t& line_number);
  // Bytes consumed so far (terminators included).
  int64_t bytes_read() const { return consumed_; }
  // Size of the input in bytes (-1 if unknown).
  int64_t total_bytes() const { return total_; }
  void set_max_line_bytes(size_t n) { max_line_ = n; }

 private:
  JsonlLineReader() = default;
  bool fill();  // reads more into buf_; false at end of input

  std::string path_;
  std::FILE* file_ = nullptr;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
  int64_t line_no_ = 0, consumed_ = 0, total_ = -1;
  size_t max_line_ = size_t(1) << 30;
};

// Parses `line` as a JSON object and stores the string value of each key into values (same
// order as keys). Returns "" on success, else what was wrong.
std::string parse_jsonl_fields(std::string_view line, const std::vector<std::string>& keys,
                               std::vector<std::string>& values);

}  // namespace moecore
