#include "moecore/data/jsonl.h"

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

namespace moecore {

namespace {
constexpr size_t kChunk = size_t(4) << 20;

bool is_blank(std::string_view s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\r') return false;
  return true;
}

const char* json_type_name(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float: return "a number";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::string: return "a string";
    default: return "not a string";
  }
}
}  // namespace

JsonlLineReader::JsonlLineReader(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "rb");
  MC_CHECK(file_ != nullptr, "cannot open '", path, "': ", std::strerror(errno));
  if (std::fseek(file_, 0, SEEK_END) == 0) {
    total_ = std::ftell(file_);
    std::fseek(file_, 0, SEEK_SET);
  }
}

JsonlLineReader JsonlLineReader::from_buffer(std::string_view data) {
  JsonlLineReader r;
  r.path_ = "<buffer>";
  r.buf_.assign(data.data(), data.size());
  r.eof_ = true;
  r.total_ = static_cast<int64_t>(data.size());
  return r;
}

JsonlLineReader::JsonlLineReader(JsonlLineReader&& o) noexcept
    : path_(std::move(o.path_)), file_(o.file_), buf_(std::move(o.buf_)), pos_(o.pos_), eof_(o.eof_),
      line_no_(o.line_no_), consumed_(o.consumed_), total_(o.total_), max_line_(o.max_line_) {
  o.file_ = nullptr;
}

JsonlLineReader::~JsonlLineReader() {
  if (file_) std::fclose(file_);
}

bool JsonlLineReader::fill() {
  if (eof_) return false;
  // Drop what was consumed, then append a chunk.
  buf_.erase(0, pos_);
  pos_ = 0;
  const size_t old = buf_.size();
  buf_.resize(old + kChunk);
  const size_t got = std::fread(buf_.data() + old, 1, kChunk, file_);
  buf_.resize(old + got);
  if (got < kChunk) {
    MC_CHECK(!std::ferror(file_), "error reading '", path_, "': ", std::strerror(errno));
    eof_ = true;
  }
  return got > 0;
}

bool JsonlLineReader::next(std::string& line, int64_t& line_number) {
  for (;;) {
    size_t search_from = pos_;
    size_t nl;
    while ((nl = buf_.find('\n', search_from)) == std::string::npos) {
      MC_CHECK(buf_.size() - pos_ <= max_line_, path_, ": line ", line_no_ + 1, " is longer than ", max_line_,
               " bytes");
      search_from = buf_.size() - pos_;  // fill() moves the pending bytes to the front
      if (!fill()) break;
    }
    if (pos_ >= buf_.size()) return false;  // nothing left
    const bool terminated = nl != std::string::npos;
    const size_t end = terminated ? nl : buf_.size();
    MC_CHECK(end - pos_ <= max_line_, path_, ": line ", line_no_ + 1, " is longer than ", max_line_, " bytes");
    std::string_view view(buf_.data() + pos_, end - pos_);
    consumed_ += static_cast<int64_t>(view.size() + (terminated ? 1 : 0));
    pos_ = terminated ? end + 1 : end;
    ++line_no_;
    if (line_no_ == 1 && view.substr(0, 3) == "\xEF\xBB\xBF") view.remove_prefix(3);
    if (!view.empty() && view.back() == '\r') view.remove_suffix(1);
    if (is_blank(view)) continue;
    line.assign(view.data(), view.size());
    line_number = line_no_;
    return true;
  }
}

std::string parse_jsonl_fields(std::string_view line, const std::vector<std::string>& keys,
                               std::vector<std::string>& values) {
  values.clear();
  nlohmann::json j = nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    // Parse again with exceptions for the parser's message (bad lines are rare).
    try {
      const nlohmann::json again = nlohmann::json::parse(line.begin(), line.end());
      (void)again;
    } catch (const nlohmann::json::exception& e) {
      std::string msg = e.what();
      if (const size_t p = msg.find("parse error"); p != std::string::npos) msg = msg.substr(p);
      return "not valid JSON: " + msg;
    }
    return "not valid JSON";
  }
  if (!j.is_object()) return std::string("not a JSON object (it is ") + json_type_name(j) + ")";
  for (const std::string& key : keys) {
    const auto it = j.find(key);
    if (it == j.end()) return "missing key '" + key + "'";
    if (!it->is_string()) return "key '" + key + "' is " + json_type_name(*it) + ", expected a string";
    values.push_back(it->get<std::string>());
  }
  return "";
}

}  // namespace moecore
