#include "moecore/core/progress.h"

#include <cmath>
#include <cstdio>
#include <ostream>

namespace moecore {

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return "?";
  const long long s = std::llround(seconds);
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  return buf;
}

std::string format_count(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a >= 1e9) std::snprintf(buf, sizeof buf, "%.1fG", v / 1e9);
  else if (a >= 1e6) std::snprintf(buf, sizeof buf, "%.1fM", v / 1e6);
  else if (a >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else if (v == std::floor(v)) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.3g", v);  // rates below 1000: 0.5, 2.25, 133
  return buf;
}

ProgressLine::ProgressLine(std::string label, double total, std::string unit, std::ostream* out, double interval_s)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), out_(out), interval_s_(interval_s),
      start_(Clock::now()), last_(start_) {}

std::string ProgressLine::line(double done, double elapsed_s, const std::string& detail) const {
  // Appended piece by piece: g++ 12 warns -Wrestrict (falsely) on long one-expression concatenations.
  const double rate = elapsed_s > 0 ? done / elapsed_s : 0.0;
  std::string s = label_;
  s.append(": ").append(format_count(done));
  if (total_ > 0) {
    char pct[32];
    std::snprintf(pct, sizeof pct, " (%.1f%%)", 100.0 * done / total_);
    s.append("/").append(format_count(total_)).append(" ").append(unit_).append(pct);
  } else {
    s.append(" ").append(unit_);
  }
  s.append(", ").append(format_count(rate)).append(" ").append(unit_).append("/s");
  if (total_ > 0) s.append(", ETA ").append(rate > 0 ? format_duration((total_ - done) / rate) : std::string("?"));
  if (!detail.empty()) s.append(", ").append(detail);
  return s;
}

bool ProgressLine::update(double done, const std::string& detail) {
  if (!out_ || interval_s_ <= 0) return false;
  const Clock::time_point now = Clock::now();
  if (std::chrono::duration<double>(now - last_).count() < interval_s_) return false;
  last_ = now;
  *out_ << line(done, std::chrono::duration<double>(now - start_).count(), detail) << std::endl;
  return true;
}

}  // namespace moecore
