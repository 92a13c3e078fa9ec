#include "moecore/report/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace moecore::report {

namespace {

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// A coordinate in the SVG: one decimal is finer than a pixel.
std::string px(double v) { return fmt("%.1f", v); }

// "2.5e-04" -> "2.5e-4", "1e+05" -> "1e5".
std::string short_exponent(std::string s) {
  const size_t e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mantissa = s.substr(0, e), exponent = s.substr(e + 1);
  const bool negative = !exponent.empty() && exponent[0] == '-';
  if (!exponent.empty() && (exponent[0] == '-' || exponent[0] == '+')) exponent.erase(0, 1);
  exponent.erase(0, std::min(exponent.find_first_not_of('0'), exponent.size() - 1));
  return mantissa + "e" + (negative ? "-" : "") + exponent;
}

struct Rgb {
  double r, g, b;
};

// Decimals that show every multiple of `step` exactly (2.5 -> 1, 0.05 -> 2, 500 -> 0).
int decimals_for(double step) {
  for (int d = 0; d < 8; ++d) {
    const double scaled = step * std::pow(10.0, d);
    if (std::abs(scaled - std::round(scaled)) < 1e-6 * scaled) return d;
  }
  return 8;
}

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (lo > hi) std::swap(lo, hi);
  if (hi - lo <= std::abs(hi) * 1e-12 || hi == lo) {  // one value: a range around it
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  target = std::max(target, 2);
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  const double first = std::floor(lo / step + 1e-9) * step, last = std::ceil(hi / step - 1e-9) * step;
  std::vector<double> ticks;
  for (double t = first; t <= last + step * 0.5; t += step) ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  if (ticks.size() < 2) ticks.push_back(first + step);
  return ticks;
}

std::string format_tick(double value, double step) {
  if (value == 0) return "0";
  step = std::abs(step);
  const double a = std::abs(value);
  if (a >= 1e4 && step >= 1e3) {  // thousands and millions with a suffix
    const bool mega = a >= 1e6 && step >= 1e5;
    const double unit = mega ? 1e6 : 1e3;
    const int decimals = decimals_for(step / unit);
    return fmt(("%." + std::to_string(decimals) + "f").c_str(), value / unit) + (mega ? "M" : "k");
  }
  const int decimals = decimals_for(step);
  if (decimals <= 4) return fmt(("%." + std::to_string(decimals) + "f").c_str(), value);
  // Small values: scientific, with the digits the step resolves.
  const int digits = std::max(0, static_cast<int>(std::floor(std::log10(a)) - std::floor(std::log10(step) + 1e-9)));
  return short_exponent(fmt(("%." + std::to_string(std::min(digits, 6)) + "e").c_str(), value));
}

std::string format_value(double value) {
  if (!std::isfinite(value)) return "-";
  const double a = std::abs(value);
  if (a >= 1e4 && a < 1e15) {  // 12.5k, 1.21M, 3.4G, 2T: four significant digits
    const char* suffix[] = {"k", "M", "G", "T"};
    int i = 0;
    double v = value / 1e3;
    while (std::abs(v) >= 1000 && i < 3) v /= 1000, ++i;
    return fmt("%.4g", v) + suffix[i];
  }
  if (a != 0 && a < 1e-3) return short_exponent(fmt("%.4e", value));
  return fmt("%.5g", value);
}

std::string format_bytes(double bytes) {
  if (!std::isfinite(bytes)) return "-";
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (std::abs(bytes) >= 1000 && u < 4) bytes /= 1000, ++u;
  return fmt(u == 0 ? "%.0f" : "%.3g", bytes) + " " + units[u];
}

double LinearScale::operator()(double v) const {
  if (d1 == d0) return (r0 + r1) / 2;
  return r0 + (v - d0) / (d1 - d0) * (r1 - r0);
}

std::string ramp_colour(double t) {
  // viridis at 0, 0.25, 0.5, 0.75, 1
  static const Rgb stops[] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  if (!std::isfinite(t)) t = 0;
  t = std::clamp(t, 0.0, 1.0) * 4.0;
  const int i = std::min(static_cast<int>(t), 3);
  const double f = t - i;
  const Rgb& a = stops[i];
  const Rgb& b = stops[i + 1];
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", static_cast<int>(std::lround(a.r + f * (b.r - a.r))),
                static_cast<int>(std::lround(a.g + f * (b.g - a.g))), static_cast<int>(std::lround(a.b + f * (b.b - a.b))));
  return buf;
}

std::string series_colour(size_t i) {
  static const char* const palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                        "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  return palette[i % (sizeof palette / sizeof palette[0])];
}

