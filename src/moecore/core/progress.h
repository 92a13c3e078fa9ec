// Progress lines with a rate and an estimated time left, for work a person waits on without other
// output (preprocessing, conversion, training before its first log line).
//
//   ProgressLine p("preprocess", total_bytes, log, interval_s);
//   p.update(bytes_done, "12000 documents");   // prints at most once per interval_s
//
// A line reads "<label>: <done>/<total> <unit> (<pct>%), <rate> <unit>/s, ETA <time>[, <detail>]"
// (no total: "<label>: <done> <unit>, <rate> <unit>/s[, <detail>]"). The ETA assumes the rate so
// far holds: (total - done) / (done / elapsed). Nothing is printed before interval_s has passed,
// so quick jobs stay quiet.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>

namespace moecore {

// "45s", "3m05s", "2h07m": the compact durations of the progress lines.
std::string format_duration(double seconds);
// 1.2k / 3.4M / 5.6G style (decimal), e.g. for bytes or tokens.
std::string format_count(double value);

class ProgressLine {
 public:
  using Clock = std::chrono::steady_clock;
  // total <= 0: unknown (no percentage, no ETA). out == nullptr or interval_s <= 0: silent.
  ProgressLine(std::string label, double total, std::string unit, std::ostream* out, double interval_s);
  // Prints a line if interval_s has passed since the last one (or the start). Returns whether it did.
  bool update(double done, const std::string& detail = "");
  // The line's text for `done` after `elapsed_s` seconds (update() prints this).
  std::string line(double done, double elapsed_s, const std::string& detail) const;

 private:
  std::string label_, unit_;
  double total_;
  std::ostream* out_;
  double interval_s_;
  Clock::time_point start_, last_;
};

}  // namespace moecore
