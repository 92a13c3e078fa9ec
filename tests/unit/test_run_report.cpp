// The run report's pieces (report/svg_chart.h, report/run_report.h): scales, tick values and
// labels, escaping, the colour ramp, the charts' SVG, and reading metrics.jsonl (with the errors
// naming the file and line).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>

#include "moecore/core/error.h"
#include "moecore/report/run_report.h"
#include "moecore/report/svg_chart.h"

using namespace moecore;
using namespace moecore::report;

namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("moecore_report_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path / name) << text; }
};

}  // namespace

TEST(SvgChart, EscapesText) {
  EXPECT_EQ(xml_escape("a<b & \"c\" 'd'>"), "a&lt;b &amp; &quot;c&quot; &#39;d&#39;&gt;");
  EXPECT_EQ(xml_escape("plain"), "plain");
}

TEST(SvgChart, LinearScale) {
  const LinearScale s{0, 10, 100, 300};
  EXPECT_DOUBLE_EQ(s(0), 100);
  EXPECT_DOUBLE_EQ(s(5), 200);
  EXPECT_DOUBLE_EQ(s(10), 300);
  const LinearScale flipped{2, 4, 250, 50};  // SVG y grows downwards
  EXPECT_DOUBLE_EQ(flipped(3), 150);
  EXPECT_DOUBLE_EQ((LinearScale{1, 1, 0, 10})(1), 5);  // an empty domain maps to the middle
}

TEST(SvgChart, NiceTicksCoverTheRangeInSteps125) {
  auto check = [](double lo, double hi) {
    const std::vector<double> t = nice_ticks(lo, hi, 5);
    ASSERT_GE(t.size(), 2u);
    EXPECT_LE(t.front(), lo);
    EXPECT_GE(t.back(), hi);
    const double step = t[1] - t[0];
    const double m = step / std::pow(10.0, std::floor(std::log10(step) + 1e-12));
    EXPECT_TRUE(std::abs(m - 1) < 1e-9 || std::abs(m - 2) < 1e-9 || std::abs(m - 5) < 1e-9) << step;
    for (size_t i = 1; i < t.size(); ++i) EXPECT_NEAR(t[i] - t[i - 1], step, step * 1e-9);
    EXPECT_LE(t.size(), 12u);
  };
  check(0, 1);
  check(2.31, 4.87);
  check(1, 60);
  check(3e-5, 3e-4);
  check(-0.5, 0.25);
  check(12000, 19000);
  EXPECT_EQ(nice_ticks(0, 100, 5), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  EXPECT_EQ(nice_ticks(1, 60, 6), (std::vector<double>{0, 10, 20, 30, 40, 50, 60}));
  // One value, or no finite range: widened, still increasing.
  const std::vector<double> one = nice_ticks(4, 4);
  EXPECT_LT(one.front(), 4);
  EXPECT_GT(one.back(), 4);
  EXPECT_GE(nice_ticks(NAN, NAN).size(), 2u);
}

TEST(SvgChart, TickLabels) {
  EXPECT_EQ(format_tick(0, 0.5), "0");
  EXPECT_EQ(format_tick(2.5, 0.5), "2.5");
  EXPECT_EQ(format_tick(40, 20), "40");
  EXPECT_EQ(format_tick(0.25, 0.05), "0.25");
  EXPECT_EQ(format_tick(15000, 5000), "15k");
  EXPECT_EQ(format_tick(12500, 2500), "12.5k");
  EXPECT_EQ(format_tick(3000000, 1000000), "3M");
  EXPECT_EQ(format_tick(2.5e-4, 5e-5), "2.5e-4");
  EXPECT_EQ(format_tick(1e-5, 1e-5), "1e-5");
  EXPECT_EQ(format_value(2.21543), "2.2154");
  EXPECT_EQ(format_bytes(8269800), "8.27 MB");
  EXPECT_EQ(format_bytes(35.2e9), "35.2 GB");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_value(NAN), "-");
}