std::string render_line_chart(const LineChart& chart) {
  const double w = chart.width, h = chart.height;
  const double left = 68, right = 14, top = 34, bottom = 46;
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo, y_lo = x_lo, y_hi = -x_lo;
  for (const Series& s : chart.series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x), y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
    }
  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"" + px(w) + "\" height=\"" +
                    px(h) + "\" viewBox=\"0 0 " + px(w) + " " + px(h) + "\" role=\"img\" aria-label=\"" +
                    xml_escape(chart.title) + "\">\n";
  svg += "<text class=\"title\" x=\"" + px(left) + "\" y=\"20\">" + xml_escape(chart.title) + "</text>\n";
  const double px0 = left, px1 = w - right, py0 = h - bottom, py1 = top;  // plot area
  if (!std::isfinite(x_lo)) {
    svg += "<rect class=\"frame\" x=\"" + px(px0) + "\" y=\"" + px(py1) + "\" width=\"" + px(px1 - px0) +
           "\" height=\"" + px(py0 - py1) + "\"/>\n";
    svg += "<text class=\"nodata\" x=\"" + px((px0 + px1) / 2) + "\" y=\"" + px((py0 + py1) / 2) +
           "\" text-anchor=\"middle\">no data</text>\n</svg>\n";
    return svg;
  }
  // Losses and rates rarely start at zero: the y axis spans the data (nice-rounded).
  const std::vector<double> xt = nice_ticks(x_lo, x_hi, 6), yt = nice_ticks(y_lo, y_hi, 5);
  const LinearScale sx{xt.front(), xt.back(), px0, px1}, sy{yt.front(), yt.back(), py0, py1};
  const double x_step = xt[1] - xt[0], y_step = yt[1] - yt[0];
  svg += "<g class=\"grid\">";
  for (double t : yt) svg += "<line x1=\"" + px(px0) + "\" x2=\"" + px(px1) + "\" y1=\"" + px(sy(t)) + "\" y2=\"" + px(sy(t)) + "\"/>";
  for (double t : xt) svg += "<line x1=\"" + px(sx(t)) + "\" x2=\"" + px(sx(t)) + "\" y1=\"" + px(py1) + "\" y2=\"" + px(py0) + "\"/>";
  svg += "</g>\n<g class=\"axis\">";
  svg += "<line x1=\"" + px(px0) + "\" x2=\"" + px(px1) + "\" y1=\"" + px(py0) + "\" y2=\"" + px(py0) + "\"/>";
  svg += "<line x1=\"" + px(px0) + "\" x2=\"" + px(px0) + "\" y1=\"" + px(py1) + "\" y2=\"" + px(py0) + "\"/>";
  for (double t : xt)
    svg += "<line x1=\"" + px(sx(t)) + "\" x2=\"" + px(sx(t)) + "\" y1=\"" + px(py0) + "\" y2=\"" + px(py0 + 4) +
           "\"/><text class=\"tick\" x=\"" + px(sx(t)) + "\" y=\"" + px(py0 + 16) + "\" text-anchor=\"middle\">" +
           xml_escape(format_tick(t, x_step)) + "</text>";
  for (double t : yt)
    svg += "<line x1=\"" + px(px0 - 4) + "\" x2=\"" + px(px0) + "\" y1=\"" + px(sy(t)) + "\" y2=\"" + px(sy(t)) +
           "\"/><text class=\"tick\" x=\"" + px(px0 - 7) + "\" y=\"" + px(sy(t) + 4) + "\" text-anchor=\"end\">" +
           xml_escape(format_tick(t, y_step)) + "</text>";
  svg += "</g>\n";
  if (!chart.x_label.empty())
    svg += "<text class=\"label\" x=\"" + px((px0 + px1) / 2) + "\" y=\"" + px(h - 8) + "\" text-anchor=\"middle\">" +
           xml_escape(chart.x_label) + "</text>\n";
  if (!chart.y_label.empty())
    svg += "<text class=\"label\" transform=\"translate(14," + px((py0 + py1) / 2) +
           ") rotate(-90)\" text-anchor=\"middle\">" + xml_escape(chart.y_label) + "</text>\n";
  for (size_t i = 0; i < chart.series.size(); ++i) {
    const Series& s = chart.series[i];
    const std::string colour = s.colour.empty() ? series_colour(i) : s.colour;
    std::string path;  // "M" starts a run of finite points, "L" continues it
    bool in_run = false;
    size_t finite = 0;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) {
        in_run = false;
        continue;
      }
      path += (in_run ? "L" : "M") + px(sx(x)) + " " + px(sy(y));
      in_run = true;
      ++finite;
    }
    svg += "<g class=\"series\"><title>" + xml_escape(s.name) + "</title>";
    if (finite > 1) svg += "<path d=\"" + path + "\" fill=\"none\" stroke=\"" + colour + "\" stroke-width=\"1.6\"/>";
    if (s.markers || finite == 1)
      for (const auto& [x, y] : s.points)
        if (std::isfinite(x) && std::isfinite(y))
          svg += "<circle cx=\"" + px(sx(x)) + "\" cy=\"" + px(sy(y)) + "\" r=\"3\" fill=\"" + colour + "\"/>";
    svg += "</g>\n";
  }
  // Legend: in the top margin beside the title, right-aligned, when it fits there; else a box in
  // the plot's top-right corner (up to 8 entries), else one line naming how many there are.
  if (chart.series.size() > 1) {
    auto colour_of = [&](size_t i) {
      return chart.series[i].colour.empty() ? series_colour(i) : chart.series[i].colour;
    };
    auto entry_width = [](const std::string& name) { return 30.0 + 6.4 * static_cast<double>(name.size()); };
    double total = 0, longest = 0;
    for (const Series& s : chart.series) total += entry_width(s.name), longest = std::max(longest, entry_width(s.name));
    const double room = px1 - left - 7.5 * static_cast<double>(chart.title.size()) - 16;
    svg += "<g class=\"legend\">";
    if (total <= room) {
      double x = px1 - total;
      for (size_t i = 0; i < chart.series.size(); ++i) {
        svg += "<line x1=\"" + px(x) + "\" x2=\"" + px(x + 16) + "\" y1=\"16\" y2=\"16\" stroke=\"" + colour_of(i) +
               "\" stroke-width=\"2.5\"/><text x=\"" + px(x + 20) + "\" y=\"20\">" + xml_escape(chart.series[i].name) +
               "</text>";
        x += entry_width(chart.series[i].name);
      }
    } else if (chart.series.size() <= 8) {
      const double x0 = px1 - longest - 8;
      svg += "<rect x=\"" + px(x0) + "\" y=\"" + px(py1 + 4) + "\" width=\"" + px(longest + 4) + "\" height=\"" +
             px(16.0 * static_cast<double>(chart.series.size()) + 6) + "\"/>";
      for (size_t i = 0; i < chart.series.size(); ++i) {
        const double y = py1 + 16 + 16.0 * static_cast<double>(i);
        svg += "<line x1=\"" + px(x0 + 6) + "\" x2=\"" + px(x0 + 22) + "\" y1=\"" + px(y - 4) + "\" y2=\"" + px(y - 4) +
               "\" stroke=\"" + colour_of(i) + "\" stroke-width=\"2.5\"/><text x=\"" + px(x0 + 26) + "\" y=\"" + px(y) +
               "\">" + xml_escape(chart.series[i].name) + "</text>";
      }
    } else {
      svg += "<text x=\"" + px(px1) + "\" y=\"" + px(h - 8) + "\" text-anchor=\"end\">" +
             xml_escape(std::to_string(chart.series.size()) + " lines (hover for names)") + "</text>";
    }
    svg += "</g>\n";
  }
  svg += "</svg>\n";
  return svg;
}

