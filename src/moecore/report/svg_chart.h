// Inline SVG charts for the run report (report/run_report.h): line charts with axes, "nice" tick
// values and a legend, and a heatmap with a colour legend. Pure string building, no dependencies,
// no JavaScript: the SVG is meant to sit inside one self-contained HTML page.
//
// Ticks: nice_ticks picks a step of 1, 2 or 5 x 10^k so that about `target` ticks cover [lo, hi],
// and returns the multiples of that step inside the (widened) range; the chart's axis then spans
// the first to the last tick, so every plotted value lies on the axis.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moecore::report {

// Text for an XML/HTML element or attribute: & < > " ' escaped.
std::string xml_escape(std::string_view text);

// Tick values covering [lo, hi] (lo <= hi; equal or non-finite ends are widened), at a step of
// 1, 2 or 5 x 10^k, about `target` of them (at least 2).
std::vector<double> nice_ticks(double lo, double hi, int target = 5);
// A tick label: as few digits as the step needs ("0.25", "1200", "15k", "2.5e-4").
std::string format_tick(double value, double step);
// Bytes as "812 KB", "8.27 MB", "35.2 GB" (decimal units, as the training log's GB).
std::string format_bytes(double bytes);
// A value for the summary ("2.2154", "1.23e+05"): 5 significant digits.
std::string format_value(double value);

// Maps [d0, d1] onto [r0, r1] linearly (d0 == d1 maps everything to the middle).
struct LinearScale {
  double d0 = 0, d1 = 1, r0 = 0, r1 = 1;
  double operator()(double v) const;
};

// The colour for t in [0, 1] on a perceptually ordered dark-blue -> green -> yellow ramp
// (viridis' end points and mid-points, interpolated): "#rrggbb".
std::string ramp_colour(double t);
// The i-th colour of the series palette (cycles).
std::string series_colour(size_t i);

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y); non-finite y breaks the line
  std::string colour;                             // "" = series_colour(index)
  bool markers = false;                           // a dot per point (sparse series: evaluations)
};

struct LineChart {
  std::string title, x_label, y_label;
  std::vector<Series> series;
  int width = 520, height = 300;
};

// <svg> ... </svg>; a chart with no finite point says "no data".
std::string render_line_chart(const LineChart& chart);

struct Heatmap {
  std::string title, x_label, legend_label;
  std::vector<std::string> row_labels;     // one per row
  std::vector<std::vector<double>> cells;  // [rows][columns]
  double vmin = 0, vmax = 1;               // the colour legend's range (values clamp to it)
  int width = 620;
};

std::string render_heatmap(const Heatmap& map);

}  // namespace moecore::report