TEST(SvgChart, ColourRampEndsAndPalette) {
  EXPECT_EQ(ramp_colour(0), "#440154");
  EXPECT_EQ(ramp_colour(1), "#fde725");
  EXPECT_EQ(ramp_colour(-3), ramp_colour(0));  // clamped
  EXPECT_EQ(ramp_colour(7), ramp_colour(1));
  EXPECT_EQ(ramp_colour(0.5).size(), 7u);
  EXPECT_NE(series_colour(0), series_colour(1));
  EXPECT_EQ(series_colour(0), series_colour(10));  // cycles
}

TEST(SvgChart, LineChartHasAxesTicksSeriesAndLegend) {
  LineChart c{"Loss <train>", "iteration", "lm loss", {}, 520, 300};
  c.series.push_back({"training", {{1, 4.0}, {2, 3.0}, {3, NAN}, {4, 2.0}, {5, 1.5}}, "", false});
  c.series.push_back({"validation", {{5, 2.2}}, "", true});
  const std::string svg = render_line_chart(c);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("Loss &lt;train&gt;"), std::string::npos);  // escaped title
  EXPECT_EQ(svg.find("<train>"), std::string::npos);
  EXPECT_EQ(count(svg, "<path "), 1u);           // the training line (validation: one point, a dot)
  const size_t d = svg.find("d=\"");
  const std::string path = svg.substr(d, svg.find('"', d + 3) - d);
  EXPECT_EQ(count(path, "M"), 2u);  // the NaN breaks the line in two runs
  EXPECT_EQ(count(svg, "<circle"), 1u);
  EXPECT_NE(svg.find(">iteration</text>"), std::string::npos);
  EXPECT_NE(svg.find(">lm loss</text>"), std::string::npos);
  EXPECT_NE(svg.find("class=\"legend\""), std::string::npos);
  EXPECT_NE(svg.find(">validation</text>"), std::string::npos);
  EXPECT_GE(count(svg, "class=\"tick\""), 6u);
  EXPECT_EQ(render_line_chart({"Empty", "", "", {}, 300, 200}).find("no data") != std::string::npos, true);
}

TEST(SvgChart, HeatmapCellsAndColourLegend) {
  Heatmap h;
  h.title = "load";
  h.x_label = "expert";
  h.legend_label = "tokens / mean";
  h.row_labels = {"MoE layer 0", "MoE layer 1"};
  h.cells = {{0.5, 1.5, 1.0, 1.0}, {2.0, 0.0, 1.0, 1.0}};
  h.vmin = 0;
  h.vmax = 2;
  const std::string svg = render_heatmap(h);
  EXPECT_EQ(count(svg, "<rect x="), 8u + 1u);  // 8 cells + the legend bar
  EXPECT_NE(svg.find("fill=\"#440154\""), std::string::npos);  // 0 -> the ramp's start
  EXPECT_NE(svg.find("fill=\"#fde725\""), std::string::npos);  // 2 = vmax -> its end
  EXPECT_NE(svg.find("linearGradient"), std::string::npos);
  EXPECT_NE(svg.find(">tokens / mean</text>"), std::string::npos);
  EXPECT_NE(svg.find(">MoE layer 1</text>"), std::string::npos);
}