std::string render_heatmap(const Heatmap& map) {
  const size_t rows = map.cells.size();
  size_t cols = 0;
  for (const auto& r : map.cells) cols = std::max(cols, r.size());
  const double left = 86, right = 16, top = 34, legend_h = 56;
  const double cell_w = cols ? std::clamp((map.width - left - right) / static_cast<double>(cols), 2.0, 48.0) : 0;
  const double cell_h = std::clamp(420.0 / std::max<double>(1, static_cast<double>(rows)), 4.0, 26.0);
  const double grid_w = cell_w * static_cast<double>(cols), grid_h = cell_h * static_cast<double>(rows);
  // As wide as the grid (map.width at most, unless the cells are at their narrowest) and the colour
  // legend with its label.
  const double legend_text_w = 6.2 * static_cast<double>(map.legend_label.size());
  const double w = std::max(left + grid_w + right, left + 260 + 10 + legend_text_w + right);
  const double h = top + grid_h + 34 + legend_h;
  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"heatmap\" width=\"" + px(w) + "\" height=\"" +
                    px(h) + "\" viewBox=\"0 0 " + px(w) + " " + px(h) + "\" role=\"img\" aria-label=\"" +
                    xml_escape(map.title) + "\">\n";
  svg += "<text class=\"title\" x=\"" + px(left) + "\" y=\"20\">" + xml_escape(map.title) + "</text>\n";
  const LinearScale colour{map.vmin, map.vmax, 0, 1};
  const bool numbers = cell_w >= 30 && cell_h >= 16;  // the value in each cell where it fits
  for (size_t r = 0; r < rows; ++r) {
    const double y = top + cell_h * static_cast<double>(r);
    if (cell_h >= 9 || r % static_cast<size_t>(std::ceil(9 / cell_h)) == 0)
      svg += "<text class=\"tick\" x=\"" + px(left - 6) + "\" y=\"" + px(y + cell_h / 2 + 4) + "\" text-anchor=\"end\">" +
             xml_escape(r < map.row_labels.size() ? map.row_labels[r] : std::to_string(r)) + "</text>";
    for (size_t c = 0; c < map.cells[r].size(); ++c) {
      const double v = map.cells[r][c], x = left + cell_w * static_cast<double>(c);
      svg += "<rect x=\"" + px(x) + "\" y=\"" + px(y) + "\" width=\"" + px(cell_w) + "\" height=\"" + px(cell_h) +
             "\" fill=\"" + (std::isfinite(v) ? ramp_colour(colour(v)) : std::string("#dddddd")) + "\"><title>" +
             xml_escape((r < map.row_labels.size() ? map.row_labels[r] : std::to_string(r)) + ", expert " +
                        std::to_string(c) + ": " + format_value(v)) +
             "</title></rect>";
      if (numbers && std::isfinite(v))
        svg += "<text class=\"cell\" x=\"" + px(x + cell_w / 2) + "\" y=\"" + px(y + cell_h / 2 + 4) +
               "\" text-anchor=\"middle\" style=\"fill:" + (colour(v) > 0.6 ? "#000" : "#fff") + "\">" +
               xml_escape(fmt("%.2f", v)) + "</text>";
    }
    svg += "\n";
  }
  // Expert numbers under the grid: every column where they fit, else every n-th.
  const size_t every = cols ? std::max<size_t>(1, static_cast<size_t>(std::ceil(22.0 / std::max(cell_w, 1e-9)))) : 1;
  const double gy = top + grid_h;
  for (size_t c = 0; c < cols; c += every)
    svg += "<text class=\"tick\" x=\"" + px(left + cell_w * (static_cast<double>(c) + 0.5)) + "\" y=\"" + px(gy + 14) +
           "\" text-anchor=\"middle\">" + std::to_string(c) + "</text>";
  if (!map.x_label.empty())
    svg += "<text class=\"label\" x=\"" + px(left + grid_w / 2) + "\" y=\"" + px(gy + 30) + "\" text-anchor=\"middle\">" +
           xml_escape(map.x_label) + "</text>\n";
  // Colour legend: a gradient bar with ticks.
  const double ly = gy + 44, lw = 260, lh = 10;
  svg += "<defs><linearGradient id=\"ramp\" x1=\"0\" x2=\"1\" y1=\"0\" y2=\"0\">";
  for (int i = 0; i <= 8; ++i)
    svg += "<stop offset=\"" + fmt("%.3f", i / 8.0) + "\" stop-color=\"" + ramp_colour(i / 8.0) + "\"/>";
  svg += "</linearGradient></defs>";
  svg += "<g class=\"colour-legend\"><rect x=\"" + px(left) + "\" y=\"" + px(ly) + "\" width=\"" + px(lw) +
         "\" height=\"" + px(lh) + "\" fill=\"url(#ramp)\"/>";
  const std::vector<double> lt = nice_ticks(map.vmin, map.vmax, 4);
  const LinearScale lx{map.vmin, map.vmax, left, left + lw};
  for (double t : lt) {
    if (t < map.vmin - 1e-12 || t > map.vmax + 1e-12) continue;
    svg += "<line x1=\"" + px(lx(t)) + "\" x2=\"" + px(lx(t)) + "\" y1=\"" + px(ly + lh) + "\" y2=\"" + px(ly + lh + 3) +
           "\"/><text class=\"tick\" x=\"" + px(lx(t)) + "\" y=\"" + px(ly + lh + 14) + "\" text-anchor=\"middle\">" +
           xml_escape(format_tick(t, lt[1] - lt[0])) + "</text>";
  }
  svg += "<text class=\"label\" x=\"" + px(left + lw + 10) + "\" y=\"" + px(ly + lh) + "\">" +
         xml_escape(map.legend_label) + "</text></g>\n</svg>\n";
  return svg;
}

}  // namespace moecore::report
