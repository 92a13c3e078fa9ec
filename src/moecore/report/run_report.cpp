#include "moecore/report/run_report.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/report/svg_chart.h"

namespace moecore::report {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A number field: NaN when absent or null (the trainer writes a NaN loss as null).
double number(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  MC_CHECK(it->is_number(), where, ": \"", key, "\" is not a number (", it->dump(), ")");
  return it->get<double>();
}

std::vector<std::vector<double>> tokens_per_expert(const nlohmann::json& j, const std::string& where) {
  std::vector<std::vector<double>> out;
  const auto it = j.find("tokens_per_expert");
  if (it == j.end() || it->is_null()) return out;
  MC_CHECK(it->is_array(), where, ": \"tokens_per_expert\" is not a list of layers");
  for (const auto& layer : *it) {
    MC_CHECK(layer.is_array(), where, ": \"tokens_per_expert\" holds ", layer.dump(), ", not a list of expert counts");
    std::vector<double> row;
    for (const auto& v : layer) {
      MC_CHECK(v.is_number(), where, ": \"tokens_per_expert\" holds ", v.dump(), ", not a count");
      row.push_back(v.get<double>());
    }
    out.push_back(std::move(row));
  }
  return out;
}

// max / mean of one layer's counts (1 = perfectly even); NaN for an empty or all-zero layer.
double imbalance(const std::vector<double>& counts) {
  if (counts.empty()) return kNaN;
  double sum = 0, max = 0;
  for (double c : counts) sum += c, max = std::max(max, c);
  return sum > 0 ? max / (sum / static_cast<double>(counts.size())) : kNaN;
}

template <typename F>
Series train_series(const RunMetrics& m, const std::string& name, F value) {
  Series s{name, {}, "", false};
  for (const auto& [it, p] : m.train) s.points.emplace_back(static_cast<double>(it), value(p));
  return s;
}

bool any_finite(const Series& s) {
  return std::any_of(s.points.begin(), s.points.end(), [](const auto& p) { return std::isfinite(p.second); });
}

std::string summary_row(const std::string& name, const std::string& value) {
  return "<tr><th>" + xml_escape(name) + "</th><td>" + xml_escape(value) + "</td></tr>\n";
}

const char* kStyle = R"(body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}p.note{color:#555;font-size:13px;margin:4px 0 12px;max-width:1080px}
table.summary{border-collapse:collapse;font-size:14px;margin:12px 0}table.summary th{text-align:left;font-weight:600;padding:3px 18px 3px 0;color:#444}
table.summary td{padding:3px 0;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:14px}
svg{background:#fff;border:1px solid #ddd;border-radius:4px}
svg text{font-size:11px;fill:#333}svg text.title{font-size:13px;font-weight:600}svg text.label{font-size:11px;fill:#555}
svg text.nodata{fill:#999;font-size:13px}svg text.cell{font-size:10px}
svg .grid line{stroke:#eee}svg .axis line{stroke:#888}svg rect.frame{fill:none;stroke:#ddd}
svg .legend rect{fill:#fff;fill-opacity:.85;stroke:#ddd}svg .colour-legend line{stroke:#888}
)";

// ---- the page's sections

std::string summary_section(const RunMetrics& m) {
  std::string html;
  const TrainPoint* last = m.train.empty() ? nullptr : &m.train.rbegin()->second;
  double tokens_sum = 0, peak = kNaN;
  int64_t tokens_n = 0;
  for (const auto& [it, p] : m.train) {
    if (std::isfinite(p.tokens_per_s)) tokens_sum += p.tokens_per_s, ++tokens_n;
    if (std::isfinite(p.mem_max_allocated_bytes))
      peak = std::isfinite(peak) ? std::max(peak, p.mem_max_allocated_bytes) : p.mem_max_allocated_bytes;
  }
  const int64_t last_iteration = std::max(m.train.empty() ? 0 : m.train.rbegin()->first,
                                          m.valid.empty() ? 0 : m.valid.rbegin()->first);
  html += "<table class=\"summary\">\n";
  html += summary_row("Iterations", std::to_string(last_iteration) + " (" + std::to_string(m.train.size()) +
                                        " logged training lines, " + std::to_string(m.valid.size()) + " validations)");
  html += summary_row("Final training loss", last ? format_value(last->lm_loss) + " (iteration " +
                                                        std::to_string(last->iteration) + ")"
                                                  : "-");
  if (!m.valid.empty()) {
    auto best = m.valid.end();
    for (auto it = m.valid.begin(); it != m.valid.end(); ++it)
      if (std::isfinite(it->second) && (best == m.valid.end() || it->second < best->second)) best = it;
    html += summary_row("Best validation loss", best == m.valid.end()
                                                    ? "-"
                                                    : format_value(best->second) + " (iteration " +
                                                          std::to_string(best->first) + ")");
  } else {
    html += summary_row("Best validation loss", "- (no validation: --eval-interval 0 or no validation data)");
  }
  html += summary_row("Mean tokens/s", tokens_n ? format_value(tokens_sum / static_cast<double>(tokens_n)) +
                                                      " (over the " + std::to_string(tokens_n) + " logged intervals)"
                                                : "-");
  if (std::isfinite(peak)) html += summary_row("Peak memory allocated", format_bytes(peak));
  if (last) html += summary_row("Skipped iterations", std::to_string(last->skipped_iterations));
  html += "</table>\n";
  return html;
}

std::string training_section(const RunMetrics& m) {
  std::string html;
  html += "<h2>Training</h2>\n<div class=\"charts\">\n";
  {
    LineChart loss{"Loss", "iteration", "lm loss", {}, 520, 300};
    loss.series.push_back(train_series(m, "training", [](const TrainPoint& p) { return p.lm_loss; }));
    Series valid{"validation", {}, "", true};
    for (const auto& [it, v] : m.valid) valid.points.emplace_back(static_cast<double>(it), v);
    if (!valid.points.empty()) loss.series.push_back(std::move(valid));
    html += render_line_chart(loss);
  }
  html += render_line_chart(
      {"Learning rate", "iteration", "learning rate", {train_series(m, "learning rate", [](const TrainPoint& p) { return p.learning_rate; })}, 520, 300});
  html += render_line_chart(
      {"Grad norm", "iteration", "grad norm (before clipping)", {train_series(m, "grad norm", [](const TrainPoint& p) { return p.grad_norm; })}, 520, 300});
  html += render_line_chart(
      {"Throughput", "iteration", "tokens/s", {train_series(m, "tokens/s", [](const TrainPoint& p) { return p.tokens_per_s; })}, 520, 300});
  html += render_line_chart(
      {"Model TFLOP/s per GPU", "iteration", "TFLOP/s", {train_series(m, "TFLOP/s per GPU", [](const TrainPoint& p) { return p.tflops_per_gpu; })}, 520, 300});
  html += render_line_chart({"Memory",
                             "iteration",
                             "GB",
                             {train_series(m, "allocated", [](const TrainPoint& p) { return p.mem_allocated_bytes / 1e9; }),
                              train_series(m, "peak allocated", [](const TrainPoint& p) { return p.mem_max_allocated_bytes / 1e9; })},
                             520,
                             300});
  html += "</div>\n";
  return html;
}

// The latest step's tokens per expert, each layer divided by its mean.
std::string expert_load_heatmap(const TrainPoint& per_layer) {
  Heatmap map;
  map.title = "Expert load, iteration " + std::to_string(per_layer.iteration) + " (tokens / layer mean)";
  map.x_label = "expert";
  map.legend_label = "tokens / layer mean (2 and above: brightest)";
  for (size_t l = 0; l < per_layer.tokens_per_expert.size(); ++l) {
    const auto& counts = per_layer.tokens_per_expert[l];
    double sum = 0;
    for (double c : counts) sum += c;
    const double mean = counts.empty() ? 0 : sum / static_cast<double>(counts.size());
    std::vector<double> row;
    for (double c : counts) row.push_back(mean > 0 ? c / mean : kNaN);
    map.row_labels.push_back("MoE layer " + std::to_string(l));
    map.cells.push_back(std::move(row));
  }
  // A fixed scale: 1 (an even share) is its middle, so runs and layers compare by colour; an
  // expert with twice its share or more is at the top (the tooltip has the exact value).
  map.vmin = 0;
  map.vmax = 2;
  return render_heatmap(map);
}

std::string imbalance_chart(const RunMetrics& m) {
  // One line per MoE layer; with more than 8 layers (unreadable as lines), the worst, mean and
  // best layer's max/mean at each logged step.
  LineChart imb{"Expert load imbalance", "iteration", "max / mean (per layer)", {}, 520, 300};
  size_t layers = 0;
  for (const auto& [it, p] : m.train) layers = std::max(layers, p.tokens_per_expert.size());
  if (layers <= 8) {
    for (size_t l = 0; l < layers; ++l) {
      Series s{"MoE layer " + std::to_string(l), {}, "", false};
      for (const auto& [it, p] : m.train)
        s.points.emplace_back(static_cast<double>(it),
                              l < p.tokens_per_expert.size() ? imbalance(p.tokens_per_expert[l]) : kNaN);
      imb.series.push_back(std::move(s));
    }
  } else {
    Series worst{"worst layer", {}, "", false}, mean{"mean of layers", {}, "", false}, best{"best layer", {}, "", false};
    for (const auto& [it, p] : m.train) {
      double hi_v = kNaN, lo_v = kNaN, sum = 0;
      int64_t n = 0;
      for (const auto& counts : p.tokens_per_expert) {
        const double v = imbalance(counts);
        if (!std::isfinite(v)) continue;
        hi_v = n ? std::max(hi_v, v) : v;
        lo_v = n ? std::min(lo_v, v) : v;
        sum += v, ++n;
      }
      const double x = static_cast<double>(it);
      worst.points.emplace_back(x, hi_v);
      mean.points.emplace_back(x, n ? sum / static_cast<double>(n) : kNaN);
      best.points.emplace_back(x, lo_v);
    }
    imb.series = {worst, mean, best};
  }
  return render_line_chart(imb);
}

std::string moe_section(const RunMetrics& m) {
  std::string html;
  LineChart balancing{"MoE balancing losses", "iteration", "loss", {}, 520, 300};
  for (Series s : {train_series(m, "load balancing loss", [](const TrainPoint& p) { return p.load_balancing_loss; }),
                   train_series(m, "z-loss", [](const TrainPoint& p) { return p.z_loss; })})
    if (any_finite(s)) balancing.series.push_back(std::move(s));
  const TrainPoint* per_layer = nullptr;  // the latest line with tokens per expert
  for (auto it = m.train.rbegin(); it != m.train.rend() && !per_layer; ++it)
    if (!it->second.tokens_per_expert.empty()) per_layer = &it->second;
  if (!balancing.series.empty() || per_layer) {
    html += "<h2>Mixture of experts</h2>\n";
    if (per_layer)
      html += "<p class=\"note\">Expert load: tokens routed to each expert at the latest logged step (iteration " +
              std::to_string(per_layer->iteration) +
              ", the step's micro-batches summed over the ranks), divided by the layer's mean, so 1 is an even share; "
              "imbalance is each layer's max / mean over time. MoE layer i is the i-th MoE layer (with "
              "--moe-layer-freq, not decoder layer i).</p>\n";
    html += "<div class=\"charts\">\n";
    if (!balancing.series.empty()) html += render_line_chart(balancing);
    if (per_layer) html += expert_load_heatmap(*per_layer) + imbalance_chart(m);
    html += "</div>\n";
  }
  return html;
}

}  // namespace

RunMetrics read_metrics(const std::string& path) {
  std::error_code ec;
  MC_CHECK(std::filesystem::is_regular_file(path, ec), "'", path,
           "' not found: train with --save DIR (metrics go to DIR/metrics.jsonl) or --metrics-file");
  std::ifstream in(path);
  MC_CHECK(in.good(), "'", path, "': cannot open it for reading");
  RunMetrics m;
  std::string line;
  int64_t number_of_line = 0;
  while (std::getline(in, line)) {
    ++number_of_line;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number_of_line);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      MC_FAIL(where, ": not JSON (", e.what(), ")");
    }
    MC_CHECK(j.is_object(), where, ": expected a JSON object, got ", j.dump());
    const auto it = j.find("iteration");
    MC_CHECK(it != j.end() && it->is_number_integer(), where, ": no integer \"iteration\"");
    const int64_t iteration = it->get<int64_t>();
    if (j.contains("memory_report")) continue;  // --memory-report's record (train/memory_report.h)
    if (j.contains("valid_lm_loss")) {
      m.valid[iteration] = number(j, "valid_lm_loss", where);
      continue;
    }
    TrainPoint p;
    p.iteration = iteration;
    p.lm_loss = number(j, "lm_loss", where);
    p.learning_rate = number(j, "learning_rate", where);
    p.grad_norm = number(j, "grad_norm", where);
    p.tokens_per_s = number(j, "tokens_per_s", where);
    p.tflops_per_gpu = number(j, "tflops_per_gpu", where);
    p.mem_allocated_bytes = number(j, "mem_allocated_bytes", where);
    p.mem_max_allocated_bytes = number(j, "mem_max_allocated_bytes", where);
    p.load_balancing_loss = number(j, "load_balancing_loss", where);
    p.z_loss = number(j, "z_loss", where);
    const double skipped = number(j, "skipped_iterations", where);
    p.skipped_iterations = std::isfinite(skipped) ? static_cast<int64_t>(skipped) : 0;
    p.tokens_per_expert = tokens_per_expert(j, where);
    m.train[iteration] = std::move(p);
  }
  MC_CHECK(in.eof(), "'", path, "': read error after line ", number_of_line);
  MC_CHECK(!m.train.empty() || !m.valid.empty(), "'", path, "' holds no metrics lines (", number_of_line,
           " lines read); expected the JSON lines moecore train writes");
  return m;
}

std::string render_run_report(const RunMetrics& m, const std::string& title) {
  return "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>" +
         xml_escape("moecore run report: " + title) + "</title>\n<style>\n" + kStyle + "</style>\n</head>\n<body>\n<h1>" +
         xml_escape("moecore run report: " + title) + "</h1>\n" + summary_section(m) + training_section(m) + moe_section(m) +
         "<p class=\"note\">Written by moecore report from metrics.jsonl; training values are the averages over each "
         "logging interval (--log-interval), as in the log lines.</p>\n</body>\n</html>\n";
}

std::string write_run_report(const std::string& run_dir, const std::string& output) {
  std::error_code ec;
  MC_CHECK(std::filesystem::is_directory(run_dir, ec), "'", run_dir,
           "' is not a directory: give the run's --save directory (the one holding metrics.jsonl)");
  const std::filesystem::path dir(run_dir);
  const RunMetrics m = read_metrics((dir / "metrics.jsonl").string());
  std::string title = std::filesystem::weakly_canonical(dir, ec).string();  // the run's full path
  if (ec || title.empty()) title = run_dir;
  const std::string out = output.empty() ? (dir / "report.html").string() : output;
  std::ofstream f(out, std::ios::binary | std::ios::trunc);
  MC_CHECK(f.good(), "'", out, "': cannot open it for writing");
  f << render_run_report(m, title);
  f.close();
  MC_CHECK(f.good(), "'", out, "': writing failed");
  return out;
}

}  // namespace moecore::report