TEST(RunReport, ReadsMetricsAndRendersAPage) {
  TempDir dir;
  dir.write("metrics.jsonl",
            "{\"iteration\":1,\"lm_loss\":4.5,\"learning_rate\":1e-3,\"grad_norm\":2.0,\"tokens_per_s\":100,"
            "\"tflops_per_gpu\":0.1,\"mem_allocated_bytes\":1e9,\"mem_max_allocated_bytes\":2e9,"
            "\"load_balancing_loss\":1.1,\"z_loss\":0.0,\"skipped_iterations\":0,"
            "\"tokens_per_expert\":[[10,30,20,20],[20,20,20,20]]}\n"
            "{\"iteration\":1,\"memory_report\":[{\"rank\":0,\"weights\":100}]}\n"  // --memory-report's record
            "\n"
            "{\"iteration\":2,\"lm_loss\":null,\"learning_rate\":1e-3,\"grad_norm\":1.0,\"tokens_per_s\":300,"
            "\"skipped_iterations\":1}\n"
            "{\"iteration\":2,\"valid_lm_loss\":3.9}\n"
            "{\"iteration\":3,\"lm_loss\":3.5,\"learning_rate\":5e-4,\"grad_norm\":1.5,\"tokens_per_s\":200,"
            "\"skipped_iterations\":1}\n");
  const RunMetrics m = read_metrics((dir.path / "metrics.jsonl").string());
  ASSERT_EQ(m.train.size(), 3u);
  ASSERT_EQ(m.valid.size(), 1u);
  EXPECT_TRUE(std::isnan(m.train.at(2).lm_loss));  // null: a NaN loss
  EXPECT_EQ(m.train.at(1).lm_loss, 4.5);  // the memory report's record is not a training point
  EXPECT_EQ(m.train.at(1).tokens_per_expert.size(), 2u);
  const std::string out = write_run_report(dir.path.string());
  EXPECT_EQ(out, (dir.path / "report.html").string());
  std::ifstream in(out);
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("http://", 0), html.find("http://www.w3.org/2000/svg"));  // no other link
  EXPECT_GE(count(html, "<svg"), 9u);  // 6 training charts, balancing, heatmap, imbalance
  EXPECT_NE(html.find("class=\"heatmap\""), std::string::npos);
  EXPECT_NE(html.find("Best validation loss</th><td>3.9 (iteration 2)"), std::string::npos);
  EXPECT_NE(html.find("Final training loss</th><td>3.5 (iteration 3)"), std::string::npos);
  EXPECT_NE(html.find("Mean tokens/s</th><td>200 "), std::string::npos);
  // --output elsewhere
  const std::string other = (dir.path / "sub.html").string();
  EXPECT_EQ(write_run_report(dir.path.string(), other), other);
  EXPECT_TRUE(std::filesystem::exists(other));
}

TEST(RunReport, ErrorsNameTheFileAndLine) {
  TempDir dir;
  const std::string file = (dir.path / "metrics.jsonl").string();
  EXPECT_NE(error_of([&] { write_run_report((dir.path / "nope").string()); }).find("is not a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { write_run_report(dir.path.string()); }).find(file + "' not found"), std::string::npos);
  dir.write("metrics.jsonl", "{\"iteration\":1,\"lm_loss\":2}\n{\"iteration\":2,\"lm_loss\":\n");
  EXPECT_NE(error_of([&] { read_metrics(file); }).find(file + ":2: not JSON"), std::string::npos);
  dir.write("metrics.jsonl", "[1,2]\n");
  EXPECT_NE(error_of([&] { read_metrics(file); }).find(file + ":1: expected a JSON object"), std::string::npos);
  dir.write("metrics.jsonl", "{\"lm_loss\":2}\n");
  EXPECT_NE(error_of([&] { read_metrics(file); }).find(file + ":1: no integer \"iteration\""), std::string::npos);
  dir.write("metrics.jsonl", "{\"iteration\":1,\"lm_loss\":2}\n{\"iteration\":2,\"grad_norm\":\"big\"}\n");
  EXPECT_NE(error_of([&] { read_metrics(file); }).find(file + ":2: \"grad_norm\" is not a number"), std::string::npos);
  dir.write("metrics.jsonl", "{\"iteration\":1,\"tokens_per_expert\":[1,2]}\n");
  EXPECT_NE(error_of([&] { read_metrics(file); }).find(file + ":1: \"tokens_per_expert\" holds 1"), std::string::npos);
  dir.write("metrics.jsonl", "\n\n");
  EXPECT_NE(error_of([&] { read_metrics(file); }).find("holds no metrics lines"), std::string::npos);
}
